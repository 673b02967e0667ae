"""Prompt-lookup speculative decoding: the proposer, who is drafted, the flags, and greedy tokens with
speculation on equal to off on real models (a tiny random Llama and the default model)."""
from __future__ import annotations

import argparse

import pytest
import torch
from hypothesis import given, settings, strategies as st

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.engine.spec_decode import NgramProposer, draftable
from iterserve.entrypoints.args import add_engine_args, config_from_args
from iterserve.executor.model_runner import ModelRunner
from iterserve.executor.sampler import verify_random_drafts
from iterserve.model.loader import load_model_arch, load_weights
from iterserve.sampling_params import SamplingParams, StructuredOutputs
from tests.engine.test_greedy_reference import PROMPT_LENS, TEXT
from tests.kv.invariants import holders
from tests.model.test_cpu_linear import needs_int8
from tests.model.test_llama import tiny_checkpoint

SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


# ---- the proposer ------------------------------------------------------------------------------

def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if len(tokens) <= n:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


def test_proposer_takes_the_longest_ngram_and_its_latest_occurrence():
    p = NgramProposer(3, 1, 3)
    # "1 2 3" recurs at 0 and 5; the latest is at 5, followed by 8 9 1
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3, 8, 9, 1, 2, 3]) == [8, 9, 1]
    # only the 1-gram "3" recurs (followed by 7); the 2-gram "9 3" does not
    assert p.propose([3, 7, 1, 9, 3]) == [7, 1, 9]
    assert p.propose([1, 2, 3, 4]) == []
    assert p.propose([5, 5]) == [5]  # overlapping the suffix, as a repeating sequence does
    assert p.propose([1, 2, 1, 2, 1, 2], max_drafts=2) == [1, 2]
    assert p.propose([1, 2, 1, 2], max_drafts=0) == []
    assert NgramProposer(3, 2, 3).propose([4, 1, 9, 1]) == []  # a 1-gram is below prompt_lookup_min


def test_proposer_ignores_byte_matches_across_token_boundaries():
    # little-endian int32: 0x01000000 then 0 hold the bytes 01 00 00 00 at offset 3, which is token 1
    assert NgramProposer(2, 1, 1).propose([0x01000000, 0, 7, 1]) == []
    assert NgramProposer(2, 1, 1).propose([1, 9, 0x01000000, 0, 7, 1]) == [9, 0x01000000]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40), k=st.integers(1, 5),
       lo=st.integers(1, 3), span=st.integers(0, 2))
def test_proposer_matches_a_brute_force_search(tokens, k, lo, span):
    assert NgramProposer(k, lo, lo + span).propose(tokens) == brute_force(tokens, k, lo, lo + span)


def test_who_is_drafted():
    assert draftable(SamplingParams(temperature=0), 0)
    assert draftable(SamplingParams(temperature=0.7, top_p=0.9), 0)
    assert draftable(SamplingParams(temperature=0, seed=3), 0)  # greedy: the seed draws nothing
    for params in (SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0, logprobs=0),
                   SamplingParams(temperature=0, prompt_logprobs=0),
                   SamplingParams(temperature=0, presence_penalty=1),
                   SamplingParams(temperature=0, repetition_penalty=1.1),
                   SamplingParams(temperature=0, logit_bias={1: 2}),
                   SamplingParams(temperature=0, structured_outputs=StructuredOutputs(json_object=True))):
        assert not draftable(params, 5)
    assert not draftable(SamplingParams(temperature=0, min_tokens=3), 2)
    assert draftable(SamplingParams(temperature=0, min_tokens=3), 3)


def test_rejection_sampling_keeps_each_positions_distribution():
    """Emitted tokens (accepted drafts, then the model's own) are distributed as one-token sampling would
    draw them: the first as p_0; the second, given the first was draft 0, as p_1. One batch of many
    copies of the same request: the verifier draws for each independently."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4)
    probs = torch.softmax(logits / 0.8, -1)
    probs[probs < probs.topk(4, -1).values[:, -1:]] = 0
    probs /= probs.sum(-1, keepdim=True)
    drafts = [int(probs[0].argmax()), int(probs[1].argmin())]  # the second has p = 0: always rejected
    n, first, second = 20000, torch.zeros(6), torch.zeros(6)
    for a, token in verify_random_drafts(logits.repeat(n, 1), [params] * (3 * n), [drafts] * n):
        emitted = drafts[:a] + [token]
        first[emitted[0]] += 1
        if emitted[0] == drafts[0]:
            second[emitted[1]] += 1
    assert (first / n - probs[0]).abs().max() < 0.02
    assert (second / second.sum() - probs[1]).abs().max() < 0.025
    assert second[drafts[1]] == 0


# ---- flags ---------------------------------------------------------------------------------------

def test_config_is_validated():
    assert EngineConfig().speculative_config.speculative_method is None  # off by default
    assert EngineConfig(**SPEC).speculative_config.num_speculative_tokens == 4
    for bad in ({"speculative_method": "eagle"}, {"num_speculative_tokens": 0}, {"prompt_lookup_min": 0},
                {"prompt_lookup_min": 4, "prompt_lookup_max": 2}):
        with pytest.raises(ValueError):
            EngineConfig(**{**SPEC, **bad})


def test_flags_are_generated_and_bad_values_are_one_line(capsys):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-method", "ngram", "--num-speculative-tokens", "3",
                         "--prompt-lookup-max", "5", "--prompt-lookup-min", "2"])
    sc = config_from_args(args).speculative_config
    assert (sc.speculative_method, sc.num_speculative_tokens, sc.prompt_lookup_max, sc.prompt_lookup_min) == \
        ("ngram", 3, 5, 2)
    with pytest.raises(SystemExit):
        config_from_args(p.parse_args(["--prompt-lookup-min", "6", "--prompt-lookup-max", "3"]))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prompt_lookup_min 6" in err


def test_the_simulator_refuses_speculation():
    from iterserve.sim.cli import make_executor
    from iterserve.sim.hardware import get_hardware
    from iterserve.sim.model_spec import get_model_spec
    with pytest.raises(ValueError, match="speculative"):
        make_executor(EngineConfig(**SPEC), get_model_spec("llama-2-7b", None), get_hardware("a100-80gb", None))


# ---- a tiny random Llama -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory) -> ModelRunner:
    path = str(tmp_path_factory.mktemp("tiny-spec"))
    tiny_checkpoint(path, "llama")
    config = EngineConfig(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, num_threads=1)
    arch = load_model_arch(path)
    return ModelRunner(config, arch, load_weights(path, arch, torch.float32, torch.device("cpu")))


def run(runner, prompts, params, **config) -> tuple[list, Engine]:
    engine = Engine(EngineConfig(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, **config), runner)
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and not holders(kv), "a block outlived its request"
    return [final[i] for i in ids], engine


def tiny_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    phrase = torch.randint(0, 128, (12,), generator=g).tolist()
    return [phrase * 4, torch.randint(0, 128, (9,), generator=g).tolist(), phrase[:5] * 6 + [7]]


def test_tiny_model_greedy_tokens_equal_with_speculation(tiny_runner):
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want, _ = run(tiny_runner, tiny_prompts(), greedy)
    got, engine = run(tiny_runner, tiny_prompts(), greedy, **SPEC)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.stats.num_spec_accepted_tokens > 0, "no draft was accepted: the test would pass vacuously"


QUANTIZATIONS = [None, pytest.param("w8a8", marks=needs_int8)]


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.slow
def test_default_model_greedy_tokens_equal_with_speculation(default_model_path, tokenizer, quantization):
    """The shipped model in its default dtype (and w8a8, whose int8 activation codes turn on a last bit):
    one request past 512 positions (the decode kernel cuts its context into slices), one short, batched.
    A verify step's rows attend as one-token decode rows would, so the bits, and the tokens, are equal."""
    passage = "The committee met on Tuesday. It reviewed the budget, the hiring plan and the roadmap. " * 40
    prompts = [tokenizer.encode("Copy this text exactly: " + passage, add_special_tokens=False)[:560],
               tokenizer.encode("Once upon a time", add_special_tokens=False)]
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    config = dict(quantization=quantization, num_kv_blocks=256, block_size=4)  # as run() schedules them
    want, _ = run(ModelRunner(EngineConfig(**config)), prompts, greedy)
    got, engine = run(ModelRunner(EngineConfig(**config)), prompts, greedy, **SPEC)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.stats.num_spec_accepted_tokens > 0


def test_tiny_model_mixed_batch(tiny_runner):
    """Drafted and undrafted requests in one batch: each gets what it gets without speculation."""
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
    prompts = tiny_prompts() + [tiny_prompts()[0][:20]]
    want, _ = run(tiny_runner, prompts, params)
    got, engine = run(tiny_runner, prompts, params, **SPEC)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got[2].logprobs, want[2].logprobs):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert engine.stats.num_spec_accepted_tokens > 0


def test_tiny_model_random_sampling_with_drafts(tiny_runner):
    """Unseeded random requests are drafted and verified by rejection sampling: some drafts are
    accepted, some rejected, and every request still gets exactly max_tokens tokens."""
    greedy, _ = run(tiny_runner, tiny_prompts()[:1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    prompt = tiny_prompts()[0] + greedy[0].token_ids  # the model's own continuation: drafts it likes
    params = SamplingParams(max_tokens=12, temperature=0.5, top_k=5, ignore_eos=True)
    outs, engine = run(tiny_runner, [tiny_prompts()[0]] * 2 + [prompt] * 30, params, **SPEC)
    assert all(len(o.token_ids) == 12 for o in outs)
    s = engine.stats
    assert 0 < s.num_spec_accepted_tokens < s.num_spec_draft_tokens


def test_tiny_model_through_preemption(tiny_runner):
    """A pool too small for all: drafts, recompute preemption and resumption mix; tokens still equal."""
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = tiny_prompts() * 2
    want, _ = run(tiny_runner, prompts, greedy)
    engine = Engine(EngineConfig(dtype="float32", device="cpu", block_size=4, num_kv_blocks=40,
                                 preemption_mode="recompute", **SPEC), tiny_runner)
    got, _ = run_engine(engine, prompts, greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.stats.num_preemptions > 0 and engine.stats.num_spec_accepted_tokens > 0


def run_engine(engine: Engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    return [final[i] for i in ids], engine


# ---- the default model, on the engine's reference prompts ------------------------------------------

@pytest.fixture(scope="module")
def default_runner(default_model_path) -> ModelRunner:
    # one thread: the suite shares 2 cores with other work, and oversubscribed OpenMP threads spin
    return ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=256, num_threads=1))


@pytest.mark.slow
def test_reference_prompts_greedy_tokens_equal_with_speculation(default_runner, tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompts = [ids[7 * i: 7 * i + n] for i, n in enumerate(PROMPT_LENS)]
    copy = tokenizer.encode("Repeat this text exactly.\n\n" + TEXT[:400] + "\n\nRepeated:\n\n" + TEXT[:60],
                            add_special_tokens=False)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want, _ = run_engine(Engine(EngineConfig(dtype="float32", num_kv_blocks=256), default_runner),
                         prompts + [copy], greedy)
    got, engine = run_engine(Engine(EngineConfig(dtype="float32", num_kv_blocks=256, **SPEC), default_runner),
                             prompts + [copy], greedy)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.token_ids == b.token_ids, f"prompt {i}"
    assert engine.stats.num_spec_accepted_tokens > 0


def test_the_servers_diagnostics_replay_nothing_on_the_simulator_with_speculation(tiny_runner):
    from iterserve.server.dashboard import make_diagnostics
    from iterserve.sim.server_whatif import simulated_system, whatif_for
    engine = Engine(EngineConfig(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, **SPEC), tiny_runner)
    assert simulated_system(engine) is None
    assert make_diagnostics(engine, whatif_for=whatif_for).whatif is None
