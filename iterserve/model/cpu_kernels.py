"""The CPU kernels: attention (cpu_attention.cpp: decode over the paged cache, causal prompts), the
fused elementwise ops (cpu_ops.cpp) and the linear layer over panel-packed weights (cpu_linear.cpp),
built on first use and loaded with ctypes. A CPU ModelRunner starts every build at once in the
background first (prebuild), so a cold start compiles while it loads the weights and the tokenizer.

It is plain C++ with no torch headers, so the system compiler builds it in about a second; the
library is cached under ~/.cache/iterserve keyed by the source, the flags and this CPU's feature
flags (it is built with -march=native). Without a compiler, or with ITERSERVE_CPU_KERNELS=0, it is
absent and attention.py falls back to gathering the context and using torch's matmuls.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import mmap
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from iterserve.heap import HUGE_PAGE
from iterserve.model.kv_quant import SCALE_BYTES

logger = logging.getLogger("iterserve.model")

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
OPS_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
LINEAR_SOURCE = Path(__file__).with_name("cpu_linear.cpp")
DECODE_SOURCE = Path(__file__).with_name("cpu_decode.cpp")  # cpu_decode.py's
OPS_FLAG = "-ffp-contract=off"  # cpu_ops.cpp's: no fused multiply-adds (see its top)
PANEL = 32  # outputs per weight panel: cpu_linear.cpp's kPanel
# ITERSERVE_CPU_ISA=<one of cpu_paths.ISAS> runs this CPU as one that has no more than that: the kernels
# are built without the wider instructions and cpu_flags() hides their flags, so every path a smaller
# x86 CPU takes can be run and tested here (an AMX Xeon runs the AVX2 path as a Zen 3 would).
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
ISA_CAPS = {  # the cap -> (flags the build adds, prefixes of the cpuinfo flags hidden)
    "amx": ((), ()),
    "avx512_bf16": (_NO_AMX, (b"amx",)),
    "avx512": (("-mno-avx512bf16", *_NO_AMX), (b"amx", b"avx512_bf16")),
    "avx2": (("-mno-avx512f", *_NO_AMX), (b"amx", b"avx512")),
    "baseline": (("-mno-avx2", "-mno-fma", "-mno-avx512f", *_NO_AMX), (b"amx", b"avx512", b"avx2", b"fma")),
}
ISA_CAP = os.environ.get("ITERSERVE_CPU_ISA", "amx")
if ISA_CAP not in ISA_CAPS:
    raise ValueError(f"ITERSERVE_CPU_ISA={ISA_CAP!r}: expected one of {', '.join(ISA_CAPS)}")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", *ISA_CAPS[ISA_CAP][0]]
DEFAULT_BUILDS = ((SOURCE, FLAGS), (LINEAR_SOURCE, FLAGS), (OPS_SOURCE, [*FLAGS, OPS_FLAG]), (DECODE_SOURCE, FLAGS))
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MIXED = 2  # the kernels' code for float32 activations over bfloat16 weights or K/V (--dtype bf16-storage)
# bfloat16 throughout, in a pairs layout (AVX-512 BF16): cpu_linear.cpp's code for its panels, and the decode
# kernel's for a cache (attention.py)
PAIRS = 3
INT8 = 4  # cpu_linear.cpp's code for int8 panels (w8a8) under float32 activations; + 1 under bfloat16
INT8_WEIGHTS = 6  # cpu_linear.cpp's code for weight-only int8 panels under float32 activations (AVX2)
INT4_WEIGHTS = 7  # and for weight-only int4 panels
INT4_GROUP = 32  # cpu_linear.cpp's kInt4Group: inputs a scale and a minimum cover (the GGUF block)
INT8_GROUP = 64  # cpu_linear.cpp's kGroup: inputs an activation scale covers, and a column sum


@functools.cache
def cpu_flags() -> bytes:
    """/proc/cpuinfo's flags line (b"" where unreadable), less what ITERSERVE_CPU_ISA hides."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            line = next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""
    hidden = ISA_CAPS[ISA_CAP][1]
    return b" ".join(word for word in line.split() if not word.startswith(hidden))


def cache_dir() -> Path:
    """~/.cache/iterserve (XDG_CACHE_HOME respected): the built kernels, and the weights (weight_cache.py)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "iterserve"
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        return Path(tempfile.gettempdir())


_builds: dict[Path, Future] = {}  # each library's compile, once per process (prebuild starts them early)
_builds_lock = threading.Lock()
_no_compiler_said = threading.Event()


def _compile(cxx: str, flags: list[str], source: Path, lib_path: Path) -> str | None:
    """Compile into lib_path; None, or the compiler's error."""
    tmp = lib_path.with_name(f"{lib_path.name}.{os.getpid()}.tmp")
    try:
        result = subprocess.run([cxx, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True)
    except OSError as exc:
        return str(exc)
    if result.returncode != 0:
        return result.stderr[-2000:]
    os.replace(tmp, lib_path)  # atomic: a concurrent process sees no half-written library
    return None


def _start_build(source: Path, flags: list[str]) -> tuple[Path, Future] | None:
    """The library's cached path and its compile (started here unless cached or under way); None where
    kernels are off or there is no compiler."""
    if os.environ.get("ITERSERVE_CPU_KERNELS", "1") == "0":
        return None
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        if not _no_compiler_said.is_set():  # once a process, not once a library and model
            _no_compiler_said.set()
            logger.warning("no C++ compiler: the CPU path falls back to plain torch ops (slower)")
        return None
    code = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # + includes
    key = hashlib.sha256(code + " ".join([cxx, *flags]).encode() + cpu_flags()).hexdigest()[:16]
    lib_path = cache_dir() / f"{source.stem}-{key}.so"
    with _builds_lock:
        if lib_path not in _builds:
            if lib_path.exists():
                _builds[lib_path] = done = Future()
                done.set_result(None)
            else:  # a thread of its own: it only waits on the compiler, so builds run side by side
                _builds[lib_path] = build = Future()
                threading.Thread(target=lambda: build.set_result(_compile(cxx, flags, source, lib_path)),
                                 name=f"build-{source.stem}", daemon=True).start()
        return lib_path, _builds[lib_path]


def prebuild(wait: bool = False) -> None:
    """Start compiling, side by side in the background, every library the CPU path loads with its default
    flags, so that a cold start's weight and tokenizer loading overlaps them; _build waits for its own.
    wait: return once they are built (`make setup` builds them at install)."""
    started = [_start_build(source, flags) for source, flags in DEFAULT_BUILDS]
    for lib_path, build in filter(None, started) if wait else ():
        if (error := build.result()) is not None:
            logger.warning("building %s failed:\n%s", lib_path.name, error)


def _build(source: Path, flags: list[str]) -> ctypes.CDLL | None:
    """Compile source into a shared library (cached), load it; None where that cannot be done."""
    started = _start_build(source, flags)
    if started is None:
        return None
    lib_path, build = started
    if (error := build.result()) is not None:
        logger.warning("building %s failed, falling back to torch:\n%s", source.name, error)
        return None
    # torch (imported above) has loaded its libgomp.so.1, so the library's OpenMP binds to that
    # same runtime and thread pool rather than a second one.
    try:
        return ctypes.CDLL(str(lib_path))
    except OSError as exc:  # a stale or foreign library: fall back, do not crash
        logger.warning("loading %s failed, falling back to torch: %s", lib_path.name, exc)
        return None


def _bind(lib: ctypes.CDLL | None, name: str, argtypes: list, restype=None):
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        if lib is not None:
            logger.warning("%s is missing from its library, falling back to torch", name)
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


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


class _HugePageArena:
    """Weight panels carved one after another from private anonymous mappings advised for transparent
    huge pages (THP "madvise" mode). A small-batch step streams every weight once, and over 4 KiB pages
    a virtual machine's TLB misses cost a good part of the read bandwidth (docs/performance.md). Chunks
    rather than a mapping per weight: a huge page is committed whole, so each mapping's last one is
    partly waste. Each tensor holds its mapping; the arena only a weak reference to the newest one."""

    CHUNK = 64 << 20

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mapping, self.used, self.end = None, 0, 0  # a weakref to the newest mapping; bytes used, its size

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        with self.lock:
            mapping = self.mapping() if self.mapping is not None else None
            if mapping is None or self.used + size > self.end:
                self.end = max(self.CHUNK, size) + HUGE_PAGE  # room to start on a huge-page boundary
                mapping = mmap.mmap(-1, self.end, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, so the faults take huge pages
                base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
                self.mapping, self.used = weakref.ref(mapping), -base % HUGE_PAGE
            offset, self.used = self.used, self.used + -(-size // 64) * 64  # each tensor cache-line aligned
        return torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=offset).view(dtype).view(shape)


_arena = _HugePageArena() if hasattr(mmap, "MADV_HUGEPAGE") else None


def pack_panels(w: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """W [N, K] -> panels [ceil(N / PANEL), K, PANEL]: panels[p, k, j] = W[p * PANEL + j, k], zero rows past N;
    on huge pages where the OS has them. pairs (bfloat16, K even): [ceil(N / PANEL), K / 2, PANEL, 2],
    panels[p, i, j, e] = W[p * PANEL + j, 2 i + e], what the AVX-512 BF16 dot product takes."""
    n, k = w.shape
    if pairs and (w.dtype != torch.bfloat16 or k % 2):
        raise ValueError(f"the pairs layout takes bfloat16 weights with an even number of inputs, not {w.dtype} x {k}")
    padded = -(-n // PANEL) * PANEL
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    shape = (padded // PANEL, k // 2, PANEL, 2) if pairs else (padded // PANEL, k, PANEL)
    panels = _arena.empty(shape, w.dtype) if _arena is not None else torch.empty(shape, dtype=w.dtype)
    if pairs:
        return panels.copy_(w.view(padded // PANEL, PANEL, k // 2, 2).transpose(1, 2))
    return panels.copy_(w.view(padded // PANEL, PANEL, k).transpose(1, 2))


def int8_depth(k: int) -> int:
    """K rounded up to INT8_GROUP: the depth of an int8 panel's codes."""
    return -(-k // INT8_GROUP) * INT8_GROUP


def int8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (codes [N, K] int8, scales [N] float32): symmetric, one scale an output row, [-127, 127]."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / 127).clamp(min=1e-10)
    return torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def pack_int8_panels(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] float -> int8 panels (--quantization w8a8): [ceil(N / PANEL), bytes] int8, each panel its codes
    quads[Kp / 4][PANEL][4] (Kp = int8_depth(K); int8_codes, zeros padding K and N), then its PANEL float32
    scales, then each group of INT8_GROUP inputs' PANEL column sums of the codes (float32): what
    cpu_linear.cpp's int8 tiles read."""
    n, k = w.shape
    kp, panels_n, groups = int8_depth(k), -(-n // PANEL), int8_depth(k) // INT8_GROUP
    q, scales = int8_codes(w)
    q = torch.nn.functional.pad(q, (0, kp - k, 0, panels_n * PANEL - n))
    scales = torch.nn.functional.pad(scales, (0, panels_n * PANEL - n), value=1.0)
    shape = (panels_n, kp * PANEL + 4 * PANEL * (1 + groups))
    panels = _arena.empty(shape, torch.int8) if _arena is not None else torch.empty(shape, dtype=torch.int8)
    panels[:, :kp * PANEL].view(panels_n, kp // 4, PANEL, 4).copy_(q.view(panels_n, PANEL, kp // 4, 4).transpose(1, 2))
    tail = panels[:, kp * PANEL:].view(torch.float32)  # [panels, PANEL (1 + groups)] words
    tail[:, :PANEL].copy_(scales.view(panels_n, PANEL))
    sums = q.view(panels_n, PANEL, groups, INT8_GROUP).sum(dim=-1, dtype=torch.int32)
    tail[:, PANEL:].view(panels_n, groups, PANEL).copy_(sums.transpose(1, 2))
    return panels


def pack_int8_weight_panels(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Weight-only int8 codes q [N, K] and their row scales [N] -> one flat int8 tensor, what
    linear_int8_weights reads: per panel of PANEL outputs (zeros past N) its codes in pairs of inputs,
    [Kp / 2][PANEL][2] (Kp: K rounded up to even, a zero past K), then ceil(N / PANEL) * PANEL float32
    scales (1 past N)."""
    n, k = q.shape
    kp, panels_n = k + k % 2, -(-n // PANEL)
    padded = panels_n * PANEL
    q = torch.nn.functional.pad(q, (0, kp - k, 0, padded - n))
    out = _arena.empty((padded * (kp + 4),), torch.int8) if _arena is not None else \
        torch.empty(padded * (kp + 4), dtype=torch.int8)
    out[:padded * kp].view(panels_n, kp // 2, PANEL, 2).copy_(q.view(panels_n, PANEL, kp // 2, 2).transpose(1, 2))
    out[padded * kp:].view(torch.float32).copy_(torch.nn.functional.pad(scales.float(), (0, padded - n), value=1.0))
    return out


def linear_int8_weights(x: torch.Tensor, panels: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None,
                        kernel=None) -> torch.Tensor:
    """x [M, K] float32 (rows any stride) @ (codes * scales)^T (+ bias, float32) -> [M, n] float32, the weight
    as pack_int8_weight_panels packed it; x enters the kernel as 16-bit codes, a scale a row."""
    assert x.dtype == torch.float32 and x.shape[1] == k and panels.numel() == -(-n // PANEL) * PANEL * (k + k % 2 + 4)
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    return _run_linear(INT8_WEIGHTS, x, panels, n, bias, kernel,
                       "this build of cpu_linear.cpp has no weight-only int8 panels (AVX2 without AVX-512 only)")


def pack_int4_weight_panels(q: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """Weight-only int4 codes q [N, K] in [0, 15] (w = q * scale + minimum, each group of INT4_GROUP inputs
    its own scale and minimum: scales and minimums [N, K / INT4_GROUP]) -> one flat uint8 tensor, what
    linear_int4_weights reads: per panel of PANEL outputs (zeros past N), per group, its codes in pairs of
    inputs (PANEL bytes a pair: byte j holds output j's code at the even input in its low nibble, at the odd
    one in its high nibble), then the PANEL bf16 scales and the PANEL bf16 minimums."""
    n, k = q.shape
    assert k % INT4_GROUP == 0 and scales.shape == minimums.shape == (n, k // INT4_GROUP)
    panels_n, groups, half = -(-n // PANEL), k // INT4_GROUP, INT4_GROUP // 2
    pad = (0, 0, 0, panels_n * PANEL - n)
    q = torch.nn.functional.pad(q.to(torch.uint8), pad).view(panels_n, PANEL, groups, half, 2)
    codes = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 3, 1)  # [panels, groups, pairs, PANEL]

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [panels, groups, PANEL] bf16's bytes
        t = torch.nn.functional.pad(t.to(torch.bfloat16), pad).view(panels_n, PANEL, groups).transpose(1, 2)
        return t.contiguous().view(torch.uint8)

    group_bytes = half * PANEL + 4 * PANEL
    shape = (panels_n * groups * group_bytes,)
    out = _arena.empty(shape, torch.uint8) if _arena is not None else torch.empty(shape, dtype=torch.uint8)
    out.view(panels_n, groups, group_bytes).copy_(torch.cat(
        [codes.reshape(panels_n, groups, half * PANEL), per_group(scales), per_group(minimums)], dim=-1))
    return out


def linear_int4_weights(x: torch.Tensor, panels: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None,
                        kernel=None) -> torch.Tensor:
    """x [M, K] float32 (rows any stride) @ (codes * scale + minimum)^T (+ bias, float32) -> [M, n] float32,
    the weight as pack_int4_weight_panels packed it."""
    assert x.dtype == torch.float32 and x.shape[1] == k and k % INT4_GROUP == 0
    assert panels.numel() == -(-n // PANEL) * PANEL * k * 5 // 8  # half a byte a code, 4 bytes a group's pair
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    return _run_linear(INT4_WEIGHTS, x, panels, n, bias, kernel,
                       "this build of cpu_linear.cpp has no weight-only int4 panels (AVX2 without AVX-512 only)")


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


def panel_in_features(panels: torch.Tensor) -> int:
    """K of the weight pack_panels packed into `panels`, in either layout; for int8 panels, int8_depth(K)."""
    if panels.dtype == torch.int8:  # bytes = Kp PANEL + 4 PANEL (1 + Kp / INT8_GROUP)
        return (panels.shape[1] - 4 * PANEL) * INT8_GROUP // (PANEL * (INT8_GROUP + 4))
    return panels.shape[1] * (2 if panels.dim() == 4 else 1)


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """W[ids] read back from pack_panels' panels (either layout): [len(ids), K]."""
    rows = panels[ids // PANEL, :, ids % PANEL]
    return rows.reshape(len(ids), panel_in_features(panels))


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
