"""The C library's heap, handed back to the OS: glibc keeps freed chunks mapped in its arenas (below a
heap's top, or in a thread's arena) until malloc_trim, so memory a process has freed can stay resident."""
from __future__ import annotations

import ctypes

_LIBC = ctypes.CDLL(None)


def trim_heap() -> None:
    """malloc_trim(0); nothing where the C library has none (not glibc)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
