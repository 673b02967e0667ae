"""A model's architecture (ModelArch) read from a GGUF header or a Hugging Face config.json: shapes, and
what differs between the supported families (docs/models.md). Anything else is refused here, by name."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from iterserve.model.gguf_file import _gguf_fields, _gguf_tensor, _gguf_vocab


@dataclass(slots=True)
class ModelArch:
    """The architecture read from config.json or a GGUF header: shapes, and what differs between families.

    Every family is the same decoder with these switches (defaults: Llama's); docs/models.md lists
    which family sets which. The model resolves them once at construction."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF style: {"rope_type": "llama3" | "linear" | "longrope", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"  # the family, as HF's model_type names it (GGUF names mapped to these)
    # "pre": a norm before attention and before the MLP (Llama); "sandwich": also one on each
    # one's output (Gemma 2/3); "post": only the output norms (OLMo 2)
    norm_placement: str = "pre"
    norm_weight_offset: float = 0.0  # Gemma's norms scale by (1 + weight): added to the weights at load
    qk_norm: str = "none"  # RMSNorm on q and k before rope: "head" (each head: Qwen3, Gemma 3), "full" (OLMo 2)
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_tanh" (Gemma)
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    residual_multiplier: float = 1.0  # Granite: each block's output is scaled before the residual add
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar; Granite)
    logits_multiplier: float = 1.0  # Granite: 1 / logits_scaling
    attn_logit_softcap: float = 0.0  # Gemma 2: scores = cap * tanh(scores / cap); 0 = off
    final_logit_softcap: float = 0.0  # Gemma 2: the same on the logits
    sliding_window: int = 0  # a windowed layer's query sees the last `sliding_window` positions; 0 = none
    sliding_layers: list[bool] = field(default_factory=list)  # per layer: windowed? (empty: none)
    rope_local_theta: float | None = None  # Gemma 3: the windowed layers' rope base (no scaling)
    # routed experts (Qwen3-MoE, Mixtral): each token's MLP is the router-weighted sum of its top-k experts'
    num_experts: int = 0  # 0: a dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the top-k router probabilities renormalized to sum to 1
    moe_layers: list[bool] = field(default_factory=list)  # per layer: routed? (empty: all, when num_experts)


# The families the forward pass implements, by HF model_type: what their config.json leaves implicit.
FAMILIES: dict[str, dict] = {
    "llama": {}, "mistral": {}, "qwen2": {"attention_bias": True}, "qwen3": {"qk_norm": "head"},
    "gemma2": {"norm_placement": "sandwich", "norm_weight_offset": 1.0},
    "gemma3_text": {"norm_placement": "sandwich", "norm_weight_offset": 1.0, "qk_norm": "head"},
    "phi3": {}, "olmo2": {"norm_placement": "post", "qk_norm": "full"}, "granite": {},
    "qwen3_moe": {"qk_norm": "head"}, "mixtral": {},
}
# GGUF general.architecture -> family. llama.cpp writes Mistral as "llama".
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text",
              "phi3": "phi3", "olmo2": "olmo2", "granite": "granite", "qwen3moe": "qwen3_moe"}
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# Gemma's alternation when a config or GGUF does not list its windowed layers: every Nth layer is global
_DEFAULT_WINDOW_PATTERN = {"gemma2": 2, "gemma3_text": 6}
_GEMMA = ("gemma2", "gemma3_text")  # embeddings scaled by sqrt(hidden), GeGLU


def _refuse(what: str, name, supported) -> ValueError:
    return ValueError(f"unsupported {what} {name!r}: iterserve implements {', '.join(supported)} "
                      "(see docs/models.md)")


def _kind(path: str) -> str:
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return "gguf"
    if p.is_dir() and (p / "config.json").is_file():
        return "hf"
    raise ValueError(f"cannot load a model from {path!r}: expected a .gguf file or a Hugging Face "
                     "directory with config.json and *.safetensors")


def load_model_arch(path: str) -> ModelArch:
    """The architecture of a GGUF file or HF directory; a ValueError naming anything it does not implement."""
    return _gguf_config(path) if _kind(path) == "gguf" else _hf_config(path)


def _gguf_config(path: str) -> ModelArch:
    f = _gguf_fields(path)
    arch = f["general.architecture"]
    if arch not in GGUF_ARCHS:
        raise _refuse("GGUF architecture", arch, GGUF_ARCHS)
    family, names = GGUF_ARCHS[arch], f["_tensor_names"]
    g = lambda key, default=None: f.get(f"{arch}.{key}", default)  # noqa: E731
    experts = int(g("expert_count", 0) or 0)
    if family == "llama" and experts:  # llama.cpp writes Mixtral as llama with experts
        family = "mixtral"
    n, hidden, heads = int(g("block_count")), int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", g("rope.dimension_count", hidden // heads)))
    vocab = g("vocab_size") or len(_gguf_vocab(path))
    window = int(g("attention.sliding_window", 0) or 0)
    # the tensors say whether there are biases; llama.cpp stores Gemma's norms with the 1 added
    defaults = {k: v for k, v in FAMILIES[family].items() if k != "attention_bias"} | {"norm_weight_offset": 0.0}
    gemma = family in _GEMMA
    eos = [int(f[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                               "tokenizer.ggml.eom_token_id") if f.get(k) is not None]
    return ModelArch(
        num_layers=n, hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(g("feed_forward_length")), vocab_size=int(vocab),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=_gguf_rope_scaling(path, g, names),
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names, attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"), eos_token_ids=list(dict.fromkeys(eos)),
        architecture=family, **defaults, hidden_act="gelu_tanh" if gemma else "silu",
        embedding_multiplier=hidden ** 0.5 if gemma else float(g("embedding_scale", 1.0)),
        residual_multiplier=float(g("residual_scale", 1.0)), attention_scale=g("attention.scale"),
        logits_multiplier=1.0 / float(g("logit_scale", 1.0)),
        attn_logit_softcap=float(g("attn_logit_softcapping", 0.0) or 0.0),
        final_logit_softcap=float(g("final_logit_softcapping", 0.0) or 0.0),
        sliding_window=window, sliding_layers=_window_layers(window, g("attention.sliding_window_pattern"), family, n),
        rope_local_theta=float(g("rope.freq_base_swa", 10000.0)) if family == "gemma3_text" else None,
        num_experts=experts, num_experts_per_tok=int(g("expert_used_count", 0) or 0),
        moe_intermediate_size=int(g("expert_feed_forward_length", 0) or g("feed_forward_length")),
        moe_layers=[f"blk.{i}.ffn_gate_inp.weight" in names for i in range(n)] if experts else [])


def _gguf_rope_scaling(path: str, g, names: set[str]) -> dict | None:
    """llama.cpp's scaling keys as HF's rope_scaling; Phi-3's longrope factors are tensors."""
    kind = g("rope.scaling.type", "none")
    if "rope_factors_long.weight" in names:
        return {"rope_type": "longrope", "long_factor": _gguf_tensor(path, "rope_factors_long.weight"),
                "short_factor": _gguf_tensor(path, "rope_factors_short.weight"),
                "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
                "attention_factor": float(g("rope.scaling.attn_factor", 1.0))}
    if kind == "linear" and g("rope.scaling.factor"):
        return {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    if kind not in ("none", "linear"):  # llama3's scaling comes as the rope_freqs tensor, with no type
        raise _refuse("GGUF rope scaling type", kind, ("none", "linear", "Phi-3 longrope factors"))
    return None


def _window_layers(window: int, pattern, family: str, n: int) -> list[bool]:
    """Which layers are windowed: a per-layer list, or N (every Nth layer global, as llama.cpp and
    Gemma count), or the family's default; all layers when the family alternates none."""
    if not window:
        return []
    if isinstance(pattern, (list, tuple)):
        return [bool(x) for x in pattern]
    pattern = pattern or _DEFAULT_WINDOW_PATTERN.get(family)
    return [(i + 1) % pattern != 0 for i in range(n)] if pattern else [True] * n


def _hf_config(path: str) -> ModelArch:
    c = json.loads((Path(path) / "config.json").read_text())
    family = c.get("model_type")
    if family not in FAMILIES:
        raise _refuse("model_type", family, FAMILIES)
    hidden, heads, n = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    for key in ("mlp_bias", "use_bidirectional_attention") + (("attention_bias",) if family != "qwen2" else ()):
        if c.get(key):
            raise ValueError(f"unsupported config: {key}={c[key]!r} in {family} (see docs/models.md)")
    act = c.get("hidden_activation") or c.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise _refuse("activation", act, _ACTIVATIONS)
    theta, scaling, local_theta = _hf_rope(c)
    window, layers = _hf_sliding(c, family, n)
    granite = family == "granite"
    scale = c.get("attention_multiplier") if granite else None
    if c.get("query_pre_attn_scalar"):
        scale = c["query_pre_attn_scalar"] ** -0.5
    return ModelArch(
        num_layers=n, hidden_size=hidden, num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads), head_dim=c.get("head_dim") or hidden // heads,
        intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
        max_position_embeddings=c.get("max_position_embeddings", 2048),
        tie_word_embeddings=c.get("tie_word_embeddings", False), bos_token_id=c.get("bos_token_id"),
        eos_token_ids=_hf_eos_ids(path, c), architecture=family, **FAMILIES[family], hidden_act=_ACTIVATIONS[act],
        embedding_multiplier=hidden ** 0.5 if family in _GEMMA else c.get("embedding_multiplier", 1.0),
        residual_multiplier=c.get("residual_multiplier", 1.0), attention_scale=scale,
        logits_multiplier=1.0 / c.get("logits_scaling", 1.0),
        attn_logit_softcap=c.get("attn_logit_softcapping") or 0.0,
        final_logit_softcap=c.get("final_logit_softcapping") or 0.0,
        sliding_window=window, sliding_layers=layers, rope_local_theta=local_theta, **_hf_moe(c, n))


def _hf_moe(c: dict, n: int) -> dict:
    """Routed experts: Qwen3-MoE's dense layers are mlp_only_layers and those off decoder_sparse_step."""
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    if not experts:
        return {}
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
    return dict(num_experts=experts, num_experts_per_tok=c["num_experts_per_tok"],
                moe_intermediate_size=c.get("moe_intermediate_size") or c["intermediate_size"],
                norm_topk_prob=c.get("norm_topk_prob", True),
                moe_layers=[i not in dense and (i + 1) % step == 0 for i in range(n)])


def _hf_eos_ids(path: str, c: dict) -> list[int]:
    """Every EOS id of config.json and generation_config.json (Llama 3 lists several), in order."""
    gen = Path(path) / "generation_config.json"
    ids = []
    for src in (c, json.loads(gen.read_text()) if gen.is_file() else {}):
        e = src.get("eos_token_id")
        ids += [int(x) for x in (e if isinstance(e, list) else [e]) if x is not None]
    return list(dict.fromkeys(ids))


def _hf_rope(c: dict) -> tuple[float, dict | None, float | None]:
    """(theta, scaling or None, the windowed layers' theta or None). transformers >= 5 writes
    `rope_parameters` (theta included; per layer type for Gemma 3), older configs `rope_theta` +
    `rope_scaling` (+ `rope_local_base_freq`)."""
    params = dict(c.get("rope_parameters") or {})
    local = None
    if "full_attention" in params:
        local, params = params.get("sliding_attention"), dict(params["full_attention"])
    rope = {**(c.get("rope_scaling") or {}), **params}
    theta = c.get("rope_theta") or rope.get("rope_theta") or 10000.0
    kind = rope.get("rope_type", rope.get("type", "default"))
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if kind not in ROPE_TYPES:
        raise _refuse("rope type", kind, ROPE_TYPES)
    if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("unsupported config: partial_rotary_factor != 1 (see docs/models.md)")
    scaling = None if kind == "default" else {**rope, "rope_type": kind}
    if kind == "longrope":
        orig = rope.get("original_max_position_embeddings") or c.get("original_max_position_embeddings") \
            or c["max_position_embeddings"]
        factor = rope.get("factor") or c["max_position_embeddings"] / orig
        default_mscale = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
        scaling.update(original_max_position_embeddings=orig,
                       attention_factor=rope.get("attention_factor") or default_mscale)
    local_theta = c.get("rope_local_base_freq")
    if local is not None:
        if local.get("rope_type", "default") != "default":
            raise _refuse("rope type of the windowed layers", local["rope_type"], ("default",))
        local_theta = local.get("rope_theta", 10000.0)
    return theta, scaling, local_theta


def _hf_sliding(c: dict, family: str, n: int) -> tuple[int, list[bool]]:
    window = int(c.get("sliding_window") or 0)
    types = c.get("layer_types")
    if types:
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise _refuse("layer type", sorted(unknown)[0], ("full_attention", "sliding_attention"))
        layers = [t == "sliding_attention" for t in types]
    elif family in ("qwen2", "qwen3"):  # their configs window only with use_sliding_window, from max_window_layers on
        layers = [bool(c.get("use_sliding_window")) and i >= c.get("max_window_layers", 0) for i in range(n)]
    else:
        pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern")
        layers = _window_layers(window, pattern, family, n)
    return (window, layers) if window and any(layers) else (0, [])
