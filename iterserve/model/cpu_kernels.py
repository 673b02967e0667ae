"""The CPU decode-attention kernel (cpu_decode_attention.cpp), built on first use and loaded with ctypes.

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
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("iterserve.model")

SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "iterserve"
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        return Path(tempfile.gettempdir())


@functools.cache
def decode_attention_kernel(extra_flags: tuple[str, ...] = ()):
    """The C function, or None when it cannot be built here. extra_flags (tests): e.g. -mno-avx512f
    builds the portable loops, -mno-avx512bf16 the AVX-512 path without bf16 dot products."""
    if os.environ.get("ITERSERVE_CPU_KERNELS", "1") == "0":
        return None
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        logger.warning("no C++ compiler: CPU decode attention falls back to gather + torch matmuls (slower)")
        return None
    source = SOURCE.read_bytes()
    flags = [*FLAGS, *extra_flags]
    key = hashlib.sha256(source + " ".join([cxx, *flags]).encode() + _cpu_flags()).hexdigest()[:16]
    lib_path = _cache_dir() / f"cpu_decode_attention-{key}.so"
    if not lib_path.exists():
        tmp = lib_path.with_name(f"{lib_path.name}.{os.getpid()}.tmp")
        try:
            result = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
        except OSError as exc:
            result = subprocess.CompletedProcess([cxx], 127, "", str(exc))
        if result.returncode != 0:
            logger.warning("building the CPU decode-attention kernel failed, falling back to torch:\n%s",
                           result.stderr[-2000:])
            return None
        os.replace(tmp, lib_path)  # atomic: a concurrent process sees no half-written library
    # torch (imported above) has loaded its libgomp.so.1, so the kernel's OpenMP binds to that
    # same runtime and thread pool rather than a second one.
    try:
        fn = ctypes.CDLL(str(lib_path)).iterserve_decode_attention
    except (OSError, AttributeError) as exc:  # a stale or foreign library: fall back, do not crash
        logger.warning("loading the CPU decode-attention kernel failed, falling back to torch: %s", exc)
        return None
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [i32, p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = i32
    return fn


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_threads: int, kernel=None) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D]; caches [num_blocks, block_size, Hkv, D]; tables/lens int32."""
    fn = kernel or decode_attention_kernel()
    q = q.contiguous()
    b, h, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    out = torch.empty_like(q)
    rc = fn(DTYPES[q.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), b, h, hkv, d, block_size, scale, num_threads)
    if rc != 0:
        raise ValueError(f"decode attention kernel: unsupported shape (heads {h}, kv heads {hkv}, head dim {d})")
    return out
