"""All KV blocks, created once: ref counts, an LRU free queue, and the prefix-cache hash map.

Torch-free: block ids index the KV tensor the executor owns; this file only does the bookkeeping.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered for prefix caching


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (head evicted first). Cached blocks stay here with their hash
        # until reused; an OrderedDict gives O(1) pop-head, append and remove-from-middle (cache hit).
        self.free_queue: OrderedDict[int, Block] = OrderedDict(enumerate(self.blocks))
        self.cached: dict[bytes, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def allocate(self, n: int) -> list[Block]:
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._drop_hash(block)  # evicted lazily: the cached content is overwritten from now on
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Share blocks (a prefix-cache hit or a forked sequence): a free cached block leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[Block]) -> None:
        """Release in the given order; callers pass a request's blocks tail first, so its tail is evicted first."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def register(self, block: Block, block_hash: bytes) -> None:
        """Make a full block findable by its prefix hash; the first block with a given hash wins."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def _drop_hash(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use keep their content). Returns how many were dropped."""
        dropped = len(self.cached)
        for block in list(self.cached.values()):
            self._drop_hash(block)
        return dropped
