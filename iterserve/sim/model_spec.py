"""The shape of a transformer as the cost model needs it: parameter bytes, K/V bytes per token, FLOPs.

From a preset name, or from a Hugging Face directory / config.json / GGUF file through the engine's
own loader (one parser: the simulator models what the engine can run).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from iterserve.kv.spec import bytes_per_block


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
    kv_dtype: str | None = None  # the KV pool's dtype (kv.spec.DTYPE_BYTES); None: the weights' dtype

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
    def kv_pool_dtype(self) -> str:
        return self.kv_dtype or _DTYPE_NAMES[self.dtype_bytes]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers: 2 * layers * kv_heads * head_dim * bytes (+ an int8
        pool's float32 scale per kv head)."""
        return bytes_per_block(self.num_layers, 1, self.num_kv_heads, self.head_dim, self.kv_pool_dtype)


_DTYPE_NAMES = {4: "float32", 2: "bfloat16", 1: "int8"}


def with_kv_cache_dtype(spec: ModelSpec, kv_cache_dtype: str) -> ModelSpec:
    """The spec with an engine's --kv-cache-dtype applied (auto: the weights' dtype): its K/V bytes per
    token, hence the pool's blocks and the K/V a step reads."""
    return spec if kv_cache_dtype == "auto" else replace(spec, kv_dtype=kv_cache_dtype)


def spec_from_arch(arch, name: str, dtype_bytes: int = 2) -> ModelSpec:
    """The cost model's view of an architecture the loader read (iterserve.model.loader.ModelArch)."""
    return ModelSpec(name=name, num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_heads=arch.num_heads,
                     num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                     intermediate_size=arch.intermediate_size, vocab_size=arch.vocab_size, dtype_bytes=dtype_bytes,
                     tie_word_embeddings=arch.tie_word_embeddings, max_model_len=arch.max_position_embeddings)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int,
           max_len: int, tie: bool = False) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv_heads, hidden // heads, inter, vocab, 2, tie, True, max_len)


# The published config.json fields of each model, as the cost model reads them.
MODEL_PRESETS: dict[str, ModelSpec] = {
    "smollm2-135m": _llama("smollm2-135m", 30, 576, 9, 3, 1536, 49152, 8192, tie=True),
    "llama-2-7b": _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama-3-8b": _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama-3-70b": _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    "mistral-7b": _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768),
    # OPT's ReLU MLP has two matrices, and its LM head is tied to the embedding
    "opt-13b": ModelSpec("opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, 2, True, False, 2048),
}


def get_model_spec(name: str, dtype_bytes: int | None = None) -> ModelSpec:
    """A preset name, a Hugging Face directory / config.json, or a GGUF file."""
    if name in MODEL_PRESETS:
        spec = MODEL_PRESETS[name]
        return replace(spec, dtype_bytes=dtype_bytes) if dtype_bytes else spec
    path = Path(name)
    if path.name == "config.json":
        path = path.parent
    if not (path.is_dir() or (path.suffix == ".gguf" and path.is_file())):
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(MODEL_PRESETS)} "
                         "(or a Hugging Face directory, config.json or .gguf path)")
    from iterserve.model.loader import load_model_arch
    return spec_from_arch(load_model_arch(str(path)), path.stem if path.suffix == ".gguf" else path.name,
                          dtype_bytes or 2)
