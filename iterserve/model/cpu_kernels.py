"""The CPU kernels: attention (cpu_attention.cpp: decode over the paged cache, causal prompts), the
fused elementwise ops (cpu_ops.cpp) and the linear layer over panel-packed weights (cpu_linear.cpp,
its layouts in cpu_packing.py), bound with ctypes to functions over tensors. Each library is built on
first use (cpu_build.py); where it cannot be, its functions here are None and the callers fall back
to torch (attention.py gathers the context and uses torch's matmuls).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from iterserve.model.cpu_build import (  # noqa: F401 - prebuild: model_runner.py imports it from here
    FLAGS, LINEAR_SOURCE, OPS_FLAG, OPS_SOURCE, SOURCE, _bind, _build, _f32, _i32, _i64, _p, prebuild,
)
from iterserve.model.cpu_packing import INT4_GROUP, PANEL, int8_depth, panel_in_features
from iterserve.model.kv_quant import SCALE_BYTES

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MIXED = 2  # the kernels' code for float32 activations over bfloat16 weights or K/V (--dtype bf16-storage)
# bfloat16 throughout, in a pairs layout (AVX-512 BF16): cpu_linear.cpp's code for its panels, and the decode
# kernel's for a cache (attention.py)
PAIRS = 3
INT8 = 4  # cpu_linear.cpp's code for int8 panels (w8a8) under float32 activations; + 1 under bfloat16
INT8_WEIGHTS = 6  # cpu_linear.cpp's code for weight-only int8 panels under float32 activations (AVX2)
INT4_WEIGHTS = 7  # and for weight-only int4 panels
WEIGHTS_BF16 = 2  # + INT8_WEIGHTS / INT4_WEIGHTS: the same panels under bfloat16 activations (AMX or vdpbf16ps)


_DECODE_ARGS = [_i32, _p, _i64, _p, _p, _p, _i64, _p, _p, _i32, _i32, _i32, _i32, _i32, _f32, _i32, _i32, _f32]
_PROMPT_ARGS = [_i32, _p, _i64, _p, _i64, _p, _i64, _p, _i32, _i32, _i32, _i32, _i32, _f32, _i32, _i32]


def attention_functions(source: Path) -> dict | None:
    """The attention library built from another copy of cpu_attention.cpp (benchmarks/attention_ab.py
    compares a git revision's): its "bf16", "int8" (decode) and "prompt" functions; None unbuilt."""
    lib = _build(source, FLAGS)
    if lib is None:
        return None
    return {"bf16": _bind(lib, "iterserve_decode_attention", _DECODE_ARGS, _i32),
            "int8": _bind(lib, "iterserve_decode_attention_int8", _DECODE_ARGS, _i32),
            "prompt": _bind(lib, "iterserve_prompt_attention", _PROMPT_ARGS, _i32)}


@functools.cache
def decode_attention_kernel(extra_flags: tuple[str, ...] = ()):
    """The C function, or None when it cannot be built here. extra_flags (tests): e.g. -mno-avx512f
    builds the portable loops, -mno-avx512bf16 the AVX-512 path without bf16 dot products."""
    lib = _build(SOURCE, [*FLAGS, *extra_flags])
    return _bind(lib, "iterserve_decode_attention", _DECODE_ARGS, _i32)


@functools.cache
def pairs_supported(head_dim: int, block_size: int, num_heads: int) -> bool:
    """Whether the decode kernel reads a bfloat16 cache in the pair layout for these shapes here
    (AVX-512 BF16 builds, head_dim 64 or 128, blocks of a multiple of 16 positions)."""
    fn = _bind(_build(SOURCE, FLAGS), "iterserve_decode_pairs_supported", [_i32, _i32, _i32], _i32)
    return fn is not None and elementwise_ops() is not None and bool(fn(head_dim, block_size, num_heads))


@functools.cache
def decode_attention_int8_kernel(extra_flags: tuple[str, ...] = ()):
    """The same over an int8 cache (kv_quant.py's layout), from the same library; or None."""
    lib = _build(SOURCE, [*FLAGS, *extra_flags])
    return _bind(lib, "iterserve_decode_attention_int8", _DECODE_ARGS, _i32)


@functools.cache
def prompt_attention_kernel():
    """The causal prompt-attention function (bf16 in AVX-512 BF16 builds, float32 in AVX2 builds without
    AVX-512), or None."""
    lib = _build(SOURCE, FLAGS)
    fn = _bind(lib, "iterserve_prompt_attention", _PROMPT_ARGS, _i32)
    supported = _bind(lib, "iterserve_prompt_attention_supported", [_i32, _i32], _i32)
    return (fn, supported) if fn is not None and supported is not None else None


@functools.cache
def prompt_attention_supported(dtype: torch.dtype, head_dim: int) -> bool:
    kernel = prompt_attention_kernel()
    return kernel is not None and dtype in DTYPES and bool(kernel[1](DTYPES[dtype], head_dim))


@dataclass(frozen=True)
class Ops:
    rms_norm: object
    rope: object
    silu_mul: object
    argmax_rows: object
    write_kv: object
    write_kv_bf16: object
    write_kv_int8: object
    write_kv_pairs: object


@functools.cache
def elementwise_ops(extra_flags: tuple[str, ...] = ()) -> Ops | None:
    """The fused RMSNorm / rotary / silu-and-mul, argmax and K/V write (cpu_ops.cpp), or None.
    extra_flags (tests): -mno-avx512f builds the AVX2 loops where the CPU has AVX2, with -mno-avx2 too the
    portable ones."""
    lib = _build(OPS_SOURCE, [*FLAGS, OPS_FLAG, *extra_flags])
    fns = (_bind(lib, "iterserve_rms_norm", [_i32, _p, _p, _p, _p, _i64, _i64, _f32]),
           _bind(lib, "iterserve_rope", [_i32, _p, _i64, _i64, _i32, _i32, _p, _p, _p]),
           _bind(lib, "iterserve_silu_mul", [_i32, _p, _p, _i64, _i64]),
           _bind(lib, "iterserve_argmax_rows", [_i32, _p, _i64, _i64, _p]),
           _bind(lib, "iterserve_write_kv", [_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64]),
           _bind(lib, "iterserve_write_kv_bf16", [_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64]),
           _bind(lib, "iterserve_write_kv_int8", [_i32, _p, _i64, _p, _i64, _p, _p, _p, _i64, _i32, _i32]),
           _bind(lib, "iterserve_write_kv_pairs", [_p, _i64, _p, _i64, _p, _p, _p, _i64, _i32, _i32, _i32]))
    return Ops(*fns) if all(fns) else None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_threads: int, kernel=None, window: int = 0,
                     softcap: float = 0.0, pairs: bool = False) -> torch.Tensor:
    """q [B, H, D] (each row's heads contiguous, rows any stride: a view into qkv) -> out [B, H, D]
    contiguous; caches [num_blocks, block_size, Hkv, D], or int8 [..., D + 4] (kv_quant.py), read as
    they are, or bfloat16 under a float32 q; tables/lens int32. window > 0: each query sees its last
    `window` positions only; softcap > 0: scores = softcap * tanh(scores / softcap). kernel: the
    function of the cache's kind. pairs: a bfloat16 cache in the pair layout (see pairs_supported)."""
    quantized = k_cache.dtype == torch.int8
    fn = kernel or (decode_attention_int8_kernel() if quantized else decode_attention_kernel())
    b, h, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    _, block_size, hkv, width = k_cache.shape
    assert width == d + (SCALE_BYTES if quantized else 0) and v_cache.dtype == k_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    out = q.new_empty(b, h, d)
    rc = fn(attention_code(q.dtype, k_cache.dtype, pairs), q.data_ptr(), q.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), b, h, hkv, d, block_size, scale, num_threads,
            window, softcap)
    if rc != 0:
        raise ValueError(f"decode attention kernel: unsupported shape (heads {h}, kv heads {hkv}, head dim {d})")
    return out


def attention_code(q_dtype: torch.dtype, cache_dtype: torch.dtype, pairs: bool = False) -> int:
    """The decode kernel's dtype code for these queries over this cache (the Python loop's and
    cpu_decode's): the pair layout, bf16 storage's float32 queries over a bfloat16 cache, or the queries'
    own dtype (an int8 cache's kernel takes that too)."""
    mixed = cache_dtype != torch.int8 and cache_dtype != q_dtype
    assert not mixed or (q_dtype == torch.float32 and cache_dtype == torch.bfloat16)
    assert not pairs or (q_dtype == cache_dtype == torch.bfloat16)
    return PAIRS if pairs else MIXED if mixed else DTYPES[q_dtype]


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_threads: int,
                     window: int = 0) -> torch.Tensor:
    """Causal attention: q [T, H, D] at positions S-T .. S-1, k/v [S, Hkv, D] -> out [T, H, D]; window > 0:
    each query sees its last `window` positions only. Rows may be strided (views into qkv); each row's
    heads contiguous. Only where prompt_attention_supported."""
    t, h, d = q.shape
    s, hkv, _ = k.shape
    assert all(x.stride(2) == 1 and x.stride(1) == d for x in (q, k, v)) and v.shape == k.shape
    out = q.new_empty(t, h, d)
    rc = prompt_attention_kernel()[0](DTYPES[q.dtype], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                                      v.data_ptr(), v.stride(0), out.data_ptr(), t, s, h, hkv, d, scale, num_threads,
                                      window)
    if rc != 0:
        raise ValueError(f"prompt attention kernel: unsupported (dtype {q.dtype}, heads {h}/{hkv}, head dim {d}, {t} of {s})")
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, hidden] -> weight * normalize(x); with residual: residual += x (in place) first, and
    the sum is normalized. All contiguous, one dtype."""
    out = torch.empty_like(x)
    elementwise_ops().rms_norm(DTYPES[x.dtype], x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(),
                               x.shape[0], x.shape[1], eps)
    return out


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
          positions: torch.Tensor) -> None:
    """Rotate the first `heads` heads of each row of x [T, >= heads * head_dim] (row-contiguous) in
    place; cos/sin [max_positions, head_dim] tables, positions [T] int64."""
    assert x.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous() and head_dim <= 1024
    assert positions.dtype == torch.int64 and positions.is_contiguous()
    elementwise_ops().rope(DTYPES[x.dtype], x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim,
                           cos.data_ptr(), sin.data_ptr(), positions.data_ptr())


def silu_mul(gate_up: torch.Tensor, ops: Ops | None = None) -> torch.Tensor:
    """gate_up [T, 2n] (contiguous) -> silu(gate) * up [T, n]."""
    t, n2 = gate_up.shape
    out = gate_up.new_empty(t, n2 // 2)
    (ops or elementwise_ops()).silu_mul(DTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), t, n2 // 2)
    return out


def argmax_rows(x: torch.Tensor, ops: Ops | None = None) -> list[int]:
    """x [S, V] contiguous -> the first index of each row's maximum."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    (ops or elementwise_ops()).argmax_rows(DTYPES[x.dtype], x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out.tolist()


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Caches [num_blocks, block_size, Hkv, D] contiguous; k/v [T, Hkv, D] with each row's heads
    contiguous, in the caches' dtype or float32 into bfloat16 ones (rounded to nearest even);
    slot_mapping [T] int64, negative = skip."""
    t, hkv, d = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
    assert all(x.stride(1) == d and x.stride(2) == 1 for x in (k, v)) and slot_mapping.is_contiguous()
    if k.dtype != k_cache.dtype:
        assert k.dtype == v.dtype == torch.float32 and k_cache.dtype == v_cache.dtype == torch.bfloat16
        return elementwise_ops().write_kv_bf16(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                                               v_cache.data_ptr(), slot_mapping.data_ptr(), t, hkv * d)
    size = k.element_size()
    elementwise_ops().write_kv(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size, k_cache.data_ptr(),
                               v_cache.data_ptr(), slot_mapping.data_ptr(), t, hkv * d * size)


def write_kv_pairs(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """write_kv into bfloat16 caches in the pair layout (attention.py); k/v bfloat16."""
    t, hkv, d = k.shape
    assert k_cache.dtype == v_cache.dtype == k.dtype == v.dtype == torch.bfloat16
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
    assert all(x.stride(1) == d and x.stride(2) == 1 for x in (k, v)) and slot_mapping.is_contiguous()
    elementwise_ops().write_kv_pairs(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                                     v_cache.data_ptr(), slot_mapping.data_ptr(), t, hkv, d, k_cache.shape[1])


def write_kv_int8(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """write_kv into int8 caches [num_blocks, block_size, Hkv, D + 4]: each row quantized as
    kv_quant.quantize_kv does, byte for byte; k/v float32 or bfloat16."""
    t, hkv, d = k.shape
    assert k_cache.dtype == v_cache.dtype == torch.int8 and k_cache.shape[-1] == d + SCALE_BYTES
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
    assert all(x.stride(1) == d and x.stride(2) == 1 for x in (k, v)) and slot_mapping.is_contiguous()
    elementwise_ops().write_kv_int8(DTYPES[k.dtype], k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                    k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), t, hkv, d)


@functools.cache
def linear_kernel(extra_flags: tuple[str, ...] = ()):
    """cpu_linear.cpp's function, or None where it cannot be built or this build has neither AVX-512 nor AVX2 with FMA."""
    lib = _build(LINEAR_SOURCE, [*FLAGS, *extra_flags])
    fn = _bind(lib, "iterserve_linear", [_i32, _p, _i64, _p, _p, _p, _i64, _i64, _i64, _i32], _i32)
    supported = _bind(lib, "iterserve_linear_supported", [], _i32)
    return fn if fn is not None and supported is not None and supported() else None


def _linear_builds(name: str, extra_flags: tuple[str, ...]) -> bool:
    """cpu_linear.cpp's iterserve_linear_<name>_supported() in this build: False where it is not built."""
    if linear_kernel(extra_flags) is None:
        return False
    fn = _bind(_build(LINEAR_SOURCE, [*FLAGS, *extra_flags]), f"iterserve_linear_{name}_supported", [], _i32)
    return bool(fn is not None and fn())


@functools.cache
def linear_pairs_supported(extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether cpu_linear.cpp's build takes bfloat16 panels in the pairs layout (AVX-512 BF16 dot products)."""
    return _linear_builds("pairs", extra_flags)


@functools.cache
def linear_amx_supported(extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether cpu_linear.cpp's build runs the pairs layout on AMX tiles, the OS granting them."""
    return _linear_builds("amx", extra_flags)


@functools.cache
def linear_int8_supported(extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether cpu_linear.cpp's build takes int8 panels (w8a8: AVX-512 VNNI dot products)."""
    return _linear_builds("int8", extra_flags)


@functools.cache
def linear_weight_only_supported(extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether cpu_linear.cpp's build takes weight-only int8 and int4 panels (AVX2 without AVX-512)."""
    return _linear_builds("weight_only", extra_flags)


@functools.cache
def linear_weight_only_bf16_supported(extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether cpu_linear.cpp's build runs the weight-only int8 and int4 panels under bfloat16 activations,
    unpacked to bf16 pairs (AVX-512 BF16: on AMX tiles where the OS grants them, else vdpbf16ps)."""
    return _linear_builds("weight_only_bf16", extra_flags)


def weight_only_code(base: int, x_dtype: torch.dtype) -> int:
    """cpu_linear.cpp's code for weight-only panels (base: INT8_WEIGHTS or INT4_WEIGHTS) under x_dtype
    activations: float32 (the AVX2 kernels) or bfloat16 (AVX-512 BF16)."""
    assert x_dtype in (torch.float32, torch.bfloat16)
    return base + (WEIGHTS_BF16 if x_dtype == torch.bfloat16 else 0)


_NO_WEIGHT_ONLY = ("this build of cpu_linear.cpp has no weight-only {} panels under {} activations (float32: AVX2 "
                   "without AVX-512; bfloat16: AVX-512 BF16)")


def linear_int8_weights(x: torch.Tensor, panels: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None,
                        kernel=None) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 (rows any stride) @ (codes * scales)^T (+ bias, x's dtype) -> [M, n] in x's
    dtype, the weight as pack_int8_weight_panels packed it. Under float32 (AVX2) x enters the kernel as 16-bit
    codes, a scale a row; under bfloat16 (K a multiple of 32) the codes become bfloat16 pairs for the tiles."""
    assert x.shape[1] == k and panels.numel() == -(-n // PANEL) * PANEL * (k + k % 2 + 4)
    assert bias is None or (bias.dtype == x.dtype and bias.is_contiguous())
    return _run_linear(weight_only_code(INT8_WEIGHTS, x.dtype), x, panels, n, bias, kernel,
                       _NO_WEIGHT_ONLY.format("int8", x.dtype))


def linear_int4_weights(x: torch.Tensor, panels: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None,
                        kernel=None) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 (rows any stride) @ (codes * scale + minimum)^T (+ bias, x's dtype) -> [M, n]
    in x's dtype, the weight as pack_int4_weight_panels packed it."""
    assert x.shape[1] == k and k % INT4_GROUP == 0
    assert panels.numel() == -(-n // PANEL) * PANEL * k * 5 // 8  # half a byte a code, 4 bytes a group's pair
    assert bias is None or (bias.dtype == x.dtype and bias.is_contiguous())
    return _run_linear(weight_only_code(INT4_WEIGHTS, x.dtype), x, panels, n, bias, kernel,
                       _NO_WEIGHT_ONLY.format("int4", x.dtype))


def _run_linear(code: int, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None, kernel,
                refused: str) -> torch.Tensor:
    """cpu_linear.cpp's iterserve_linear on x [M, K] (rows any stride) -> y [M, n]; `refused`: the
    ValueError's text where this build cannot run `code`."""
    if x.stride(1) != 1:
        x = x.contiguous()
    y = x.new_empty(x.shape[0], n)
    if (kernel or linear_kernel())(code, x.data_ptr(), x.stride(0), panels.data_ptr(), _ptr(bias), y.data_ptr(),
                                   x.shape[0], n, x.shape[1], torch.get_num_threads()):
        raise ValueError(refused)
    return y


def linear_code(x_dtype: torch.dtype, panels: torch.Tensor) -> int:
    """cpu_linear.cpp's dtype code for activations of x_dtype over these panels."""
    if panels.dtype == torch.int8:
        return INT8 + DTYPES[x_dtype]
    if panels.dim() == 4:
        return PAIRS
    return MIXED if x_dtype != panels.dtype else DTYPES[x_dtype]


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None, kernel=None) -> torch.Tensor:
    """x [M, K] (rows any stride) @ W^T (+ bias) -> [M, n] contiguous, W as pack_panels packed it; one dtype
    throughout, float32 or bfloat16 (either layout), or bfloat16 panels under float32 x, bias and y, or
    pack_int8_panels' under either (x quantized per row in the kernel)."""
    k = x.shape[1]
    code = linear_code(x.dtype, panels)
    assert panel_in_features(panels) == (int8_depth(k) if code >= INT8 else k) and panels.is_contiguous()
    assert code != MIXED or (x.dtype == torch.float32 and panels.dtype == torch.bfloat16)
    assert code != PAIRS or x.dtype == torch.bfloat16  # the pairs layout is bfloat16 throughout
    assert bias is None or (bias.is_contiguous() and bias.dtype == x.dtype)
    return _run_linear(code, x, panels, n, bias, kernel,
                       "this build of cpu_linear.cpp has no AVX-512 BF16 for the pairs layout, or no VNNI for int8")
