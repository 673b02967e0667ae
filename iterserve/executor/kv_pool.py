"""The KV pool's memory: zero-page-backed (mmap) pools on CPU, huge pages, and whole blocks moved run by
run between pools (swap, disaggregated hand-off). How many blocks the pool holds is ModelRunner's call
(_num_kv_blocks: given, or profiled on CUDA with a forward pass)."""
from __future__ import annotations

import math
import mmap

import torch

from iterserve.heap import advise_huge_pages, populate


def populate_pool(kv: torch.Tensor) -> None:
    """Fault in every page of a CPU pool now (after pool_on_huge_pages, so they come as huge pages where
    they can): otherwise a first touch zeroes its page in the middle of the step that writes K/V there,
    which a huge page in a virtual machine makes dear (docs/performance.md). Nothing changes a byte;
    where Linux cannot populate, one zero is written per page, which a pool that holds no request's
    K/V yet can take."""
    if kv.numel() == 0 or populate(kv.data_ptr(), kv.nbytes):
        return
    flat = kv.view(-1)
    flat[::max(1, 4096 // kv.element_size())].zero_()


def block_runs(block_ids) -> list[tuple[int, int, int]]:
    """(index in block_ids, first block, count) for each run of consecutive ids: a pool's blocks move
    run by run, as slice copies (a few memcpys each); indexing a pool with the id list went element by
    element, at a third of the speed (docs/disaggregation.md)."""
    runs, i = [], 0
    while i < len(block_ids):
        j = i + 1
        while j < len(block_ids) and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        runs.append((i, block_ids[i], j - i))
        i = j
    return runs


def gather_blocks(pool: torch.Tensor, block_ids) -> torch.Tensor:
    """pool[:, :, block_ids] as a new tensor: every layer's K and V of those blocks, in their order."""
    out = pool.new_empty((*pool.shape[:2], len(block_ids), *pool.shape[3:]))
    for i, first, n in block_runs(block_ids):
        out[:, :, i:i + n] = pool[:, :, first:first + n]
    return out


def scatter_blocks(pool: torch.Tensor, block_ids, blocks: torch.Tensor) -> None:
    """pool[:, :, block_ids] = blocks, in place."""
    for i, first, n in block_runs(block_ids):
        pool[:, :, first:first + n] = blocks[:, :, i:i + n]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """Zeros in an anonymous mapping, which the kernel fills with zero pages on first touch: the KV pool
    costs memory as its blocks are first used, not all of it at start-up (1 GiB written at every start).
    Unwritten pages all read as one zero page. huge_pages: see pool_on_huge_pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # private: Linux gives shared anonymous memory (shmem) huge pages only where shmem_enabled allows,
    # which it does not by default; the tensor keeps the mapping alive
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    kv = torch.frombuffer(mapping, dtype=dtype).view(shape)
    if huge_pages:
        pool_on_huge_pages(kv)
    return kv


def pool_on_huge_pages(kv: torch.Tensor) -> None:
    """Decode reads K/V block by block from all over the pool: over 4 KiB pages nearly every block is
    a TLB miss. Pages first touched from now on come 2 MiB at a time; a block touches one in each
    layer's K and V, so a start that touches a few blocks pays for 2 x layers of them."""
    advise_huge_pages(kv.data_ptr(), kv.nbytes)
