"""The process's memory as Linux holds it, torch-free: the C library's heap handed back to the OS, and
2 MiB pages asked for under large buffers."""
from __future__ import annotations

import ctypes
import os

_LIBC = ctypes.CDLL(None, use_errno=True)
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def trim_heap() -> None:
    """malloc_trim(0): glibc keeps freed chunks mapped in its arenas (below a heap's top, or in a thread's
    arena) until then, so memory a process has freed can stay resident. Nothing where the C library has
    none (not glibc)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def advise_huge_pages(address: int, nbytes: int) -> None:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside [address, address + nbytes) of a mapping,
    before their first touch: anonymous memory then faults in huge pages (transparent huge pages in
    `madvise` mode), and a file's pages are read ahead into 2 MiB page-cache folios and mapped whole where
    the file system keeps such folios. Either way one TLB entry covers 2 MiB, which a read streaming
    weights or scattered K/V blocks feels in a virtual machine. A no-op where Linux refuses it."""
    start, end = -(-address // HUGE_PAGE) * HUGE_PAGE, (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or os.uname().sysname != "Linux":
        return
    madvise = getattr(_LIBC, "madvise", None)
    if madvise is not None:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)


def populate(address: int, nbytes: int) -> bool:
    """madvise(MADV_POPULATE_WRITE): fault in the mapping's pages of [address, address + nbytes) now, as a
    write would, without changing a byte. False where Linux refuses it (before 5.14, or not Linux)."""
    madvise = getattr(_LIBC, "madvise", None)
    if madvise is None or os.uname().sysname != "Linux" or nbytes <= 0:
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    start = address // page * page
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + nbytes - start), _MADV_POPULATE_WRITE) == 0
