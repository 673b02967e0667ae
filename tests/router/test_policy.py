"""Router invariants, over random replica sets, loads and request streams."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from iterserve.kv.kv_cache_manager import KVCacheManager
from iterserve.request import Request, RequestTimes
from iterserve.router import (
    POLICIES, LeastKVRouter, PowerOfTwoRouter, PrefixAffinityRouter, ReplicaLoad, make_router,
    prompt_block_hashes,
)
from iterserve.sampling_params import SamplingParams

BS = 4
replica_sets = st.lists(st.sampled_from([f"r{i}" for i in range(12)]), min_size=1, max_size=8, unique=True)
reports = st.builds(ReplicaLoad, st.integers(0, 40), st.integers(0, 40), st.floats(0, 1))
prompts = st.lists(st.integers(0, 50), min_size=1, max_size=40)


@given(policy=st.sampled_from(POLICIES), seed=st.integers(0, 1000), data=st.data())
@settings(max_examples=60, deadline=None)
def test_always_a_live_replica_never_a_dead_one(policy, seed, data):
    router = make_router(policy, seed)
    for _ in range(data.draw(st.integers(1, 30))):
        live = data.draw(replica_sets)  # replicas come and go between requests
        loads = {r: data.draw(reports) for r in live}
        hashes = prompt_block_hashes(data.draw(prompts), BS)
        choice = router.choose(hashes, loads)
        assert choice in loads
        router.on_routed(choice, hashes)
        if data.draw(st.booleans()):
            router.on_finished(choice)


@pytest.mark.parametrize("policy", POLICIES)
def test_no_live_replica_is_an_error(policy):
    with pytest.raises(ValueError, match="no live replica"):
        make_router(policy).choose([], {})


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="router must be one of"):
        make_router("random")


@given(n=st.integers(2, 8), tenants=st.integers(1, 6), num=st.integers(1, 60), seed=st.integers(0, 100))
@settings(max_examples=60, deadline=None)
def test_affinity_sticks_while_balanced(n, tenants, num, seed):
    """Each tenant's requests share a prefix; the reported loads wander but stay within the
    threshold, so a tenant never leaves the replica that first served it (least-loaded would)."""
    import random
    rng = random.Random(seed)
    router = PrefixAffinityRouter(max_imbalance=2)
    loads = {f"r{i}": ReplicaLoad() for i in range(n)}
    home: dict[int, str] = {}
    for _ in range(num):
        t = rng.randrange(tenants)
        loads = {r: ReplicaLoad(num_running=rng.randrange(3)) for r in loads}
        hashes = prompt_block_hashes([1000 + t] * 12 + [rng.randrange(50) for _ in range(6)], BS)
        choice = router.choose(hashes, loads)
        assert home.setdefault(t, choice) == choice
        router.on_routed(choice, hashes)
        router.on_finished(choice)


def test_affinity_gives_way_to_an_overloaded_target():
    router = PrefixAffinityRouter(max_imbalance=3)
    hashes = prompt_block_hashes(list(range(40)), BS)
    loads = {"a": ReplicaLoad(), "b": ReplicaLoad()}
    router.on_routed("a", hashes)
    loads["a"] = ReplicaLoad(num_running=3)
    assert router.choose(hashes, loads) == "a"  # 3 above the least loaded: still within the threshold
    loads["a"] = ReplicaLoad(num_running=4)
    assert router.choose(hashes, loads) == "b"
    loads["a"] = ReplicaLoad(num_running=1, kv_usage=0.99)  # little queued, but its cache is full
    assert router.choose(hashes, loads) == "b"


def test_affinity_follows_the_longest_known_prefix_and_skips_dead_owners():
    router = PrefixAffinityRouter()
    shared, longer = list(range(9)), list(range(17))
    router.on_routed("a", prompt_block_hashes(shared, BS))
    router.on_routed("b", prompt_block_hashes(longer, BS))  # b also computed the shared blocks
    hashes = prompt_block_hashes(longer + [99] * 8, BS)
    loads = {"a": ReplicaLoad(), "b": ReplicaLoad(), "c": ReplicaLoad()}
    router.in_flight.clear()
    assert router.affinity(hashes, loads) == ("b", 4)
    del loads["b"]
    assert router.affinity(hashes, loads) == (None, 0)  # b's blocks overwrote a's ownership
    assert router.choose(hashes, loads) in ("a", "c")


@pytest.mark.parametrize("policy", POLICIES)
@given(n=st.integers(1, 8), num=st.integers(1, 200), seed=st.integers(0, 10_000))
@settings(max_examples=40, deadline=None)
def test_load_balance_under_uniform_prompts(policy, n, num, seed):
    """Distinct prompts, none finishing: the in-flight spread stays within one request (round-robin,
    affinity falling back to least-loaded); power of two choices keeps the busiest replica within
    log2(log2(n)) + O(1) of the mean (the two-choice bound; its least loaded can lag further)."""
    import random
    router = make_router(policy, seed)
    rng = random.Random(seed)
    loads = {f"r{i}": ReplicaLoad() for i in range(n)}
    for _ in range(num):
        hashes = prompt_block_hashes([rng.randrange(1 << 30) for _ in range(9)], BS)
        router.on_routed(router.choose(hashes, loads), hashes)
    counts = [router.in_flight.get(r, 0) for r in loads]
    if isinstance(router, PowerOfTwoRouter) and n > 2:
        assert max(counts) - num / n <= math.log2(math.log2(n)) + 3, counts
    else:
        assert max(counts) - min(counts) <= 1, counts


@given(tokens=st.lists(st.integers(0, 999), min_size=1, max_size=70), salt=st.none() | st.text(max_size=3))
@settings(max_examples=60, deadline=None)
def test_prompt_hashes_are_the_kv_managers(tokens, salt):
    """A replica that computed the prompt finds exactly these blocks in its prefix cache."""
    kv = KVCacheManager(64, BS)
    req = Request("a", tokens, SamplingParams(), RequestTimes(0.0), cache_salt=salt)
    kv.allocate_slots(req, len(tokens))
    req.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(req)
    kv.free(req)
    again = Request("b", tokens, SamplingParams(), RequestTimes(0.0), cache_salt=salt)
    hits, _ = kv.get_computed_blocks(again)
    assert [b.block_hash for b in hits] == prompt_block_hashes(tokens, BS, salt)


@given(slack=st.sampled_from([0.0, 0.05, 0.3]), data=st.data())
@settings(max_examples=60, deadline=None)
def test_least_kv_picks_within_slack_of_the_least_used(slack, data):
    """A P/D decode engine: never one whose KV usage is more than `slack` above the least reported
    (0: exactly the least), whatever the router has in flight."""
    router = LeastKVRouter(slack)
    for _ in range(data.draw(st.integers(1, 30))):
        loads = {r: data.draw(reports) for r in data.draw(replica_sets)}
        choice = router.choose([], loads)
        least = min(x.kv_usage for x in loads.values())
        assert choice in loads and loads[choice].kv_usage <= least + slack
        router.on_routed(choice, [])
        if data.draw(st.booleans()):
            router.on_finished(choice)


def test_least_kv_spreads_a_burst_until_the_reports_catch_up():
    router = LeastKVRouter(kv_slack=0.05)
    loads = {"d0": ReplicaLoad(kv_usage=0.10), "d1": ReplicaLoad(kv_usage=0.12), "d2": ReplicaLoad(kv_usage=0.5)}
    picks = []
    for _ in range(6):  # the same reports for the whole burst: near-equal engines take turns
        picks.append(router.choose([], loads))
        router.on_routed(picks[-1], [])
    assert sorted(picks) == ["d0"] * 3 + ["d1"] * 3
    loads["d0"] = ReplicaLoad(num_running=3, kv_usage=0.3)  # d0's report shows its share
    assert router.choose([], loads) == "d1"
    router.forget("d1")
    del loads["d1"]  # died: never chosen again
    assert router.choose([], loads) == "d0"


def test_least_kv_slack_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="kv_slack"):
        LeastKVRouter(kv_slack=1.5)
