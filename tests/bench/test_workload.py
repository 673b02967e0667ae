import math
import random
import statistics

import pytest

from iterserve.bench.workload import LengthDist, Trace, arrival_times, make_trace, materialize_prompts

N = 20_000


def _samples(dist: LengthDist, seed: int = 0, n: int = N) -> list[int]:
    rng = random.Random(seed)
    return [dist.sample(rng) for _ in range(n)]


@pytest.mark.parametrize("dist", [
    LengthDist("fixed", 128),
    LengthDist("uniform", low=16, high=64),
    LengthDist("exponential", 128, high=512),
    LengthDist("exponential", 128, high=100),  # a cap that bites hard
    LengthDist("lognormal", 270, high=4096),
    LengthDist("lognormal", 200),
    LengthDist("mix", 270, high=1024, mix=0.3),
])
def test_length_moments(dist):
    xs = _samples(dist)
    assert min(xs) >= max(1, dist.low)
    if dist.high:
        assert max(xs) <= dist.high
    # rounding to integers and clamping at 1 move the mean by well under a token
    assert statistics.fmean(xs) == pytest.approx(dist.expected_mean(), rel=0.03, abs=0.6)


def test_fixed_is_exact_and_exponential_spreads():
    assert set(_samples(LengthDist("fixed", 32), n=100)) == {32}
    xs = _samples(LengthDist("exponential", 128, high=10_000))
    assert statistics.pstdev(xs) == pytest.approx(128, rel=0.05)  # exponential: std == mean


def test_lognormal_heavy_tail():
    xs = _samples(LengthDist("lognormal", 270, sigma=0.9))
    assert statistics.median(xs) < statistics.fmean(xs)  # median exp(mu) = mean * exp(-s^2/2)
    assert statistics.median(xs) == pytest.approx(270 * math.exp(-0.9**2 / 2), rel=0.05)


def test_mix_has_short_classification_outputs():
    xs = _samples(LengthDist("mix", 270, high=2048, mix=0.4))
    short = sum(x <= 8 for x in xs) / len(xs)
    assert 0.4 <= short <= 0.45  # 40% classification plus the few chat outputs that are that short


def test_poisson_rate_and_gamma_burstiness():
    rng = random.Random(3)
    t = arrival_times(N, "poisson", 5.0, 1.0, rng)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    g = arrival_times(N, "gamma", 5.0, 0.25, random.Random(3))
    ggaps = [b - a for a, b in zip(g, g[1:])]
    assert statistics.fmean(ggaps) == pytest.approx(0.2, rel=0.05)
    cv2 = statistics.pvariance(ggaps) / statistics.fmean(ggaps) ** 2
    assert cv2 == pytest.approx(1 / 0.25, rel=0.15)  # gamma shape k: CV^2 = 1/k (Poisson: 1)


def test_offline_and_closed_loop():
    t = make_trace(10, LengthDist("fixed", 8), LengthDist("fixed", 4))
    assert all(r.arrival_time == 0 for r in t.requests) and t.concurrency is None
    c = make_trace(10, LengthDist("fixed", 8), LengthDist("fixed", 4), arrivals="closed", concurrency=3)
    assert c.concurrency == 3
    with pytest.raises(ValueError):
        make_trace(10, LengthDist("fixed", 8), LengthDist("fixed", 4), arrivals="poisson")


def test_seeds():
    kw = dict(arrivals="poisson", request_rate=4.0)
    a = make_trace(50, LengthDist("uniform", low=4, high=200), LengthDist("exponential", 64, high=256), seed=7, **kw)
    b = make_trace(50, LengthDist("uniform", low=4, high=200), LengthDist("exponential", 64, high=256), seed=7, **kw)
    c = make_trace(50, LengthDist("uniform", low=4, high=200), LengthDist("exponential", 64, high=256), seed=8, **kw)
    assert a.requests == b.requests
    assert [r.output_len for r in a.requests] != [r.output_len for r in c.requests]


def test_jsonl_roundtrip_with_prompts(tmp_path):
    t = make_trace(20, LengthDist("uniform", low=4, high=300), LengthDist("fixed", 4), arrivals="gamma",
                   request_rate=2.0, burstiness=0.5, seed=1)
    materialize_prompts(t, None)
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in t.requests)
    t.save(tmp_path / "t.jsonl")
    u = Trace.load(tmp_path / "t.jsonl")
    assert u.requests == t.requests and u.meta == t.meta and u.concurrency == t.concurrency
    assert materialize_prompts(u, None).requests == t.requests  # ids already there: untouched


def test_prompts_are_real_text_cut_to_length(tokenizer):
    t = make_trace(8, LengthDist("uniform", low=1, high=9000), LengthDist("fixed", 1), seed=2)
    materialize_prompts(t, tokenizer)
    for r in t.requests:
        assert len(r.prompt_token_ids) == r.prompt_len
    text = tokenizer.decode(t.requests[0].prompt_token_ids)
    assert sum(c.isalpha() for c in text) > 0.5 * len(text)


def test_multi_tenant_trace_gives_each_tenant_its_own_system_prompt():
    from iterserve.bench.workload import multi_tenant_trace
    trace = multi_tenant_trace(8, 100, 64, user_len=20, output_len=5, request_rate=10, seed=1)
    tenants: dict[str, list[int]] = {}
    for r in trace.requests:
        tenant = r.request_id.split("-")[0]
        assert r.prompt_len == len(r.prompt_token_ids) == 120 and r.output_len == 5
        assert tenants.setdefault(tenant, r.prompt_token_ids[:100]) == r.prompt_token_ids[:100]
    assert len(tenants) == 8 and len({tuple(p) for p in tenants.values()}) == 8
    order = [r.request_id.split("-")[0] for r in trace.requests]
    assert sum(a != b for a, b in zip(order, order[1:])) > 32  # interleaved, not tenant after tenant
    assert [r.arrival_time for r in trace.requests] == sorted(r.arrival_time for r in trace.requests)
    again = multi_tenant_trace(8, 100, 64, user_len=20, output_len=5, request_rate=10, seed=1)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in trace.requests]
