"""The simulator's P/D mode: x prefill + y decode real engines on one timeline, the KV transfer
priced from its bytes and the link bandwidth, and goodput per device against colocated replicas."""
from __future__ import annotations

import pytest

from iterserve.bench.metrics import Slo
from iterserve.bench.workload import LengthDist, make_trace, materialize_prompts
from iterserve.config import EngineConfig
from iterserve.sim.cli import main as simulate_main, make_engine
from iterserve.sim.disagg import compare, parse_pd, run_disagg
from iterserve.sim.hardware import get_hardware
from iterserve.sim.model_spec import get_model_spec

MODEL, HW = get_model_spec("llama-2-7b"), get_hardware("a100-80gb")


def trace_at(rate: float, n: int = 60):
    trace = make_trace(n, LengthDist("uniform", 300, 20, 600), LengthDist("fixed", 24), arrivals="poisson",
                       request_rate=rate, seed=2)
    materialize_prompts(trace, None)
    return trace


def factory(built: list):
    def make():
        engine = make_engine(EngineConfig(max_num_seqs=32), MODEL, HW)
        built.append(engine)
        return engine
    return make


def test_parse_pd():
    assert parse_pd("2P1D") == (2, 1) and parse_pd("1p3d") == (1, 3)
    for bad in ("0P1D", "1P", "PD", "2x1"):
        with pytest.raises(ValueError, match="xPyD"):
            parse_pd(bad)


@pytest.mark.parametrize("split", [(1, 1), (2, 1), (1, 2)])
def test_every_request_finishes_and_each_side_keeps_to_its_role(split):
    built: list = []
    trace = trace_at(20)
    result = run_disagg(factory(built), *split, trace, HW.interconnect_bandwidth)
    assert sorted(m.request_id for m in result.requests) == sorted(r.request_id for r in trace.requests)
    assert all(m.output_len == 24 and m.ttft is not None and m.tpot is not None for m in result.requests)
    prefill, decode = built[:split[0]], built[split[0]:]
    assert all(s.num_prefill_tokens == 0 for e in decode for s in e.step_records), "a decode engine prefilled"
    assert all(not s.decode_ids for e in prefill for s in e.step_records), "a prefill engine decoded"
    for e in built:
        assert e.stats.num_free_kv_blocks == e.stats.num_kv_blocks
    assert all(e.step_records for e in built), "the routers left an engine idle (prefix affinity, least KV usage)"


def test_transfer_time_is_bytes_over_bandwidth():
    trace = trace_at(5, n=20)
    bpb = make_engine(EngineConfig(), MODEL, HW).executor.kv_cache_spec.bytes_per_block
    expected = sum(-(-r.prompt_len // 16) * bpb for r in trace.requests) / 1e9 / len(trace.requests)
    slow = run_disagg(factory([]), 1, 1, trace, link_bandwidth=1e9)
    assert slow.extra["mean_transfer_s"] == pytest.approx(expected)
    fast = run_disagg(factory([]), 1, 1, trace, link_bandwidth=1e12)
    # the first token comes from the prefill side either way; the second waits for the transfer
    ttft = lambda r: sorted(m.ttft for m in r.requests)  # noqa: E731
    assert ttft(slow) == pytest.approx(ttft(fast))
    assert sum(m.e2e for m in slow.requests) > sum(m.e2e for m in fast.requests) + 0.5 * expected * len(trace.requests)


def test_each_engine_waits_for_its_own_hand_off_copies():
    """The prefill side's copy out and the decode side's copy in move their engines' clocks: a lone
    request's second token comes that much later, its first token no later."""
    from dataclasses import replace
    trace = trace_at(1, n=1)
    bytes_per_block = make_engine(EngineConfig(), MODEL, HW).executor.kv_cache_spec.bytes_per_block
    nbytes = -(-trace.requests[0].prompt_len // 16) * bytes_per_block

    def run(send, receive):
        hw = replace(HW, kv_send_bandwidth=send, kv_receive_bandwidth=receive)
        engines = lambda: make_engine(EngineConfig(max_num_seqs=32), MODEL, hw)  # noqa: E731
        return run_disagg(engines, 1, 1, trace, 1e15).requests[0]
    fast, slow = run(None, None), run(1e9, 2e9)
    assert slow.ttft == pytest.approx(fast.ttft)
    assert slow.e2e - fast.e2e == pytest.approx(nbytes / 1e9 + nbytes / 2e9, rel=1e-3)
    assert HW.kv_send_bandwidth is None and HW.kv_receive_bandwidth is None  # the GPU presets: free


@pytest.mark.slow
def test_compare_reports_goodput_per_device_for_colocated_and_each_split():
    slo = Slo(ttft=0.5, tpot=0.05)
    rows = compare(factory([]), trace_at, [(1, 1)], HW.interconnect_bandwidth, slo)
    assert [r["name"] for r in rows] == ["colocated x2", "1P1D"]
    for r in rows:
        assert r["goodput_per_device"] > 0 and r["slo_attainment"] >= 0.9


@pytest.mark.slow
def test_cli(capsys):
    assert simulate_main(["--pd", "1P1D", "--num-requests", "30", "--prompt-len", "200", "--output-mean", "16",
                          "--slo-ttft", "0.5", "--slo-tpot", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "colocated x2" in out and "1P1D" in out and "goodput" in out
    with pytest.raises(SystemExit):
        simulate_main(["--pd", "3X", "--slo-ttft", "0.5", "--slo-tpot", "0.05"])
    with pytest.raises(SystemExit):
        simulate_main(["--pd", "1P1D"])  # no SLO: goodput is undefined


def test_decode_engines_can_be_priced_by_their_own_profile():
    """make_decode_engine builds the decode side only: a profile twice as slow per step there leaves the
    prefill engines' steps (and the first tokens) as they were and lengthens every TPOT."""
    from dataclasses import replace
    slow = replace(HW, step_overhead_s=HW.step_overhead_s + 0.02)
    built: list = []
    base = run_disagg(factory(built), 1, 1, trace_at(20), HW.interconnect_bandwidth)
    decoders: list = []

    def make_slow():
        engine = make_engine(EngineConfig(max_num_seqs=32), MODEL, slow)
        decoders.append(engine)
        return engine
    split = run_disagg(factory([]), 1, 1, trace_at(20), HW.interconnect_bandwidth, make_decode_engine=make_slow)
    assert len(decoders) == 1
    by_id = {m.request_id: m for m in base.requests}
    for m in split.requests:
        assert m.ttft == pytest.approx(by_id[m.request_id].ttft)
        assert m.tpot > by_id[m.request_id].tpot + 0.015
