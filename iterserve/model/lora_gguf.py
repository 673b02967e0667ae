"""GGUF LoRA adapters, as llama.cpp's convert_lora_to_gguf.py writes them, read into PEFT's layout.

Such a file says general.type "adapter", adapter.type "lora" and adapter.lora.alpha; per adapted weight
it holds `blk.N.<tensor>.weight.lora_a` (PEFT's lora_A, [r, in]) and `.lora_b` (lora_B, [out, r]).
The converter runs the adapter through the base model's own tensor rewrites, so for the families whose
Q/K rows it permutes (rope on adjacent pairs), lora_b's rows come permuted like the base weight's:
undone here as model/loader.py undoes it for the base. llama.cpp scales a delta by alpha / r (1 when
alpha is 0): rsLoRA's scaling does not survive the conversion, so none is read.
"""
from __future__ import annotations

import re
from typing import Callable

import numpy as np
import torch

from iterserve.model.arch import GGUF_ARCHS, ModelArch
from iterserve.model.loader import unpermute_qk

# llama.cpp's tensor name -> PEFT's module name
MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
           "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
SUPPORTED = "a GGUF LoRA adapter (convert_lora_to_gguf.py) with blk.N.{" + ",".join(MODULES) + "}.weight.lora_a/lora_b"
_PERMUTED = ("llama", "granite")  # GGUF architectures whose Q/K rows convert_hf_to_gguf permutes
_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")

Pairs = dict[tuple[int, str], dict[str, torch.Tensor]]  # (layer, PEFT module) -> {"A": [r, in], "B": [out, r]}


def read_gguf_lora(name: str, path: str, arch: ModelArch) -> tuple[Pairs, Callable[[int], float]]:
    """The adapter's A/B pairs in PEFT's layout and its scale for a rank; ValueError naming what is wrong
    (not a LoRA adapter, an adapter of another family, a tensor of a module not served)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - a corrupt file is the caller's bad input, whatever the reader raises
        raise ValueError(f"LoRA adapter {name!r}: cannot read {path!r} as GGUF: {e}") from None
    fields = {k: _contents(f) for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    _check_header(name, fields, arch)
    pairs: Pairs = {}
    for t in reader.tensors:
        m = _NAME.match(t.name)
        if m is None or m.group(2) not in MODULES:
            raise ValueError(f"LoRA adapter {name!r}: tensor {t.name!r} is not a LoRA weight of a supported "
                             f"module; give {SUPPORTED}")
        w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])  # GGUF: innermost first
        w = np.array(w, dtype=np.float32)  # a copy: the file's mapping goes with the reader
        layer, module, ab = int(m.group(1)), MODULES[m.group(2)], m.group(3).upper()
        if ab == "B" and fields["general.architecture"] in _PERMUTED and module in ("q_proj", "k_proj"):
            w = unpermute_qk(w, arch.num_heads if module == "q_proj" else arch.num_kv_heads)
        pairs.setdefault((layer, module), {})[ab] = torch.from_numpy(w)
    alpha = float(fields.get("adapter.lora.alpha") or 0.0)
    return pairs, (lambda r: alpha / r) if alpha else (lambda r: 1.0)


def _contents(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - an odd field must not stop the checks that name what matters
        return None


def _check_header(name: str, fields: dict, arch: ModelArch) -> None:
    kind = fields.get("general.type", "model")
    if kind != "adapter":
        raise ValueError(f"LoRA adapter {name!r}: the GGUF file's general.type is {kind!r}, not 'adapter' "
                         f"(a model file?); give {SUPPORTED}")
    if fields.get("adapter.type") != "lora":
        raise ValueError(f"LoRA adapter {name!r}: adapter.type {fields.get('adapter.type')!r} is not supported; "
                         f"give {SUPPORTED}")
    if fields.get("adapter.alora.invocation_tokens"):
        raise ValueError(f"LoRA adapter {name!r}: activated LoRA (adapter.alora.invocation_tokens) is not "
                         f"supported; give {SUPPORTED}")
    family = fields.get("general.architecture")
    # llama.cpp writes Mistral and Mixtral as "llama"
    fits = GGUF_ARCHS.get(family) == arch.architecture or (family == "llama" and arch.architecture in
                                                            ("mistral", "mixtral"))
    if not fits:
        raise ValueError(f"LoRA adapter {name!r} is for a {family!r} model; this model is {arch.architecture!r}")
