"""A quantized GGUF's tensors as the int4 / int8 weights the model serves (quant.py), read one at a time.

Q4_0, Q4_1 and Q4_K hold, per group of 32 inputs, 4-bit codes q with a scale and a minimum: w = q * scale + low
(Q4_0: scale d, low -8 d; Q4_1: d and m; Q4_K: per super-block of 256, d and dmin with 8 sub-blocks of 6-bit
sc and m: scale d * sc, low -dmin * m). That is --quantization int4's group-32 grid, so the codes are served as
they are (quant.Int4Codes), only scale and low rounded to the arithmetic's dtype. Every other quantized type
(Q8_0's per-32 scales, Q5_*, Q6_K, ...) fits neither grid: its tensor alone is dequantized, a slice of rows at
a time, and coded per row in int8 (quant.Int8Codes). No float copy of more than one slice is ever made.

The bytes a mode serves follow from the tensor types and shapes alone (served_bytes), before any data is read.
"""
from __future__ import annotations

import os

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

from iterserve.model import cpu_packing
from iterserve.model.quant import INT4_GROUP, Int4Codes, Int8Codes

FLOAT_TYPES = {T.F32, T.F16, T.BF16, T.F64}
INT4_TYPES = {T.Q4_0, T.Q4_1, T.Q4_K}
_ROWS_AT_ONCE = 4096  # rows dequantized at a time for int8: 4096 x 4096 float32 is 64 MiB


def read_raw(path: str, offset: int, nbytes: int, shape: tuple[int, int], ttype: T) -> np.ndarray:
    """A tensor's blocks as [rows, bytes a row], read with pread: the GGUF is never mapped, so pages it reads are
    the page cache's, not the process's (a mapping would count the whole file in the load's peak)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [memoryview(buf)[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"{path}: the file ends inside a tensor")
            done += got
    finally:
        os.close(fd)
    block, block_bytes = GGML_QUANT_SIZES[ttype]
    return buf.reshape(shape[0], shape[1] // block * block_bytes)


def int4_codes(raw: np.ndarray, ttype: T) -> Int4Codes:
    """Rows of Q4_0 / Q4_1 / Q4_K blocks [N, bytes] -> their codes, scales and minimums (see the top)."""
    n = raw.shape[0]
    block, block_bytes = GGML_QUANT_SIZES[ttype]
    b = raw.reshape(-1, block_bytes)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    if ttype == T.Q4_K:
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = _q4_k_scales(b[:, 4:16])
        scale, low, qs = d * sc, -dmin * m, b[:, 16:]
    else:
        low = -8 * d if ttype == T.Q4_0 else b[:, 2:4].copy().view(np.float16).astype(np.float32)
        scale, qs = d, b[:, 2 if ttype == T.Q4_0 else 4:]
    # each 32 bytes of qs hold 64 codes: the first 32 in the low nibbles, the next 32 in the high ones
    # (Q4_0/Q4_1: 16 bytes, 32 codes, the same split)
    half = min(32, block // 2)
    qs = qs.reshape(qs.shape[0], -1, 1, half)
    q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    groups = raw.shape[1] // block_bytes * (block // INT4_GROUP)
    return Int4Codes(torch.from_numpy(q.reshape(n, -1)), torch.from_numpy(scale.reshape(n, groups)),
                     torch.from_numpy(low.reshape(n, groups)))


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit scales and mins -> [blocks, 8] each (llama.cpp's get_scale_min_k4): bytes 0-3
    and 4-7 hold sub-blocks 0-3's scale and min in their low 6 bits and sub-blocks 4-7's top 2 bits above;
    bytes 8-11 sub-blocks 4-7's low 4 bits of scale (low nibble) and min (high nibble)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1).astype(np.float32)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1).astype(np.float32)
    return sc, m


def int8_codes(raw: np.ndarray, ttype: T) -> Int8Codes:
    """Rows of any other quantized type -> per-row int8 codes, dequantized _ROWS_AT_ONCE rows at a time (codes
    per row do not depend on other rows, so slicing changes nothing)."""
    qs, scales = [], []
    for start in range(0, raw.shape[0], _ROWS_AT_ONCE):
        q, s = cpu_packing.int8_codes(torch.from_numpy(dequantize(raw[start:start + _ROWS_AT_ONCE], ttype)))
        qs.append(q)
        scales.append(s)
    return Int8Codes(torch.cat(qs), torch.cat(scales))


def codes(raw: np.ndarray, ttype: T) -> Int4Codes | Int8Codes:
    return int4_codes(raw, ttype) if ttype in INT4_TYPES else int8_codes(raw, ttype)


# ---------------------------------------------------------------- what a file serves, from its header

def is_linear(gguf_name: str) -> bool:
    """A weight the model runs as a linear layer (not a norm, the embedding, rope factors or a router)."""
    return gguf_name == "output.weight" or (gguf_name.startswith("blk.") and gguf_name.endswith(".weight")
                                             and "norm" not in gguf_name and "ffn_gate_inp" not in gguf_name)


def file_format(tensors: list[tuple[str, str, list[int]]]) -> str | None:
    """What a GGUF's linear weights mostly hold, by parameter count: "int4" (Q4_0/Q4_1/Q4_K: Q4_K_M files,
    whose Q6_K tensors stay int8), "int8" (other quantized types: Q8_0, Q5_*, Q6_K), None (floats).
    tensors: (GGUF name, type name, shape) each."""
    counts = {"int4": 0, "int8": 0, None: 0}
    for name, type_name, shape in tensors:
        if is_linear(name) and not name.endswith("output.weight"):
            counts[_kind(T[type_name])] += int(np.prod(shape))
    return max(counts, key=counts.get)


def _kind(ttype: T) -> str | None:
    return None if ttype in FLOAT_TYPES else "int4" if ttype in INT4_TYPES else "int8"


def served_bytes(tensors: list[tuple[str, str, list[int]]], mode: str | None, dtype: torch.dtype,
                 tied: bool) -> int:
    """The bytes the model holds for this file served in `mode` (None: floats of dtype; "int8"/"int4" from the
    file's codes as the loader reads them; "w8a8" about int8's), from its header alone: what the memory check
    weighs before loading. q/k/v and gate/up fuse into int8 unless every part is Q4 (quant.cat_codes); the head
    is int8 and, tied, the embedding's lookups read its rows; an untied quantized embedding is int8 rows."""
    item, total = dtype.itemsize, 0
    groups: dict[str, list[tuple[str | None, int, int]]] = {}
    for name, type_name, shape in tensors:
        k, n = int(shape[0]), int(np.prod(shape[1:]))  # GGUF lists the inner dimension first
        kind = _kind(T[type_name])
        if mode is None or not (is_linear(name) or name == "token_embd.weight"):
            total += n * k * item
        elif name == "token_embd.weight":
            total += n * k + 4 * n if tied or kind else n * k * item  # tied: the int8 head, whose rows it reads
        else:
            served = "int8" if mode != "int4" or kind == "int8" or name == "output.weight" else "int4"
            groups.setdefault(_fusion_group(name), []).append((served, n, k))
    for parts in groups.values():
        int4 = all(p[0] == "int4" for p in parts)
        total += sum(n * k // 2 + 2 * n * (k // INT4_GROUP) * item if int4 else n * k + 4 * n for _, n, k in parts)
    return total


def _fusion_group(name: str) -> str:
    """q/k/v and gate/up of a layer share a group (one fused weight); every other linear is its own."""
    for part, group in (("attn_q.", "qkv"), ("attn_k.", "qkv"), ("attn_v.", "qkv"), ("ffn_gate.", "gate_up"),
                        ("ffn_up.", "gate_up")):
        if f".{part}" in name:
            return name.split(f".{part}")[0] + group
    return name
