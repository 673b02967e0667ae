from __future__ import annotations

import math

import torch

from iterserve.executor.sampler import make_batch, sample
from iterserve.sampling_params import SamplingParams

V = 50


def run(logits, params, gens=None):
    gens = gens or [None] * len(params)
    return sample(logits, make_batch(params, gens, logits.shape[-1], logits.device))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = torch.randn(4, V)
    tokens, lps = run(logits, [SamplingParams(temperature=0.0)] * 4)
    assert tokens == logits.argmax(-1).tolist() and lps is None


def test_greedy_on_bf16_logits_takes_the_first_maximum_like_float32_argmax():
    logits = torch.randint(-2, 3, (16, 4096)).to(torch.bfloat16)  # many ties in every row
    for logprobs in (None, 2):  # the copy-free path, and the float32 one logprobs take
        tokens, _ = run(logits, [SamplingParams(temperature=0.0, logprobs=logprobs)] * 16)
        assert tokens == logits.float().argmax(-1).tolist()


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = torch.randn(3, V)
    tokens, _ = run(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                             SamplingParams(temperature=0.0)])
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def draws(logits_row, params, n=300):
    logits = logits_row.expand(n, -1).contiguous()
    return set(run(logits, [params] * n)[0])


def test_top_k_keeps_only_the_k_best():
    row = torch.randn(V)
    assert draws(row, SamplingParams(top_k=3)) <= set(row.topk(3).indices.tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    got = draws(row, SamplingParams(top_p=0.7))
    assert got == {0, 1}  # 0.5 < 0.7, so token 1 is needed; 0.8 >= 0.7, so token 2 is not


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert draws(row, SamplingParams(min_p=0.4)) == {0, 1}  # 0.15 < 0.4 * 0.5


def test_per_row_params_are_independent():
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    logits = row.expand(200, -1).contiguous()
    params = [SamplingParams(top_k=1), SamplingParams(top_k=0)] * 100
    tokens = run(logits, params)[0]
    assert set(tokens[0::2]) == {0} and len(set(tokens[1::2])) > 1


def test_temperature_sharpens():
    row = torch.log(torch.tensor([0.6, 0.4]))
    cold = run(row.expand(400, -1).contiguous(), [SamplingParams(temperature=0.05)] * 400)[0]
    assert sum(cold) < 5  # (0.4/0.6)^20 ~ 3e-4


def test_seed_reproducible_regardless_of_batch():
    logits = torch.randn(5, V)
    p = SamplingParams(temperature=1.0, seed=7, top_p=0.95)
    alone = run(logits[2:3], [p], [seeded(7)])[0][0]
    others = [SamplingParams(temperature=0.9)] * 2 + [p] + [SamplingParams(temperature=0.0), SamplingParams(top_k=5)]
    batched = run(logits, others, [None, None, seeded(7), None, None])[0][2]
    assert alone == batched
    assert len({run(logits[2:3], [p], [seeded(s)])[0][0] for s in range(30)}) > 1  # the seed matters


def test_logprobs_raw_and_top_n():
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=2.0, logprobs=0)]
    tokens, lps = run(logits, params)
    ref = torch.log_softmax(logits, -1)
    assert lps[1] is None and lps[2].top == []
    assert math.isclose(lps[0].logprob, ref[0, tokens[0]].item(), rel_tol=1e-5)
    assert math.isclose(lps[2].logprob, ref[2, tokens[2]].item(), rel_tol=1e-5)  # untempered
    assert [t for t, _ in lps[0].top] == ref[0].topk(3).indices.tolist()
    assert all(math.isclose(v, ref[0, t].item(), rel_tol=1e-5) for t, v in lps[0].top)
