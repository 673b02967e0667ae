"""Speculative decoding through the scheduler, on a fake model that verifies drafts: the token budget
holds with drafts, outputs equal one-token decoding however drafts, chunks and preemptions fall, and
no block outlives its request."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.sampling_params import SamplingParams
from tests.loop_executor import LoopExecutor
from tests.kv.invariants import holders
from tests.scheduler.test_scheduler_properties import check_blocks, check_contexts


def spec_engine(executor: LoopExecutor, **config) -> Engine:
    config = {"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3, **config}
    return Engine(EngineConfig(**config), executor=executor)


def run_all(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    ids = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    done: dict[str, list[int]] = {}
    for _ in range(2000):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
        if not engine.has_unfinished():
            return {i: done[i] for i in ids}
    raise AssertionError("the engine stopped making progress")


def assert_no_leaks(engine: Engine) -> None:
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks, "all blocks are free at the end"
    assert not holders(kv) and not engine.states and not engine.scheduler.drafts


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.integers(0, 12),  # arrival step
                                   st.integers(1, 40),  # prompt length
                                   st.integers(1, 40),  # max_tokens
                                   st.booleans()),  # drafted (greedy) or not (asks for logprobs)
                         min_size=1, max_size=8),
       num_blocks=st.integers(6, 40),
       block_size=st.sampled_from([1, 2, 4, 16]),
       max_num_seqs=st.integers(1, 6),
       budget=st.integers(1, 48),
       k=st.integers(1, 6),
       lookup=st.sampled_from([(1, 1), (1, 3), (2, 4)]),
       preemption_mode=st.sampled_from(["recompute", "swap"]),
       caching=st.booleans())
def test_drafts_stay_in_the_budget_and_change_no_output(requests, num_blocks, block_size, max_num_seqs, budget,
                                                         k, lookup, preemption_mode, caching):
    executor = LoopExecutor(num_kv_blocks=num_blocks, block_size=block_size, max_model_len=120,
                            num_host_blocks=16 if preemption_mode == "swap" else 0)
    engine = spec_engine(executor, block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         num_speculative_tokens=k, prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1],
                         preemption_mode=preemption_mode, enable_prefix_caching=caching)
    max_len = engine.scheduler.max_model_len
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    expected, finished = {}, {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, plen, max_tokens, greedy_only) = pending.pop(0)
            prompt = [(i * 3 + j % 5) % executor.vocab_size for j in range(plen)]  # repeats: drafts from the start
            params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=None if greedy_only else 0)
            try:
                engine.add_request(prompt, params, request_id=f"r{i}")
            except ValueError:
                assert plen >= max_len
                continue
            expected[f"r{i}"] = executor.reference(prompt, min(max_tokens, max_len - plen))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.token_ids)
        if executor.plans:
            plan = executor.plans[-1]
            assert plan.num_batched_tokens <= budget
            for s in plan.scheduled:
                request = engine.scheduler.requests.get(s.request_id)
                assert s.num_draft_tokens <= k
                assert s.num_draft_tokens == 0 or (s.sample and s.sampling_params.logprobs is None)
                if request is not None and not request.finished:
                    assert request.num_output_tokens <= s.sampling_params.max_tokens
        check_blocks(engine)
        check_contexts(engine, executor)
        step += 1
        assert step < 3000, "the engine stopped making progress"
    assert finished == expected
    assert_no_leaks(engine)
    assert engine.stats.num_spec_accepted_tokens <= engine.stats.num_spec_draft_tokens


def test_drafts_are_accepted_and_counted():
    executor = LoopExecutor(num_kv_blocks=64, block_size=4)
    engine = spec_engine(executor)
    prompt = [3, 9, 4, 21, 3, 9, 4]
    got = run_all(engine, [prompt], [SamplingParams(max_tokens=60, temperature=0)])
    assert got["r0"] == executor.reference(prompt, 60)
    s = engine.stats
    assert s.num_spec_accepted_tokens > 0 and 0 < s.spec_acceptance_rate <= 1
    assert s.spec_mean_accepted_len == 1 + s.num_spec_accepted_tokens / s.num_spec_drafts
    steps = [p for p in executor.plans if p.scheduled]
    assert len(steps) < 60, "accepted drafts save steps"
    assert any(rec.decode_ids for rec in engine.step_records), "a drafted step is still a decode step"
    assert_no_leaks(engine)


def test_eos_and_max_tokens_inside_an_accepted_run_cut_exactly():
    plain = LoopExecutor(num_kv_blocks=64, block_size=4)
    prompt = [3, 9, 4, 21, 3, 9, 4]
    ref = plain.reference(prompt, 60)
    eos = ref[25]  # the first output token equal to this one ends the request
    cut = ref[:ref.index(eos) + 1]
    executor = LoopExecutor(num_kv_blocks=64, block_size=4, eos_token_ids=frozenset({eos}))
    engine = spec_engine(executor, num_speculative_tokens=8)
    got = run_all(engine, [prompt, prompt, prompt], [SamplingParams(max_tokens=60, temperature=0),
                                                     SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
                                                     SamplingParams(max_tokens=60, temperature=0, ignore_eos=True,
                                                                    stop_token_ids=[eos])])
    assert got["r0"] == cut
    assert got["r1"] == ref[:13]
    assert got["r2"] == cut
    assert engine.stats.num_spec_accepted_tokens > 0
    for plan in executor.plans:  # drafts never reach past max_tokens
        for s in plan.scheduled:
            if s.request_id == "r1":
                assert s.output_len + s.num_draft_tokens + 1 <= 13
    assert_no_leaks(engine)


def test_drafts_stop_at_the_context_length():
    executor = LoopExecutor(num_kv_blocks=64, block_size=4, max_model_len=40)
    engine = spec_engine(executor, num_speculative_tokens=8)
    prompt = [3, 9, 4, 21, 3, 9, 4]
    got = run_all(engine, [prompt], [SamplingParams(max_tokens=100, temperature=0)])
    assert got["r0"] == executor.reference(prompt, 40 - len(prompt))
    assert max(s.seq_len for p in executor.plans for s in p.scheduled) <= 39
    assert_no_leaks(engine)


def test_undrafted_requests_in_the_same_batch_decode_one_token_a_step():
    executor = LoopExecutor(num_kv_blocks=64, block_size=4)
    engine = spec_engine(executor)
    prompt = [3, 9, 4, 21, 3, 9, 4]
    kinds = [SamplingParams(max_tokens=30, temperature=0), SamplingParams(max_tokens=30, temperature=0, logprobs=1),
             SamplingParams(max_tokens=30, temperature=0, presence_penalty=0.5),
             SamplingParams(max_tokens=30, temperature=0, min_tokens=10)]
    got = run_all(engine, [prompt] * len(kinds), kinds)
    for rid in got:
        assert got[rid] == executor.reference(prompt, 30)
    drafted = {s.request_id for p in executor.plans for s in p.scheduled if s.num_draft_tokens}
    assert "r0" in drafted and not drafted & {"r1", "r2"}
    first_drafted = min(s.output_len for p in executor.plans for s in p.scheduled
                        if s.request_id == "r3" and s.num_draft_tokens)
    assert first_drafted >= 10, "min_tokens still banning stop tokens: no drafts"
    assert_no_leaks(engine)


def test_a_short_budget_cuts_drafts_first():
    executor = LoopExecutor(num_kv_blocks=64, block_size=4)
    engine = spec_engine(executor, num_speculative_tokens=6, max_num_batched_tokens=3, max_num_seqs=4)
    prompt = [3, 9, 4, 3, 9, 4]  # a prompt of 6 needs two steps of 3
    got = run_all(engine, [prompt, prompt], [SamplingParams(max_tokens=20, temperature=0)] * 2)
    assert got["r0"] == got["r1"] == executor.reference(prompt, 20)
    assert all(p.num_batched_tokens <= 3 for p in executor.plans)
    assert any(s.num_draft_tokens for p in executor.plans for s in p.scheduled)
    assert_no_leaks(engine)
