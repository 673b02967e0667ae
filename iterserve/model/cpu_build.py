"""Building the CPU kernels (cpu_kernels.py binds them): each C++ library is compiled on first use
and loaded with ctypes. A CPU ModelRunner starts every build at once in the background first
(prebuild), so a cold start compiles while it loads the weights and the tokenizer.

It is plain C++ with no torch headers, so the system compiler builds it in about a second; the
library is cached under ~/.cache/iterserve keyed by the source, the headers it may include, the flags
and this CPU's feature flags (it is built with -march=native). Without a compiler, or with
ITERSERVE_CPU_KERNELS=0, it is absent and the callers fall back to torch.
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
import threading
from concurrent.futures import Future
from pathlib import Path

import torch  # noqa: F401 - loaded first: the libraries' OpenMP binds to torch's libgomp (see _build)

logger = logging.getLogger("iterserve.model")

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
OPS_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
LINEAR_SOURCE = Path(__file__).with_name("cpu_linear.cpp")
DECODE_SOURCE = Path(__file__).with_name("cpu_decode.cpp")  # cpu_decode.py's
OPS_FLAG = "-ffp-contract=off"  # cpu_ops.cpp's: no fused multiply-adds (see its top)
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
