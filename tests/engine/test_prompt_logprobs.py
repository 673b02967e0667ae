"""Prompt logprobs on a tiny random Llama against transformers, through chunks, prefix-cache hits
and recompute preemption."""
from __future__ import annotations

import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.executor.model_runner import ModelRunner
from iterserve.model.loader import load_model_arch, load_weights
from iterserve.sampling_params import SamplingParams
from tests.model.test_llama import tiny_checkpoint

pytestmark = pytest.mark.slow  # transformers' model beside the engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    return str(path), tiny_checkpoint(path, "llama")


def tiny_engine(path: str, **kwargs) -> Engine:
    """No tokenizer in a random checkpoint: built from the arch and weights, prompts as token ids."""
    config = EngineConfig(dtype="float32", device="cpu", block_size=4, **kwargs)
    arch = load_model_arch(path)
    return Engine(config, ModelRunner(config, arch, load_weights(path, arch, torch.float32, torch.device("cpu"))))


def run(engine: Engine, prompts, params) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}
    while len(final) < len(ids):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


def reference(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    return lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


@pytest.mark.parametrize("chunk", [4096, 7])
def test_prompt_logprobs_match_transformers_through_chunks_and_the_prefix_cache(tiny, chunk):
    path, hf = tiny
    engine = tiny_engine(path, num_kv_blocks=64, max_num_batched_tokens=chunk, enable_prefix_caching=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (30, 9, 2)]
    run(engine, prompts[:1], SamplingParams(max_tokens=1))  # its blocks are now cached
    outs = run(engine, prompts, SamplingParams(max_tokens=2, prompt_logprobs=3, temperature=0))
    for prompt, out in zip(prompts, outs):
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        want = reference(hf, prompt)
        torch.testing.assert_close(torch.tensor([p.logprob for p in plp[1:]]), want, atol=1e-4, rtol=1e-4)
        assert all(len(p.top) == 3 and p.top[0][1] >= p.logprob - 1e-6 for p in plp[1:])
    plain = run(engine, prompts[:1], SamplingParams(max_tokens=1))[0]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_survive_recompute_preemption(tiny):
    path, hf = tiny
    # a pool too small for both: the later one is preempted and recomputed
    engine = tiny_engine(path, num_kv_blocks=12, enable_prefix_caching=False, preemption_mode="recompute")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (12,), generator=g).tolist() for _ in range(2)]
    outs = run(engine, prompts, SamplingParams(max_tokens=20, prompt_logprobs=0, ignore_eos=True))
    assert engine.stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        got = torch.tensor([p.logprob for p in out.prompt_logprobs[1:]])
        torch.testing.assert_close(got, reference(hf, prompt), atol=1e-4, rtol=1e-4)
