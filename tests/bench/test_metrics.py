import pytest

from iterserve.bench.metrics import Slo, TargetResult, request_metrics, stats, summarize
from iterserve.outputs import StepRecord
from iterserve.request import RequestTimes


def _times(arrival, scheduled, tokens, finished=None):
    return RequestTimes(arrival, scheduled, tokens[0], list(tokens), [], tokens[-1] if finished is None else finished)


def test_request_latencies_by_hand():
    # arrives at 10.0, scheduled 10.5, tokens at 11, 11.2, 11.6, 12.0
    m = request_metrics("a", 5, 4, _times(10.0, 10.5, [11.0, 11.2, 11.6, 12.0]), t0=10.0)
    assert m.arrival == 0.0 and m.finished == pytest.approx(2.0)
    assert m.ttft == pytest.approx(1.0)
    assert m.queue == pytest.approx(0.5)
    assert m.e2e == pytest.approx(2.0)
    assert m.tpot == pytest.approx((2.0 - 1.0) / 3)
    assert m.itl == pytest.approx([0.2, 0.4, 0.4])


def test_single_token_has_no_tpot():
    m = request_metrics("a", 5, 1, _times(0.0, 0.0, [0.3]))
    assert m.tpot is None and m.itl == [] and m.ttft == pytest.approx(0.3)


def test_percentiles():
    s = stats([float(x) for x in range(1, 101)])
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert stats([])["mean"] is None


def _result():
    reqs = [request_metrics("a", 10, 3, _times(0.0, 0.0, [0.5, 0.6, 0.7])),   # ttft .5, tpot .1, e2e .7
            request_metrics("b", 20, 2, _times(0.0, 0.5, [1.5, 2.5])),        # ttft 1.5, tpot 1.0, e2e 2.5
            request_metrics("c", 30, 1, _times(1.0, 1.0, [1.2]))]             # ttft .2, no tpot, e2e .2
    steps = [StepRecord(0.0, 0.5, 1, 1, 10, 0.1, ["a"], [], []),
             StepRecord(0.5, 1.5, 2, 0, 21, 0.3, ["b"], ["a"], []),
             StepRecord(1.5, 2.5, 2, 0, 32, 0.4, ["c"], ["b"], [])]
    return TargetResult("x", reqs, 2.5, steps, preemptions=2)


def test_aggregate_figures():
    s = summarize(_result())
    assert s["completed"] == 3
    assert s["requests_per_s"] == pytest.approx(3 / 2.5)
    assert s["output_tokens_per_s"] == pytest.approx(6 / 2.5)
    assert s["total_tokens_per_s"] == pytest.approx(66 / 2.5)
    assert s["ttft_s"]["mean"] == pytest.approx((0.5 + 1.5 + 0.2) / 3)
    assert s["tpot_s"]["mean"] == pytest.approx((0.1 + 1.0) / 2)
    assert s["itl_s"]["mean"] == pytest.approx((0.1 + 0.1 + 1.0) / 3)
    assert s["e2e_s"]["p50"] == pytest.approx(0.7)
    assert s["queue_s"]["mean"] == pytest.approx(0.5 / 3)
    assert s["mean_batch_size"] == pytest.approx((1 + 2 + 2) / 3)
    assert s["mean_batch_size_time_weighted"] == pytest.approx((1 * 0.5 + 2 * 1 + 2 * 1) / 2.5)
    assert s["max_kv_usage"] == pytest.approx(0.4)
    assert s["preemptions"] == 2
    assert s["goodput_rps"] == pytest.approx(3 / 2.5)  # no SLO: every finished request counts
    assert [r["id"] for r in s["requests"]] == ["a", "b", "c"]


def test_goodput_needs_every_slo():
    r = _result()
    assert summarize(r, Slo(ttft=1.0))["goodput_rps"] == pytest.approx(2 / 2.5)          # b misses
    assert summarize(r, Slo(tpot=0.5))["goodput_rps"] == pytest.approx(2 / 2.5)          # b misses; c has no TPOT
    assert summarize(r, Slo(e2e=0.5))["goodput_rps"] == pytest.approx(1 / 2.5)           # only c
    assert summarize(r, Slo(ttft=0.4, e2e=1.0))["goodput_rps"] == pytest.approx(1 / 2.5)  # a misses TTFT
    r.requests[2].e2e = None  # failed requests never count
    assert summarize(r, Slo())["goodput_rps"] == pytest.approx(2 / 2.5)
