from hypothesis import given, settings, strategies as st

from iterserve.kv.block_pool import BlockPool
from iterserve.kv.kv_cache_manager import KVCacheManager, hash_block
from iterserve.request import Request, RequestTimes
from iterserve.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), RequestTimes(0.0), cache_salt=salt)


def test_free_queue_evicts_lru_and_request_tail_first():
    pool = BlockPool(6)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.free(a[::-1])  # a request frees its tail first
    pool.free(b[::-1])
    order = list(pool.free_queue)
    assert order == [5, a[2].block_id, a[1].block_id, a[0].block_id, b[1].block_id, b[0].block_id]


def test_cached_block_survives_free_until_reused():
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.register(blk, b"h")
    pool.free([blk])
    assert pool.lookup(b"h") is blk
    pool.touch([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in pool.free_queue
    pool.free([blk])
    pool.allocate(2)  # reuse evicts the hash lazily
    assert pool.lookup(b"h") is None


def test_prefix_hit_reuses_full_blocks_and_recomputes_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(12)))
    assert kv.allocate_slots(first, 12) is not None
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first)
    same = make_request("b", list(range(12)))
    hits, n = kv.get_computed_blocks(same)
    assert n == 8 and [b.block_id for b in hits] == kv.block_table("a")[:2]  # last block recomputed
    longer = make_request("c", list(range(12)) + [99])
    hits, n = kv.get_computed_blocks(longer)
    assert n == 12
    salted = make_request("d", list(range(12)) + [99], salt="tenant-2")
    assert kv.get_computed_blocks(salted) == ([], 0)


def test_hash_is_chained_over_the_prefix():
    assert hash_block(None, [1, 2], None) != hash_block(hash_block(None, [0, 0], None), [1, 2], None)
    assert len(hash_block(None, [1], None)) == 16  # 128 bits


def test_each_block_is_hashed_once_in_a_request_s_life(monkeypatch):
    """Looked up step after step while it waits, admitted, computed, preempted and readmitted: every
    block is hashed once, and the hashes are the chain the router computes for the prompt."""
    import iterserve.kv.kv_cache_manager as kv_module
    from iterserve.router.policy import prompt_block_hashes
    hashed = []
    real = kv_module.hash_block
    monkeypatch.setattr(kv_module, "hash_block", lambda *args: hashed.append(args[1]) or real(*args))
    kv = KVCacheManager(num_blocks=16, block_size=4)
    r = make_request("a", list(range(18)), salt="t")  # 4 full blocks and 2 tokens
    for _ in range(3):
        assert kv.get_computed_blocks(r) == ([], 0)  # waiting: nothing cached yet
    kv.allocate_slots(r, 18)
    kv.mark_computing(r, [])
    r.num_computed_tokens = 18
    kv.cache_full_blocks(r)
    kv.free(r)  # preempted (recompute): the blocks stay cached
    r.num_computed_tokens = 0
    hits, n = kv.get_computed_blocks(r)
    assert n == 16 and len(hashed) == 4
    assert [b.block_hash for b in hits] == r.block_hashes == prompt_block_hashes(list(range(18)), 4, "t")


def test_allocate_returns_none_when_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_request("a", list(range(9)))
    assert kv.allocate_slots(r, 9) is None
    assert kv.num_free_blocks == 2 and kv.blocks_of("a") == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=60))
def test_pool_ref_counts_match_owners(ops):
    pool = BlockPool(12)
    owned: list[list] = []
    for alloc, n in ops:
        if alloc and n <= pool.num_free_blocks:
            owned.append(pool.allocate(n))
        elif owned:
            pool.free(owned.pop(n % len(owned))[::-1])
        held = [b for blocks in owned for b in blocks]
        assert len({b.block_id for b in held}) == len(held)
        assert pool.num_free_blocks + len(held) == 12
    for blocks in owned:
        pool.free(blocks)
    assert pool.num_free_blocks == 12 and all(b.ref_cnt == 0 for b in pool.blocks)
