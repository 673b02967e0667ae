"""Capacity diagnostics: drive the real engine (simulated executor, virtual clock) into each condition,
check the diagnostic fires with numbers, then re-run with the recommended settings and check it clears."""
from __future__ import annotations

from collections import deque

import pytest

from iterserve.bench.workload import LengthDist, make_trace, materialize_prompts
from iterserve.config import EngineConfig
from iterserve.engine.diagnostics import Capacity, Diagnostics, Slo, Thresholds
from iterserve.sampling_params import SamplingParams
from iterserve.sim.cli import make_engine
from iterserve.sim.hardware import get_hardware
from iterserve.sim.model_spec import get_model_spec
from iterserve.sim.whatif import SimulatorWhatIf

MODEL, HW = get_model_spec("llama-2-7b"), get_hardware("a100-80gb")


def trace(n: int, prompt: int, output: int, rate: float | None = None, seed: int = 0, sigma: float | None = None):
    dist = (lambda m: LengthDist("fixed", m)) if sigma is None else (lambda m: LengthDist("lognormal", m, sigma=sigma))
    t = make_trace(n, dist(prompt), dist(output), arrivals="poisson" if rate else "offline", request_rate=rate,
                   seed=seed)
    return materialize_prompts(t, None)


def drive(engine_kwargs: dict, tr, slo: Slo | None = None, every: float = 1.0, thresholds: Thresholds | None = None):
    """The trace through a simulated engine, evaluating the diagnostics every `every` virtual seconds as the
    server does; returns (every diagnostic that fired, the Diagnostics, the engine)."""
    engine = make_engine(EngineConfig(**engine_kwargs), MODEL, HW)
    diag = Diagnostics(Capacity.of_engine(engine), slo, thresholds,
                       whatif=SimulatorWhatIf(MODEL, HW, engine_kwargs, thresholds))
    clock, pending, fired = engine.clock, deque(tr.requests), {}
    next_eval = every
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_time <= clock():
            r = pending.popleft()
            engine.add_request(list(r.prompt_token_ids), SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                               request_id=r.request_id, arrival_time=r.arrival_time)
        if not engine.has_unfinished():
            clock.advance_to(pending[0].arrival_time)
            continue
        outputs = engine.step()
        diag.on_step(engine.stats, outputs)
        if clock() >= next_eval:
            fired.update(diag.evaluate(clock()))
            next_eval = clock() + every
    fired.update(diag.evaluate(clock()))
    return fired, diag, engine


def test_undersized_kv_pool_fires_preemption_and_either_knob_clears_it():
    base = {"max_num_seqs": 16, "num_kv_blocks": 64, "block_size": 16}
    tr = trace(60, 100, 200)
    fired, _, engine = drive(base, tr)
    d = fired["preemption"]
    assert engine.stats.num_preemptions > 0
    assert d.observed["preempted_share"] >= 0.05
    assert d.observed["kv_tokens_per_seat"] == 64 * 16 / 16
    assert d.observed["kv_tokens_per_request"] == 300  # prompt 100 + output 200
    seqs, memory = d.knobs["max-num-seqs"], d.knobs["kv-cache-memory"]
    assert seqs == int(64 * 16 * 0.99 // 300) and f"--max-num-seqs to {seqs}" in d.message
    assert "raise --kv-cache-memory to" in d.message and "16% " not in d.message

    fewer, _, _ = drive({**base, "max_num_seqs": seqs}, tr)
    assert "preemption" not in fewer
    blocks = memory // engine.executor.kv_cache_spec.bytes_per_block
    assert blocks > 64
    more, _, _ = drive({**base, "num_kv_blocks": blocks}, tr)
    assert "preemption" not in more


def test_swap_traffic_fires_and_a_larger_pool_clears_it():
    base = {"max_num_seqs": 16, "num_kv_blocks": 64, "block_size": 16, "preemption_mode": "swap",
            "swap_space": 4 << 30}
    tr = trace(60, 100, 200)
    fired, _, _ = drive(base, tr)
    d = fired["swap"]
    assert d.observed["swapped_step_share"] >= 0.10 and d.observed["max_swapped"] >= 1
    blocks = d.knobs["kv-cache-memory"] // MODEL.kv_bytes_per_token // 16
    fixed, _, _ = drive({**base, "num_kv_blocks": blocks}, tr)
    assert "swap" not in fixed and "preemption" not in fixed


def test_overload_fires_and_the_recommended_replicas_clear_it():
    base = {"max_num_seqs": 4, "num_kv_blocks": 4096}
    rate = 12.0
    fired, _, _ = drive(base, trace(240, 64, 64, rate))
    d = fired["overload"]
    replicas = d.knobs["replicas"]
    assert d.observed["arrival_rps"] > d.observed["finish_rps"] and replicas >= 2
    assert f"about {replicas} replicas" in d.message
    # each replica gets 1/replicas of the traffic
    fine, _, _ = drive(base, trace(240 // replicas, 64, 64, rate / replicas, seed=1))
    assert "overload" not in fine
    # or, since the seats (not the KV pool) are the limit here, one replica with more seats takes it all
    seats = d.knobs["max-num-seqs"]
    assert seats > 4 and f"raise --max-num-seqs to {seats}" in d.message
    wider, _, _ = drive({**base, "max_num_seqs": seats}, trace(240, 64, 64, rate))
    assert "overload" not in wider


@pytest.mark.slow
def test_tpot_slo_missed_fires_with_a_simulated_max_num_seqs_that_meets_it():
    base = {"max_num_seqs": 128, "num_kv_blocks": 8192, "max_num_batched_tokens": 2048}
    tr = trace(300, 400, 150, rate=30.0, sigma=0.5)
    slo = Slo(tpot=0.030)
    fired, _, _ = drive(base, tr, slo, every=2.0)
    d = fired["slo_tpot"]
    assert d.observed["violation_share"] >= 0.10 and d.observed["p90"] > 0.030
    assert d.observed["whatif"]["met"], d.message
    seqs = d.knobs["max-num-seqs"]
    assert seqs < 128 and f"--max-num-seqs {seqs}" in d.message
    fixed, _, _ = drive({**base, "max_num_seqs": seqs, "max_num_batched_tokens": d.knobs["max-num-batched-tokens"]},
                        tr, slo, every=2.0)
    assert "slo_tpot" not in fixed


def test_kv_pressure_fires_when_the_pool_not_the_seats_limits_the_batch():
    base = {"max_num_seqs": 32, "num_kv_blocks": 160, "block_size": 16}
    fired, _, _ = drive(base, trace(80, 600, 8))
    d = fired["kv_pressure"]
    assert d.observed["mean_running"] < 32 and d.observed["mean_waiting"] > 0
    blocks = d.knobs["kv-cache-memory"] // MODEL.kv_bytes_per_token // 16
    fixed, _, _ = drive({**base, "num_kv_blocks": blocks}, trace(80, 600, 8))
    assert "kv_pressure" not in fixed


def test_low_prefix_hit_rate_fires_only_with_little_sharing():
    fired, _, _ = drive({"max_num_seqs": 16, "num_kv_blocks": 4096}, trace(60, 400, 4))
    assert fired["prefix_hit_rate"].observed["hit_rate"] < 0.10
    shared = trace(60, 400, 4)
    for r in shared.requests:  # one 384-token system prompt in front of every request
        r.prompt_token_ids = shared.requests[0].prompt_token_ids[:384] + r.prompt_token_ids[384:]
    fired, _, _ = drive({"max_num_seqs": 16, "num_kv_blocks": 4096}, shared)
    assert "prefix_hit_rate" not in fired


def test_a_condition_is_reported_once_and_clears_when_it_stops_holding(caplog):
    base = {"max_num_seqs": 16, "num_kv_blocks": 64, "block_size": 16}
    with caplog.at_level("WARNING", logger="iterserve.diagnostics"):
        fired, diag, _ = drive(base, trace(60, 100, 200), every=0.2)
    assert "preemption" in fired
    assert sum("diagnostic preemption:" in r.getMessage() for r in caplog.records) == 1
    report = diag.report()
    assert [x["kind"] for x in report["diagnostics"]] == list(diag.active)
    assert diag.evaluate(diag.last_evaluated + 10_000) == {}  # the window has moved past every request


def test_the_engine_thread_work_is_two_appends():
    """on_step does no analysis: a bounded deque each, whatever the window holds."""
    engine = make_engine(EngineConfig(max_num_seqs=4, num_kv_blocks=256), MODEL, HW)
    diag = Diagnostics(Capacity.of_engine(engine), max_steps=8, max_finished=4)
    for i in range(20):
        engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=3, ignore_eos=True), request_id=f"r{i}")
    while engine.has_unfinished():
        outputs = engine.step()
        diag.on_step(engine.stats, outputs)
    w = diag.window()
    assert len(w.steps) == 8 and len(w.finished) == 4


@pytest.mark.slow
def test_ttft_slo_missed_for_want_of_seats_gets_more_seats_that_meet_it():
    base = {"max_num_seqs": 4, "num_kv_blocks": 4096}
    tr = trace(160, 64, 64, 12.0)
    fired, _, _ = drive(base, tr, Slo(ttft=0.5), every=2.0)
    d = fired["slo_ttft"]
    assert d.observed["p90"] > 0.5 and d.observed["whatif"]["met"], d.message
    seqs = d.knobs["max-num-seqs"]
    assert seqs > 4
    fixed, _, _ = drive({**base, "max_num_seqs": seqs, "max_num_batched_tokens": d.knobs["max-num-batched-tokens"]},
                        tr, Slo(ttft=0.5), every=2.0)
    assert "slo_ttft" not in fixed and "overload" not in fixed


@pytest.mark.slow
def test_a_ttft_slo_no_setting_can_meet_says_so():
    """Far past capacity, with the KV pool full too: no seat count or token budget helps; the what-if says so."""
    fired, _, _ = drive({"max_num_seqs": 8, "num_kv_blocks": 48}, trace(60, 64, 64, 40.0), Slo(ttft=0.2), every=2.0)
    d = fired["slo_ttft"]
    assert d.observed["p90"] > 0.2 and d.observed["whatif"]["met"] is False
    assert "no setting meets it at this load" in d.message and "add replicas" in d.message
