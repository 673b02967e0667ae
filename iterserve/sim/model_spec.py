"""The shape of a transformer as the cost model needs it: parameter bytes, K/V bytes per token, FLOPs.

Built from a Hugging Face config dict (Llama, Mistral, Qwen2 and OPT key names), from a local
config.json or GGUF file, or from a preset name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "int8": 1, "fp8": 1}


@dataclass(slots=True, frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False
    gated_mlp: bool = True  # Llama's SwiGLU has three MLP matrices; OPT's ReLU MLP has two
    max_model_len: int = 4096

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (norms and biases are noise at this scale)."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return q + kv + o + mlp

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Everything stored: layers, the embedding, and the LM head unless tied to it."""
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params + embed + (0 if self.tie_word_embeddings else self.lm_head_params)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def spec_from_hf_config(cfg: dict, name: str | None = None, dtype_bytes: int | None = None) -> ModelSpec:
    """Read the fields every HF causal-LM config has, under Llama's or OPT's names."""
    hidden = cfg["hidden_size"]
    heads = cfg.get("num_attention_heads") or cfg["n_head"]
    is_opt = cfg.get("model_type") == "opt"
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16").replace("torch.", "")
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or cfg.get("model_type", "model"),
        num_layers=cfg.get("num_hidden_layers") or cfg["n_layer"],
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg.get("intermediate_size") or cfg.get("ffn_dim") or 4 * hidden,
        vocab_size=cfg["vocab_size"],
        dtype_bytes=dtype_bytes or _DTYPE_BYTES.get(dtype, 2),
        tie_word_embeddings=cfg.get("tie_word_embeddings", is_opt),
        gated_mlp=not is_opt and cfg.get("hidden_act", "silu") in ("silu", "swiglu", "gelu_pytorch_tanh"),
        max_model_len=cfg.get("max_position_embeddings", 4096),
    )


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int,
           max_len: int, tie: bool = False) -> dict:
    return dict(_name_or_path=name, model_type="llama", num_hidden_layers=layers, hidden_size=hidden,
                num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                vocab_size=vocab, max_position_embeddings=max_len, tie_word_embeddings=tie,
                torch_dtype="bfloat16", hidden_act="silu")


# The published config.json fields of each model, trimmed to what the cost model reads.
PRESET_CONFIGS: dict[str, dict] = {
    "smollm2-135m": _llama("smollm2-135m", 30, 576, 9, 3, 1536, 49152, 8192, tie=True),
    "llama-2-7b": {**_llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096), "torch_dtype": "float16"},
    "llama-3-8b": _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama-3-70b": _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    "mistral-7b": _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768),
    "opt-13b": dict(_name_or_path="opt-13b", model_type="opt", num_hidden_layers=40, hidden_size=5120,
                    num_attention_heads=40, ffn_dim=20480, vocab_size=50272, max_position_embeddings=2048,
                    torch_dtype="float16", hidden_act="relu"),
}


def get_model_spec(name: str, dtype_bytes: int | None = None) -> ModelSpec:
    """A preset name, a Hugging Face directory / config.json, or a GGUF file."""
    if name in PRESET_CONFIGS:
        return spec_from_hf_config(PRESET_CONFIGS[name], name, dtype_bytes)
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return spec_from_hf_config(json.loads(path.read_text()), path.parent.name, dtype_bytes)
    if path.suffix == ".gguf" and path.is_file():
        return _spec_from_gguf(str(path), dtype_bytes)
    raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESET_CONFIGS)} "
                     "(or a Hugging Face directory, config.json or .gguf path)")


def _spec_from_gguf(path: str, dtype_bytes: int | None) -> ModelSpec:
    from iterserve.model.loader import load_model_arch
    c = load_model_arch(path)
    return ModelSpec(name=Path(path).stem, num_layers=c.num_layers, hidden_size=c.hidden_size,
                     num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                     intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                     dtype_bytes=dtype_bytes or 2, tie_word_embeddings=c.tie_word_embeddings,
                     max_model_len=c.max_position_embeddings)
