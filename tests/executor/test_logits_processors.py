"""Penalties, logit_bias and min_tokens: vLLM's formulas, per row, and free when nobody asks."""
from __future__ import annotations

import torch

from iterserve.executor.logits_processors import apply, make_adjust
from iterserve.executor.sampler import make_batch, sample
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest

V = 8
EOS = 7


def row(params: SamplingParams, prompt: list[int], output: list[int]) -> ScheduledRequest:
    tokens = prompt + output
    return ScheduledRequest("r", tokens[-1:], len(tokens) - 1, [0], True, params, len(output),
                            prompt_token_ids=prompt, output_token_ids=output + [99])  # 99: appended after the plan


def adjusted(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> torch.Tensor:
    adjust = make_adjust(reqs, {EOS}, V, logits.device)
    return logits.clone() if adjust is None else apply(logits.clone(), adjust)


def test_nobody_asks_nothing_is_built():
    assert make_adjust([row(SamplingParams(), [1, 2], [3])] * 3, {EOS}, V, torch.device("cpu")) is None


def test_vllm_semantics_row_by_row():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0, 3.0, 0.0, 4.0]] * 4)
    reqs = [
        row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[2]),
        row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[0], output=[3, 3, 4]),
        row(SamplingParams(logit_bias={5: -3.0, 6: 10.0}), prompt=[0], output=[]),
        row(SamplingParams(min_tokens=2, stop_token_ids=[4, 1000]), prompt=[0], output=[1]),
    ]
    out = adjusted(logits, reqs)
    base = logits[0]
    # repetition: prompt and output tokens; positive logits divided, negative multiplied
    assert out[0].tolist() == [1.0, -4.0, 0.5, *base[3:].tolist()]
    # frequency x count + presence once, output tokens only (the prompt's 0 untouched)
    assert out[1].tolist() == [2.0, -2.0, 1.0, 0.5 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 3.0, 0.0, 4.0]
    assert out[2].tolist() == [2.0, -2.0, 1.0, 0.5, -1.0, 0.0, 10.0, 4.0]
    # min_tokens: EOS and stop token ids banned (an id outside the vocabulary is skipped)
    assert out[3, EOS] == float("-inf") and out[3, 4] == float("-inf")
    assert torch.equal(out[3, :4], base[:4])


def test_min_tokens_reached_bans_nothing():
    assert make_adjust([row(SamplingParams(min_tokens=1), [0], [3])], {EOS}, V, torch.device("cpu")) is None


def test_greedy_follows_the_adjusted_logits_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    reqs = [row(SamplingParams(temperature=0.0, logit_bias={2: 10.0}, logprobs=1), [0], [])]
    batch = make_batch([r.sampling_params for r in reqs], [None], V, logits.device,
                       make_adjust(reqs, {EOS}, V, logits.device))
    tokens, lps = sample(logits, batch)
    assert tokens == [2]
    assert lps[0].top[0][0] == 1 and abs(lps[0].logprob - torch.log_softmax(logits, -1)[0, 2].item()) < 1e-6


def test_a_fixed_seed_draws_differently_under_a_penalty():
    torch.manual_seed(0)
    logits = torch.randn(1, V)
    top = int(logits.argmax())
    plain = SamplingParams(temperature=0.7, seed=11)
    penalised = SamplingParams(temperature=0.7, seed=11, presence_penalty=2.0, frequency_penalty=2.0)

    def draws(params, n=200):
        out = []
        for i in range(n):
            r = row(params, [0], [top] * 3)
            g = torch.Generator().manual_seed(1000 + i)
            b = make_batch([params], [g], V, logits.device, make_adjust([r], {EOS}, V, logits.device))
            out.append(sample(logits, b)[0][0])
        return out

    a, b = draws(plain), draws(penalised)
    assert a == draws(plain)  # reproducible
    assert b.count(top) < a.count(top)  # 3 x 2.0 frequency + 2.0 presence off the best token's logit
