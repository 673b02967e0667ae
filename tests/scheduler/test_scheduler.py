import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.sampling_params import SamplingParams
from tests.fake_executor import FakeExecutor
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
    assert engine.num_preemptions > 0
    assert all(done[r] == reference_output(p, 14) for r, p in prompts.items())
    assert engine.scheduler.kv.pool.num_free_blocks == 12


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
    assert engine.scheduler.kv.pool.num_free_blocks < 8
    out = engine.abort_request(rid)
    assert out.finished and out.finish_reason == "abort"
    assert engine.scheduler.kv.pool.num_free_blocks == 8 and not engine.has_unfinished()
