"""Plans carry a request's full data the first time it is scheduled and after a preemption, then only
what was added since; an executor's own state built from them is the scheduler's, step after step."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.sampling_params import SamplingParams
from tests.fake_executor import FakeExecutor


class Checking(FakeExecutor):
    """Records each plan as sent, and checks every row resolved against its state is the request's own
    data at the time of the plan, in lists of its own."""

    engine: Engine

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sent = []

    def execute(self, plan):
        self.sent.append(plan)
        scheduler = self.engine.scheduler
        for row in plan.scheduled:
            if row.is_padding:
                continue
            request = scheduler.requests[row.request_id]
            for ours in (row.block_table, row.prompt_token_ids, row.output_token_ids):
                assert ours is not request.output_token_ids and ours is not request.prompt_token_ids
                assert ours is not scheduler.kv.block_table(row.request_id)  # the manager's own list
        result = super().execute(plan)
        for row in self.plans[-1].scheduled:
            if not row.is_padding:
                request = scheduler.requests[row.request_id]
                assert row.block_table == scheduler.kv.block_table(row.request_id)
                assert row.prompt_token_ids == request.prompt_token_ids
                assert row.output_token_ids == request.output_token_ids == request.output_token_ids[:row.output_len]
        return result


def engine_with(executor: Checking, **config) -> Engine:
    executor.engine = Engine(EngineConfig(block_size=4, **config), executor=executor)
    return executor.engine


def test_full_data_once_then_deltas():
    executor = Checking(num_kv_blocks=32, block_size=4)
    engine = engine_with(executor)
    engine.add_request(list(range(10, 16)), SamplingParams(max_tokens=8, temperature=0), request_id="a")
    while engine.has_unfinished():
        engine.step()
    first, *later = [p.scheduled[0] for p in executor.sent]
    assert not first.cached and first.prompt_token_ids == list(range(10, 16)) and len(first.block_table) == 2
    assert all(r.cached and not r.block_table and not r.prompt_token_ids and not r.output_token_ids for r in later)
    assert [len(r.new_token_ids) for r in later] == [1] * len(later)  # the token sampled by the step before
    assert sum(len(r.new_block_ids) for r in later) == 2  # positions 8 and 12 open a block each


def test_a_preempted_request_is_sent_whole_again():
    executor = Checking(num_kv_blocks=6, block_size=4)
    engine = engine_with(executor, preemption_mode="recompute")
    for rid in "ab":
        engine.add_request(list(range(10, 18)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                           request_id=rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_preemptions > 0
    resumed = [(i, p) for i, p in enumerate(executor.sent) if p.preempted_ids]
    victim = resumed[0][1].preempted_ids[0]
    again = next(r for p in executor.sent[resumed[0][0] + 1:] for r in p.scheduled if r.request_id == victim)
    assert not again.cached and again.output_token_ids and again.prompt_token_ids == list(range(10, 18))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=8),
       num_blocks=st.integers(12, 40), budget=st.integers(4, 64), caching=st.booleans(),
       preemption_mode=st.sampled_from(["recompute", "swap"]), scheduling=st.sampled_from(["continuous", "static"]))
def test_executor_state_follows_the_scheduler(lengths, num_blocks, budget, caching, preemption_mode, scheduling):
    executor = Checking(num_kv_blocks=num_blocks, block_size=4, num_host_blocks=16, max_model_len=80)
    engine = engine_with(executor, max_num_batched_tokens=budget, enable_prefix_caching=caching,
                         preemption_mode=preemption_mode, scheduling=scheduling, max_num_seqs=4)
    for i, (plen, max_tokens) in enumerate(lengths):
        engine.add_request([(7 * i + j) % 50 + 1 for j in range(plen)],
                           SamplingParams(max_tokens=max_tokens, temperature=0), request_id=str(i))
    while engine.has_unfinished():
        engine.step()
    engine.step()  # tells the executor who finished in the last step
    assert not executor.states.by_id, "every finished request's state was dropped"
