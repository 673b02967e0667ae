"""Memory for the weight panels on transparent huge pages, where the OS has them."""
from __future__ import annotations

import math
import mmap
import threading
import weakref

import torch

from iterserve.heap import HUGE_PAGE


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
