"""White-box checks of a KVCacheManager's bookkeeping, for tests that drive it through the scheduler.

The one place outside iterserve/kv that reads the manager's private state.
"""
from __future__ import annotations

from collections import Counter

from iterserve.kv.kv_cache_manager import KVCacheManager


def check_kv(kv: KVCacheManager, running_ids: set[str]) -> None:
    """Ref counts equal owners, the free queue holds exactly the unowned blocks, block tables match the
    block lists, and only running requests promise prefix blocks that are not cached yet."""
    owners = Counter(b.block_id for blocks in kv._req_blocks.values() for b in blocks)
    for blocks in kv._req_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks), "a request holds a block twice"
    for block in kv._pool.blocks:
        assert block.ref_cnt == owners[block.block_id], f"block {block.block_id} ref count != owners"
        assert (block.block_id in kv._pool.free_queue) == (block.ref_cnt == 0)
    host_owners = Counter(b.block_id for blocks in kv._req_host_blocks.values() for b in blocks)
    for block in kv._host_pool.blocks:
        assert block.ref_cnt == host_owners[block.block_id]
    assert not (kv._req_blocks.keys() & kv._req_host_blocks.keys()), "a request is on device and host at once"
    for rid, ids in kv._req_block_ids.items():
        assert ids == [b.block_id for b in kv._req_blocks[rid]]
    assert set(kv._computing.values()) <= running_ids, "only a running request promises prefix blocks"
    assert not (kv._computing.keys() & kv._pool.cached.keys()), "a promised block is already cached"


def check_kv_drained(kv: KVCacheManager) -> None:
    """Nothing outlives the requests: every device and host block free, no block list, no promise."""
    assert kv.num_free_blocks == kv.num_blocks, "all blocks are free at the end"
    assert kv._host_pool.num_free_blocks == kv._host_pool.num_blocks, "all host blocks are free at the end"
    assert not kv._req_blocks and not kv._req_host_blocks
    assert not kv._computing and not kv._req_computing, "no prefix promise outlives its request"


def holders(kv: KVCacheManager) -> set[str]:
    """The requests that hold a device block list."""
    return set(kv._req_blocks)


def promisers(kv: KVCacheManager) -> set[str]:
    """The requests that promised to compute a prefix block others wait for."""
    return set(kv._computing.values())


def num_free_host_blocks(kv: KVCacheManager) -> int:
    return kv._host_pool.num_free_blocks
