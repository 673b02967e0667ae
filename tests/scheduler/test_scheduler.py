import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.request import RequestStatus
from iterserve.sampling_params import SamplingParams
from tests.fake_executor import FakeExecutor
from tests.kv.invariants import num_free_host_blocks, promisers
from tests.scheduler.test_scheduler_properties import reference_output


def run(engine: Engine) -> dict[str, list[int]]:
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    raise AssertionError("no progress")


def test_small_pool_preempts_and_outputs_are_unchanged():
    ex = FakeExecutor(num_kv_blocks=12, block_size=4)
    engine = Engine(EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16), executor=ex)
    prompts = {f"r{i}": [i + 1] * 10 for i in range(6)}
    for rid, p in prompts.items():
        engine.add_request(p, SamplingParams(max_tokens=14), request_id=rid)
    done = run(engine)
    assert engine.stats.num_preemptions > 0
    assert all(done[r] == reference_output(p, 14) for r, p in prompts.items())
    assert engine.scheduler.kv.num_free_blocks == 12


def test_long_prompt_is_chunked_under_the_token_budget():
    ex = FakeExecutor(num_kv_blocks=64)
    engine = Engine(EngineConfig(max_num_batched_tokens=8), executor=ex)
    engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=2))
    run(engine)
    chunks = [p.scheduled[0].num_new_tokens for p in ex.plans if p.scheduled]
    assert chunks[:4] == [8, 8, 8, 5] and not any(p.scheduled[0].sample for p in ex.plans[:3])


def test_decodes_go_first_and_new_prompts_fill_the_rest():
    ex = FakeExecutor(num_kv_blocks=64)
    engine = Engine(EngineConfig(max_num_batched_tokens=10), executor=ex)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=5), request_id="a")
    engine.step()
    engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=2), request_id="b")
    engine.step()
    plan = ex.plans[-1]
    assert [(s.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("b", 9)]


def test_static_mode_admits_nobody_mid_batch_and_pads_finished_rows():
    ex = FakeExecutor(num_kv_blocks=64)
    engine = Engine(EngineConfig(scheduling="static", max_num_seqs=2), executor=ex)
    engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="short")
    engine.add_request([3, 4], SamplingParams(max_tokens=6), request_id="long")
    engine.add_request([5, 6], SamplingParams(max_tokens=1), request_id="late")
    run(engine)
    ids_per_step = [[(s.request_id, s.is_padding) for s in p.scheduled] for p in ex.plans if p.scheduled]
    first_late = next(i for i, ids in enumerate(ids_per_step) if ("late", False) in ids)
    assert all(("long", False) not in ids for ids in ids_per_step[first_late:])
    assert any(("short", True) in ids for ids in ids_per_step), "the finished row keeps computing as padding"


def test_rejects_prompt_that_can_never_fit():
    engine = Engine(EngineConfig(block_size=4), executor=FakeExecutor(num_kv_blocks=4, block_size=4))
    with pytest.raises(ValueError, match="context holds at most 16"):
        engine.add_request(list(range(1, 17)), SamplingParams())
    assert not engine.has_unfinished()


def test_abort_frees_blocks():
    engine = Engine(EngineConfig(), executor=FakeExecutor(num_kv_blocks=8))
    rid = engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.scheduler.kv.num_free_blocks < 8
    [out] = engine.abort_request(rid)
    assert out.finished and out.finish_reason == "abort"
    assert engine.scheduler.kv.num_free_blocks == 8 and not engine.has_unfinished()


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption_resumes_without_recompute(mode):
    ex = FakeExecutor(num_kv_blocks=12, block_size=4, num_host_blocks=32, recompute_tokens_per_s=1.0)
    engine = Engine(EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, preemption_mode=mode),
                    executor=ex)
    prompts = {f"r{i}": [i + 1] * 10 for i in range(6)}
    for rid, p in prompts.items():
        engine.add_request(p, SamplingParams(max_tokens=14), request_id=rid)
    done = run(engine)
    assert any(p.swap_out for p in ex.plans) and any(p.swap_in for p in ex.plans)
    # a swapped request never recomputes a token: total computed == prompt + outputs - 1 per request
    computed = sum(s.num_new_tokens for p in ex.plans for s in p.scheduled)
    assert computed == sum(len(p) + 14 - 1 for p in prompts.values())
    assert all(done[r] == reference_output(p, 14) for r, p in prompts.items())
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == 12 and num_free_host_blocks(kv) == 32


def test_swap_falls_back_to_recompute_when_host_pool_is_full():
    ex = FakeExecutor(num_kv_blocks=12, block_size=4, num_host_blocks=1)
    engine = Engine(EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, preemption_mode="swap"),
                    executor=ex)
    for i in range(6):
        engine.add_request([i + 1] * 10, SamplingParams(max_tokens=14), request_id=f"r{i}")
    run(engine)
    assert engine.stats.num_preemptions > 0 and not any(p.swap_out for p in ex.plans)


def test_priority_preemption_serves_high_priority_first():
    ex = FakeExecutor(num_kv_blocks=64, block_size=4)
    engine = Engine(EngineConfig(block_size=4, max_num_seqs=2, scheduling_policy="priority",
                                 priority_preemption=True), executor=ex)
    for i in range(2):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=30), request_id=f"low{i}", priority=5)
    engine.step()
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=3), request_id="high", priority=0)
    engine.step()
    assert "high" in [s.request_id for s in ex.plans[-1].scheduled]
    assert ex.plans[-1].preempted_ids == ["low1"]
    run(engine)


def test_aging_lets_old_low_priority_requests_through():
    now = [0.0]
    ex = FakeExecutor(num_kv_blocks=64, block_size=4)
    engine = Engine(EngineConfig(block_size=4, max_num_seqs=1, scheduling_policy="priority", priority_aging_s=1.0),
                    executor=ex, clock=lambda: now[0])
    engine.add_request([1], SamplingParams(max_tokens=2), request_id="busy", priority=0)
    engine.add_request([1], SamplingParams(max_tokens=2), request_id="old-low", priority=3)
    engine.step()
    now[0] = 10.0  # old-low has waited 10 s: its priority is now 3 - 10 < 0
    engine.add_request([2], SamplingParams(max_tokens=2), request_id="new-high", priority=0)
    order = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
    assert order.index("old-low") < order.index("new-high")


def test_parallel_sampling_computes_the_prompt_once_through_the_prefix_cache():
    ex = FakeExecutor(num_kv_blocks=32, block_size=4)
    engine = Engine(EngineConfig(block_size=4, max_num_seqs=8), executor=ex)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + a partial one
    rid = engine.add_request(prompt, SamplingParams(max_tokens=5, n=3), request_id="p")
    engine.step()  # the first child computes the prompt; its siblings wait for that prefix
    assert [(s.request_id, s.num_new_tokens) for s in ex.plans[0].scheduled] == [("p#0", 10)]
    engine.step()  # the siblings find the 2 full blocks cached and compute their last 2 tokens
    assert sorted((s.request_id, s.num_new_tokens) for s in ex.plans[1].scheduled) == \
        [("p#0", 1), ("p#1", 2), ("p#2", 2)]
    tables = {r.request_id: engine.scheduler.kv.block_table(r.request_id) for r in engine.scheduler.running}
    assert tables["p#0"][:2] == tables["p#1"][:2] == tables["p#2"][:2]
    assert len({t[2] for t in tables.values()}) == 3, "each sequence writes its own partial block"
    assert engine.scheduler.kv.blocks_of("p#0")[0].ref_cnt == 3
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.finished]
    assert sorted(o.index for o in outputs) == [0, 1, 2] and {o.parent_id for o in outputs} == {rid}
    assert all(o.token_ids == reference_output(prompt, 5) for o in outputs)
    assert engine.scheduler.kv.num_free_blocks == 32 and not engine.parents and not engine.states


def test_abort_of_a_parallel_request_aborts_every_sequence():
    engine = Engine(EngineConfig(block_size=4), executor=FakeExecutor(num_kv_blocks=32, block_size=4))
    engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=50, n=4), request_id="p")
    engine.step()
    engine.step()
    outs = engine.abort_request("p")
    assert sorted(o.index for o in outs) == [0, 1, 2, 3] and all(o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished() and not engine.states and not engine.parents
    assert engine.scheduler.kv.num_free_blocks == 32


def test_abort_reaches_siblings_after_one_has_finished():
    engine = Engine(EngineConfig(block_size=4), executor=FakeExecutor(num_kv_blocks=32, block_size=4))
    engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=50, n=3), request_id="p")
    engine.step()
    engine.step()
    assert [o.request_id for o in engine.abort_request("p#1")] == ["p#1"]  # one sequence ends early
    assert sorted(o.request_id for o in engine.abort_request("p")) == ["p#0", "p#2"]
    assert not engine.has_unfinished() and not engine.states and not engine.parents
    assert engine.scheduler.kv.num_free_blocks == 32


def test_a_rejected_parallel_request_leaves_nothing_behind():
    engine = Engine(EngineConfig(block_size=4), executor=FakeExecutor(num_kv_blocks=32, block_size=4,
                                                                       max_model_len=16))
    with pytest.raises(ValueError, match="prompt has 20 tokens"):
        engine.add_request(list(range(1, 21)), SamplingParams(n=3), request_id="p")
    assert not engine.has_unfinished() and not engine.states and not engine.parents
    engine.add_request([1, 2], SamplingParams(n=2), request_id="p")  # the id is free again


def test_requests_sharing_an_uncached_prefix_compute_it_once():
    ex = FakeExecutor(num_kv_blocks=64, block_size=4)
    engine = Engine(EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=256), executor=ex)
    system = list(range(1, 41))  # 10 blocks, in nobody's cache yet
    prompts = {"a": system + [50, 51], "b": system + [60, 61], "other": [90, 91, 92, 93, 94]}
    for rid, p in prompts.items():
        engine.add_request(p, SamplingParams(max_tokens=3), request_id=rid)
    done = run(engine)
    first, second = ([(s.request_id, s.num_new_tokens) for s in plan.scheduled] for plan in ex.plans[:2])
    assert first == [("a", 42), ("other", 5)], "b waits for the prefix a is computing; other passes it"
    assert ("b", 2) in second, "b computes only its own suffix"
    assert all(done[r] == reference_output(p, 3) for r, p in prompts.items())
    assert not promisers(engine.scheduler.kv) and engine.scheduler.kv.num_free_blocks == 64


def test_an_aborted_prefix_owner_releases_its_waiters():
    ex = FakeExecutor(num_kv_blocks=64, block_size=4)
    engine = Engine(EngineConfig(block_size=4, max_num_batched_tokens=8), executor=ex)
    system = list(range(1, 41))
    engine.add_request(system + [50], SamplingParams(max_tokens=2), request_id="a")
    engine.add_request(system + [60], SamplingParams(max_tokens=2), request_id="b")
    engine.step()  # a computes its first chunk; b waits for a's prefix
    assert [r.request_id for r in engine.scheduler.running] == ["a"]
    engine.abort_request("a")
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["b"]
    assert promisers(engine.scheduler.kv) == {"b"}, "b now promises the prefix itself"
    run(engine)
    assert not promisers(engine.scheduler.kv)
