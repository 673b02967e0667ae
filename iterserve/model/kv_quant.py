"""The int8 KV cache (--kv-cache-dtype int8): its layout, and the torch quantize / dequantize that
the C++ kernels match (cpu_ops.cpp writes, cpu_attention.cpp reads) and the tests hold them to.

Each token's K (and V) of each kv head is stored as head_dim int8 values followed by their float32
scale, 4 bytes, in one row: the pool is [layers, 2, blocks, block_size, kv_heads, head_dim + 4] int8.
Inline, because then a block is still one slice of one tensor: swap, copy-on-write, the P/D hand-off
and tensor parallelism move the scales with the values without knowing they are there, and a
kernel reading a head's row finds its scale on the same cache line or the next.

scale = absmax / 127 per (token, kv head), values round(x / scale) (half to even) in [-127, 127];
the scale is kept at least FLT_MIN so that an all-zero row quantizes to zeros, not NaN.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4
_TINY = torch.finfo(torch.float32).tiny


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> [..., head_dim + 4] int8 rows: values, then their scale."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127).clamp_min_(_TINY)
    values = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + 4] int8 rows -> [..., head_dim] values in `dtype` (computed in float32)."""
    scale = rows[..., -SCALE_BYTES:].view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def head_dim_of(layer_cache: torch.Tensor) -> int:
    """The model's head_dim from a layer's (or the pool's) cache of either kind."""
    width = layer_cache.shape[-1]
    return width - SCALE_BYTES if layer_cache.dtype == torch.int8 else width
