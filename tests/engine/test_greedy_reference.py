"""Greedy tokens of iterserve equal transformers' own model on the same GGUF, however batched.

The check is vLLM's check_logprobs_close: tokens equal up to the first difference, and there
each side's token is in the other's top-5 (a float near-tie, not a bug)."""
from __future__ import annotations

import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.executor.model_runner import ModelRunner
from iterserve.model import cpu_paths
from iterserve.sampling_params import SamplingParams

PROMPT_LENS = [3, 7, 16, 33, 64, 100, 180, 300]
NEW_TOKENS = 32
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
        "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
        "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
        "direct the other way. Call me Ishmael. Some years ago, never mind how long precisely, having little or "
        "no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a "
        "little and see the watery part of the world. Happy families are all alike; every unhappy family is "
        "unhappy in its own way. It is a truth universally acknowledged, that a single man in possession of a "
        "good fortune, must be in want of a wife. In a hole in the ground there lived a creature. The sun shone, "
        "having no alternative, on the nothing new. ") * 3


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return [ids[7 * i: 7 * i + n] for i, n in enumerate(PROMPT_LENS)]


def teacher_forced_view(model, prompts):
    """transformers' view of a run: teacher-forced on our tokens, its greedy choice and top-5 at each
    step. Up to the first difference this *is* transformers' own greedy generation, and at that
    difference it is the token transformers would pick, so it is all check_logprobs_close needs
    (one forward per prompt instead of a 32-step generate)."""
    def view(ours):
        out = []
        with torch.inference_mode():
            for p, (tokens, _) in zip(prompts, ours):
                logits = model(torch.tensor([p + tokens[:-1]])).logits[0, len(p) - 1:].float()
                out.append((logits.argmax(-1).tolist(), [set(r.tolist()) for r in torch.topk(logits, 5).indices]))
        return out
    return view


@pytest.fixture(scope="module")
def reference(hf_reference_model, prompts):
    return teacher_forced_view(hf_reference_model, prompts)


@pytest.fixture(scope="module")
def reference_bf16(hf_reference_model, prompts):
    """transformers' model cast to bfloat16: the same dtype as the run it checks."""
    import copy
    return teacher_forced_view(copy.deepcopy(hf_reference_model).to(torch.bfloat16), prompts)


@pytest.fixture(scope="module")
def runner_fp32():
    return ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=256))


def generate(runner, prompts, one_at_a_time=False, num_tokens=NEW_TOKENS, groups=None, **config):
    """iterserve's greedy tokens and per-step top-5; also returns the engine for inspection.
    Prompts run all together, one at a time, or in the given groups (each group to completion)."""
    engine = Engine(EngineConfig(dtype="float32", **config), executor=runner)
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, logprobs=5)
    results: dict[str, tuple[list[int], list[set[int]]]] = {}
    if groups is None:
        groups = [[i] for i in range(len(prompts))] if one_at_a_time else [list(range(len(prompts)))]
    for group in groups:
        for i in group:
            engine.add_request(prompts[i], params, request_id=str(i))
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    results[o.request_id] = (o.token_ids, [{t for t, _ in lp.top} for lp in o.logprobs])
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    return [results[str(i)] for i in range(len(prompts))], engine


def close(a, b, n: int) -> bool:
    """vLLM's check_logprobs_close on (tokens, top-5 sets) pairs, over the first n tokens."""
    assert len(a[0]) >= n and len(b[0]) >= n
    (ta, top_a), (tb, top_b) = a, b
    for i in range(n):
        if ta[i] != tb[i]:
            return ta[i] in top_b[i] and tb[i] in top_a[i]
    return True


def diverged(a, b, n: int) -> bool:
    return a[0][:n] != b[0][:n]


def assert_close_all(ours, theirs, n=NEW_TOKENS, max_diverged=1):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert close(a, b, n), f"prompt {i} ({PROMPT_LENS[i]} tokens): {a[0][:n]} vs {b[0][:n]}"
    assert sum(diverged(a, b, n) for a, b in zip(ours, theirs)) <= max_diverged


@pytest.fixture(scope="module")
def single(runner_fp32, prompts):
    return generate(runner_fp32, prompts, one_at_a_time=True)[0]


@pytest.mark.slow
def test_one_at_a_time_matches_transformers(single, reference):
    assert_close_all(single, reference(single))


@pytest.mark.slow
def test_batched_matches(runner_fp32, prompts, single, reference):
    batched, _ = generate(runner_fp32, prompts)
    assert_close_all(batched, reference(batched))
    assert_close_all(batched, single)


@pytest.mark.slow
def test_chunked_prefill_matches(runner_fp32, prompts, single, reference):
    chunked, engine = generate(runner_fp32, prompts, max_num_batched_tokens=48)
    assert max(r.num_batched_tokens for r in engine.step_records) <= 48
    assert_close_all(chunked, reference(chunked))
    assert_close_all(chunked, single)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.slow
def test_preempted_matches(runner_fp32, prompts, single, reference, mode):
    preempted, engine = generate(runner_fp32, prompts, num_kv_blocks=22, preemption_mode=mode)
    assert engine.stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert_close_all(preempted, reference(preempted))
    assert_close_all(preempted, single)


@pytest.mark.slow
def test_prefix_cache_hits_give_the_same_tokens(runner_fp32, prompts, single):
    n = len(prompts)  # the second round runs after the first has freed (and cached) its blocks
    engine_outputs, engine = generate(runner_fp32, prompts + prompts, groups=[list(range(n)), list(range(n, 2 * n))])
    assert engine.scheduler.kv.num_prefix_hits > 0
    assert_close_all(engine_outputs[len(prompts):], single)


def argmax_misses(a, b) -> int:
    """Positions where a's greedy token differs from b's, over every prompt (both teacher-forced on
    the same tokens, so each position compares the same input)."""
    return sum(x != y for (ta, _), (tb, _) in zip(a, b) for x, y in zip(ta, tb))


@pytest.mark.parametrize("fused_ops", [True, False])
@pytest.mark.slow
def test_bfloat16_is_as_close_to_float32_as_transformers_bf16(prompts, reference_bf16, reference, fused_ops):
    """Logprob-close to transformers in bf16 and in float32 for 8 tokens, and over all 32 tokens about as
    far from float32 as transformers' own bf16 is (at most twice as many positions off): at each position, both teacher-forced on our
    tokens, how often the greedy token differs from float32's. (Whole prompts that part within 8
    tokens were counted before: a statistic of 8 coin flips, which any last-bit change moved.)"""
    if not fused_ops and not cpu_paths.current().bf16_arithmetic:
        pytest.skip("torch's own bf16 ops are checked where bf16 is native; emulated, they make the suite's "
                    "slowest test (the fused-op run still checks bf16 here)")
    runner = ModelRunner(EngineConfig(dtype="bfloat16", num_kv_blocks=128))
    runner.model.cpu_ops = runner.model.cpu_ops and fused_ops  # the C++ elementwise ops, and torch's
    ours, _ = generate(runner, prompts)
    theirs_bf16, theirs_fp32 = reference_bf16(ours), reference(ours)
    assert_close_all(ours, theirs_bf16, n=8, max_diverged=len(prompts))
    assert_close_all(ours, theirs_fp32, n=8, max_diverged=len(prompts))
    ours_off, theirs_off = argmax_misses(ours, theirs_fp32), argmax_misses(theirs_bf16, theirs_fp32)
    print(f"positions off float32's greedy token: ours {ours_off}, transformers' bf16 {theirs_off}")
    # Two bf16 models of equal precision land a few positions apart either way (4-7 against 5-6 where
    # the kernels' sums run in another order); a bf16 path that lost precision, e.g. rounding inside its
    # sums, is off at several times transformers' count.
    assert ours_off <= 2 * max(theirs_off, 2), \
        f"ours {ours_off} vs transformers' bf16 {theirs_off} of {NEW_TOKENS * len(prompts)}"
