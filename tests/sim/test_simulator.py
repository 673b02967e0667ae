"""The simulator end to end: the real engine, scheduler and KV manager on a virtual clock."""
import json

import pytest

from iterserve.bench.metrics import summarize
from iterserve.bench.workload import LengthDist, make_trace, materialize_prompts
from iterserve.config import EngineConfig
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput
from iterserve.sim.cli import main as simulate_main, make_engine, simulate_trace
from iterserve.sim.cost_model import CostModel
from iterserve.sim.executor import SimulatedExecutor, VirtualClock
from iterserve.sim.hardware import get_hardware
from iterserve.sim.model_spec import get_model_spec

LLAMA, A100 = get_model_spec("llama-2-7b"), get_hardware("a100-80gb")


def test_virtual_clock_never_goes_back():
    c = VirtualClock()
    c.advance_to(5.0)
    c.advance_to(2.0)
    assert c() == c.now() == 5.0


def test_executor_advances_clock_by_modelled_step_time():
    ex = SimulatedExecutor(LLAMA, A100, num_kv_blocks=100)
    p = SamplingParams(max_tokens=4)
    plan = SchedulerOutput([ScheduledRequest("a", [1] * 20, 0, [0, 1], True, p),
                            ScheduledRequest("b", [1] * 8, 0, [2], False, p)], 16)
    res = ex.execute(plan)
    assert res.sampled == [0, -1]
    assert ex.clock() == pytest.approx(res.step_time)
    assert res.step_time == pytest.approx(CostModel(LLAMA, A100).step_time([20, 8], [20, 8]))
    assert ex.eos_token_ids == frozenset() and ex.tokenizer is None and ex.num_kv_blocks == 100
    assert ex.kv_cache_spec.bytes_per_block == 16 * LLAMA.kv_bytes_per_token


def test_requests_finish_at_their_trace_length_in_virtual_time():
    trace = materialize_prompts(make_trace(20, LengthDist("fixed", 64), LengthDist("uniform", 1, low=1, high=50),
                                           arrivals="poisson", request_rate=50.0, seed=1), None)
    result = simulate_trace(trace, EngineConfig(max_num_seqs=8), LLAMA, A100)
    by_id = {m.request_id: m for m in result.requests}
    assert len(by_id) == 20
    for r in trace.requests:
        m = by_id[r.request_id]
        assert m.output_len == r.output_len
        assert m.ttft > 0 and m.e2e >= m.ttft
    # a virtual second per ~9 ms step: the run takes modelled, not wall, time
    assert result.duration >= trace.requests[-1].arrival_time


def test_kv_pool_comes_from_memory_budget_unless_pinned():
    engine = make_engine(EngineConfig(), LLAMA, A100)
    assert engine.executor.num_kv_blocks == CostModel(LLAMA, A100).num_kv_blocks(16, 0.9, 2048, 64)
    assert make_engine(EngineConfig(num_kv_blocks=123), LLAMA, A100).executor.num_kv_blocks == 123


def _anyscale_trace(n: int = 400):
    # vLLM-paper-like: prompt 512, outputs exponential mean 128 capped at 1536
    return materialize_prompts(make_trace(n, LengthDist("fixed", 512), LengthDist("exponential", 128, high=1536),
                                          seed=0), None)


def test_continuous_doubles_static_throughput_and_packs_the_kv_pool():
    """OPT-13B on an A100-40GB, same KV pool for both modes."""
    model, hw = get_model_spec("opt-13b"), get_hardware("a100-40gb")
    trace = _anyscale_trace()
    out = {}
    for mode in ("continuous", "static"):
        cfg = EngineConfig(scheduling=mode, max_num_seqs=256, max_num_batched_tokens=2048)
        out[mode] = summarize(simulate_trace(trace, cfg, model, hw), per_request=False)
    cont, stat = out["continuous"], out["static"]
    assert cont["output_tokens_per_s"] >= 2 * stat["output_tokens_per_s"]
    # paged KV: while requests wait, most of the pool holds live tokens (vLLM: ~96%) ...
    series = cont["series"]
    busy = [u for u, w in zip(series["kv_usage"], series["num_waiting"]) if w > 0]
    assert sum(busy) / len(busy) > 0.9
    # ... and it holds several times the requests a max-length (2048-token) reservation would
    pool_tokens = cont["extra"]["num_kv_blocks"] * 16
    max_len_seats = pool_tokens // model.max_model_len
    assert cont["mean_batch_size_time_weighted"] >= 2.5 * max_len_seats
    # under max-length reservation the live share of reserved slots is small (vLLM: 20-38%)
    live_per_request = 512 + sum(r.output_len for r in trace.requests) / len(trace) / 2
    assert live_per_request / model.max_model_len < 0.4


def test_simulate_cli_json_matches_bench_schema(tmp_path):
    path = tmp_path / "sim.json"
    rc = simulate_main(["--model", "llama-2-7b", "--hardware", "a100-80gb", "--num-requests", "30",
                        "--prompt-len", "64", "--output-mean", "32", "--max-num-seqs", "8",
                        "--request-rate", "20", "--json", str(path), "--slo-ttft", "1"])
    assert rc == 0
    report = json.loads(path.read_text())
    assert [t["name"] for t in report["targets"]] == ["continuous", "static"]
    for key in ("output_tokens_per_s", "ttft_s", "tpot_s", "goodput_rps", "series", "requests", "mean_kv_usage"):
        assert key in report["targets"][0]
    assert report["config"]["simulator"]["hardware"]["name"] == "a100-80gb"


def test_step_time_cli_writes_json(tmp_path, capsys):
    path = tmp_path / "st.json"
    assert simulate_main(["--step-time", "--model", "llama-2-7b", "--hardware", "a100-80gb",
                          "--batch-sizes", "1,8,32", "--context-len", "256", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 8, 32]
    assert rows[0]["step_ms"] < rows[2]["step_ms"]
    assert "step ms" in capsys.readouterr().out


def test_simulate_rejects_targets_it_cannot_model(capsys):
    with pytest.raises(SystemExit) as exited:
        simulate_main(["--targets", "continuous,hf-static", "--num-requests", "2"])
    assert exited.value.code == 2 and "hf-static" in capsys.readouterr().err


def test_tensor_parallel_70b_simulates():
    trace = materialize_prompts(make_trace(16, LengthDist("fixed", 256), LengthDist("fixed", 16), seed=0), None)
    model, hw = get_model_spec("llama-3-70b"), get_hardware("h100-sxm")
    res = summarize(simulate_trace(trace, EngineConfig(max_num_seqs=16, tensor_parallel_size=4), model, hw),
                    per_request=False)
    assert res["completed"] == 16
    with pytest.raises(ValueError, match="does not fit"):
        simulate_trace(trace, EngineConfig(), model, hw)


def _preempting_run(mode: str, hw) -> dict:
    """A pool too small for the load: requests are preempted, by swap or by recompute."""
    trace = materialize_prompts(make_trace(60, LengthDist("fixed", 512), LengthDist("fixed", 256),
                                           arrivals="poisson", request_rate=20.0, seed=0), None)
    config = EngineConfig(max_num_seqs=32, num_kv_blocks=400, preemption_mode=mode, swap_space="8GiB")
    engine = make_engine(config, LLAMA, hw)
    plans = []
    execute = engine.executor.execute
    engine.executor.execute = lambda plan: plans.append(plan) or execute(plan)
    from iterserve.bench.runner import run_trace
    result = summarize(run_trace(engine, trace), per_request=False)
    return {"preemptions": result["preemptions"], "swaps": sum(len(p.swap_out) for p in plans),
            "tok_s": result["output_tokens_per_s"]}


def test_auto_preemption_prices_swap_with_the_modelled_link():
    """Regression: the simulated executor had no block size in bytes, so swap was priced free and
    auto behaved exactly like swap. On a slow host link recompute is cheaper: auto must recompute."""
    slow = type(A100)(**{**A100.to_json(), "host_link_bandwidth": 0.05e9})
    swap, auto = _preempting_run("swap", slow), _preempting_run("auto", slow)
    assert swap["preemptions"] > 0 and swap["swaps"] > 0
    assert auto["preemptions"] > 0 and auto["swaps"] == 0, "recompute is cheaper over a 50 MB/s link"
    assert auto["tok_s"] > swap["tok_s"]
    fast_auto, fast_swap = _preempting_run("auto", A100), _preempting_run("swap", A100)
    assert fast_auto["swaps"] > 0 and fast_auto == fast_swap, "over PCIe a 7B model's KV swaps cheaper"
