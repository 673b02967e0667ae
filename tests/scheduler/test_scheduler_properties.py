"""Property tests of scheduler + KV cache over random arrivals, lengths, pool sizes and modes."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.sampling_params import SamplingParams
from tests.fake_executor import FakeExecutor
from tests.kv.invariants import check_kv, check_kv_drained

VOCAB = 1000


def reference_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append((tokens[-1] * 31 + len(tokens)) % VOCAB)
    return tokens[len(prompt):]


def check_blocks(engine: Engine) -> None:
    check_kv(engine.scheduler.kv, {r.request_id for r in engine.scheduler.running})
    waiting = engine.scheduler.waiting
    assert engine.scheduler.num_waiting_tokens == sum(r.num_tokens for r in waiting), "admission's token count drifted"


def check_contexts(engine: Engine, executor: FakeExecutor) -> None:
    """Each running request reads back exactly its own tokens through its block table."""
    for request in engine.scheduler.running:
        n = request.num_computed_tokens
        table = engine.scheduler.kv.block_table(request.request_id)
        assert executor.read_context(table, n) == request.token_ids[:n]


requests_st = st.lists(
    st.tuples(st.integers(0, 30),  # arrival step
              st.integers(1, 70),  # prompt length
              st.integers(1, 24),  # max_tokens
              st.sampled_from(["shared", "own"]),  # prompt starts with a shared prefix or not
              st.sampled_from([1, 1, 1, 2, 3])),  # n parallel sequences
    min_size=1, max_size=14)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_st,
       num_blocks=st.integers(4, 48),
       block_size=st.sampled_from([1, 2, 4, 16]),
       max_num_seqs=st.integers(1, 8),
       budget=st.integers(1, 96),
       watermark=st.sampled_from([0.0, 0.05]),
       caching=st.booleans(),
       scheduling=st.sampled_from(["continuous", "static"]),
       static_padding=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]),
       priority_preemption=st.booleans(),
       preemption_mode=st.sampled_from(["recompute", "swap", "auto"]),
       num_host_blocks=st.integers(0, 40))
def test_scheduler_invariants(requests, num_blocks, block_size, max_num_seqs, budget, watermark,
                              caching, scheduling, static_padding, policy, priority_preemption,
                              preemption_mode, num_host_blocks):
    config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          watermark=watermark, enable_prefix_caching=caching, scheduling=scheduling,
                          static_padding=static_padding, scheduling_policy=policy,
                          priority_preemption=priority_preemption, preemption_mode=preemption_mode)
    executor = FakeExecutor(num_kv_blocks=num_blocks, vocab_size=VOCAB, block_size=block_size, max_model_len=200,
                            num_host_blocks=num_host_blocks, recompute_tokens_per_s=1.0)
    engine = Engine(config, executor=executor)
    max_len = engine.scheduler.max_model_len
    shared = [7 + i for i in range(40)]
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    expected: dict[str, list[int]] = {}
    finished: dict[str, list[int]] = {}
    step = 0
    batch: set[str] = set()
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, plen, max_tokens, kind, n) = pending.pop(0)
            prompt = (shared + [500 + i] * plen)[:plen] if kind == "shared" else [(i * 97 + j) % VOCAB for j in range(plen)]
            rid = f"r{i}"
            try:
                engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, n=n),
                                   request_id=rid, priority=i % 3)
            except ValueError:
                assert plen >= max_len, "only a request that can never fit is rejected"
                continue
            for k in range(n):  # n > 1: n independent child requests "r3#0", "r3#1", ...
                expected[rid if n == 1 else f"{rid}#{k}"] = reference_output(prompt, min(max_tokens, max_len - plen))
        running_before = {r.request_id for r in engine.scheduler.running}
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        plan = executor.plans[-1] if executor.plans else None
        if plan is not None and plan is not getattr(engine, "_last_plan", None):
            engine._last_plan = plan
            assert plan.num_batched_tokens <= budget
            assert len(plan.scheduled) <= max_num_seqs
            assert len({s.request_id for s in plan.scheduled}) == len(plan.scheduled)
        assert len(engine.scheduler.running) + len(engine.scheduler.padding) <= max_num_seqs
        if scheduling == "static":
            running_now = {r.request_id for r in engine.scheduler.running}
            joined = running_now - running_before
            if joined:  # a new batch may start only when the previous one has wholly finished
                assert not running_before and not (batch & running_now)
                batch = set(running_now)
        check_blocks(engine)
        check_contexts(engine, executor)
        step += 1
        assert step < 5000, "the engine stopped making progress"
    assert finished.keys() == expected.keys(), "every admitted request finishes"
    for rid, tokens in finished.items():
        assert tokens == expected[rid], f"{rid}: output depends on batching/chunking/preemption"
    assert engine.scheduler.kv.num_blocks == num_blocks
    check_kv_drained(engine.scheduler.kv)
    assert not engine.states and not engine.parents
