"""The driver, report and plots against a fake engine on a virtual clock (fast, exact), an HTTP
target against a mock SSE server, and a small end-to-end run of the real engine in both modes."""
import asyncio
import json

import httpx
import pytest

from iterserve.bench import cli
from iterserve.bench.metrics import Slo
from iterserve.bench.plots import plot_all, timeline_matrix
from iterserve.bench.runner import build_report, format_table, run_bench, run_http, run_targets, run_trace
from iterserve.bench.workload import LengthDist, make_trace, materialize_prompts

from .fake_engine import FakeEngine


def _trace(n=32, out=LengthDist("exponential", 32, high=128), **kw):
    return materialize_prompts(make_trace(n, LengthDist("fixed", 16), out, seed=0, **kw), None)


def _factory(scheduling, kw):
    return FakeEngine(kw.get("max_num_seqs", 4), scheduling)


def test_continuous_beats_static_on_varied_lengths():
    results = run_targets(_trace(), ["continuous", "static"], {"max_num_seqs": 8}, engine_factory=_factory)
    report = build_report({}, results)
    cont, stat = report["targets"]
    assert cont["completed"] == stat["completed"] == 32
    assert cont["output_tokens"] == stat["output_tokens"] == _trace().total_output_tokens
    assert cont["output_tokens_per_s"] > 1.5 * stat["output_tokens_per_s"]
    assert stat["ratio_to_first"] == pytest.approx(stat["output_tokens_per_s"] / cont["output_tokens_per_s"])
    assert "continuous" in format_table(report)


def test_open_loop_arrivals_advance_the_virtual_clock():
    trace = _trace(20, arrivals="poisson", request_rate=2.0)
    engine = FakeEngine(4)
    result = run_trace(engine, trace)
    start = 100.0
    for (rid, given, added), r in zip(engine.arrivals, sorted(trace.requests, key=lambda r: r.arrival_time)):
        assert rid == r.request_id and given == pytest.approx(start + r.arrival_time)
        assert added >= given - 1e-9  # never submitted before it arrived
    assert [m.arrival for m in result.requests] == pytest.approx([r.arrival_time for r in trace.requests])
    assert result.duration >= trace.requests[-1].arrival_time  # the clock was advanced across gaps


def test_closed_loop_keeps_concurrency():
    trace = _trace(30, arrivals="closed", concurrency=3)
    engine = FakeEngine(8)
    in_flight = []
    orig = engine.step

    def step():
        in_flight.append(len(engine.waiting) + len(engine.running))
        return orig()

    engine.step = step
    result = run_trace(engine, trace)
    assert len(result.requests) == 30 and max(in_flight) == 3


def test_replay_gives_the_same_token_counts(tmp_path):
    trace = _trace()
    trace.save(tmp_path / "t.jsonl")
    from iterserve.bench.workload import Trace
    a = run_bench(trace, ["continuous"], {"max_num_seqs": 4}, engine_factory=_factory)
    b = run_bench(Trace.load(tmp_path / "t.jsonl"), ["continuous"], {"max_num_seqs": 4}, engine_factory=_factory)
    counts = lambda rep: [(r["id"], r["prompt_len"], r["output_len"]) for r in rep["targets"][0]["requests"]]  # noqa: E731
    assert counts(a) == counts(b)


@pytest.mark.slow
def test_report_json_and_plots(tmp_path):
    results = run_targets(_trace(), ["continuous", "static"], {"max_num_seqs": 8}, engine_factory=_factory)
    report = build_report({"x": 1}, results, Slo(ttft=1.0))
    text = json.dumps(report)  # serialisable as it is
    t = json.loads(text)["targets"][0]
    for key in ("name", "output_tokens_per_s", "requests_per_s", "total_tokens_per_s", "goodput_rps",
                "mean_batch_size", "preemptions", "series"):
        assert key in t
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"):
        assert set(t[key]) >= {"mean", "p50", "p90", "p99"}
    grid = timeline_matrix(results[0])
    assert grid.shape == (32, len(results[0].steps)) and (grid == 3).any() and (grid == 2).sum() == 32
    paths = plot_all(results, tmp_path)
    assert {p.name for p in paths} == {"throughput.png", "latency_cdf.png", "batch_kv.png",
                                       "timeline_continuous.png", "timeline_static.png"}
    assert all(p.stat().st_size > 1000 for p in paths)


def _sse_transport(tokens_per_request: int):
    """A mock /v1/completions that streams one chunk per token and a usage chunk."""
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "mock"}]})
        body = json.loads(request.content)
        assert body["stream"] and body["ignore_eos"] and isinstance(body["prompt"], list)
        n = body["max_tokens"]

        async def stream():
            for i in range(n):
                await asyncio.sleep(0.001)
                yield f"data: {json.dumps({'choices': [{'text': f' t{i}', 'index': 0}]})}\n\n".encode()
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handler)


def test_http_target_times_sse_chunks():
    trace = _trace(6, out=LengthDist("uniform", low=2, high=6), arrivals="closed", concurrency=2)
    result = run_http(trace, "http://mock", transport=_sse_transport(4))
    assert [m.output_len for m in result.requests] == [r.output_len for r in trace.requests]
    assert all(m.ttft > 0 and len(m.itl) == m.output_len - 1 and m.queue is None for m in result.requests)


# ---------------------------------------------------------------- the real engine


@pytest.mark.slow
def test_cli_end_to_end_real_engine(tmp_path, default_model_path, capsys):
    """Both modes of the real engine on the default model, through the command line (one model
    load, shared by the two engines)."""
    argv = ["--targets", "continuous,static", "--num-requests", "6", "--prompt-len", "24",
            "--output-dist", "exponential", "--output-mean", "8", "--output-max", "16", "--max-num-seqs", "3",
            "--seed", "1", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "plots"),
            "--save-trace", str(tmp_path / "t.jsonl"), "--no-progress", "--slo-ttft", "10"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "continuous" in out and "static" in out
    report = json.loads((tmp_path / "r.json").read_text())
    cont, stat = report["targets"]
    assert cont["name"] == "continuous" and stat["name"] == "static"
    trace = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()[1:]]
    want = [(r["request_id"], r["output_len"]) for r in trace]
    for t in (cont, stat):  # ignore_eos: both modes generate exactly the trace's lengths
        assert t["completed"] == 6
        assert [(r["id"], r["output_len"]) for r in t["requests"]] == want
        assert t["ttft_s"]["mean"] > 0 and t["e2e_s"]["p99"] >= t["ttft_s"]["p99"]
    assert cont["mean_batch_size"] > 1 and cont["max_kv_usage"] > 0
    assert (tmp_path / "plots" / "timeline_static.png").exists()


@pytest.mark.slow
def test_sweep_prints_throughput_against_latency(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "shared_model_engines", lambda: _factory)
    argv = ["--targets", "continuous,static", "--num-requests", "24", "--prompt-len", "16", "--output-mean", "16",
            "--output-max", "64", "--sweep", "max-num-seqs=1,4,16", "--json", str(tmp_path / "s.json"),
            "--plot", str(tmp_path), "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "max-num-seqs" in out and out.count("continuous") >= 3
    report = json.loads((tmp_path / "s.json").read_text())
    assert [t["sweep"]["max-num-seqs"] for t in report["targets"]] == [1, 1, 4, 4, 16, 16]
    cont = [t["output_tokens_per_s"] for t in report["targets"] if t["name"] == "continuous"]
    assert cont[0] < cont[1] < cont[2]  # more seats, more throughput on the fake's cost model
    assert (tmp_path / "sweep_max-num-seqs.png").exists()


def test_hf_static_batches_in_arrival_order_and_counts_only_target_tokens():
    """transformers' generate on a tiny random Llama: batches of max_num_seqs, outputs forced to
    the batch's longest target, per-request figures cut at each request's own length."""
    import types

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from iterserve.bench.runner import run_hf_static
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    tok = types.SimpleNamespace(pad_token_id=None, eos_token_id=2)
    trace = materialize_prompts(make_trace(5, LengthDist("uniform", low=3, high=9), LengthDist("uniform", low=1, high=6),
                                           seed=4), None)
    result = run_hf_static(trace, 2, model=model, tokenizer=tok)
    assert [m.output_len for m in result.requests] == [r.output_len for r in trace.requests]
    batches = [trace.requests[i:i + 2] for i in range(0, 5, 2)]
    assert len(result.steps) == sum(max(r.output_len for r in b) for b in batches)
    for b in batches:  # one batch finishes together: a batch framework returns it whole
        ends = {m.finished for m in result.requests if m.request_id in {r.request_id for r in b}}
        assert len(ends) == 1
    assert all(len(m.itl) == m.output_len - 1 and m.ttft > 0 for m in result.requests)
    summary = build_report({}, [result])["targets"][0]
    assert summary["mean_kv_usage"] is None and summary["output_tokens"] == trace.total_output_tokens


def test_real_engine_and_scheduler_with_a_fake_executor():
    """The real Engine and Scheduler (no model): the driver speaks the engine's interface, both
    modes generate exactly the trace's lengths, and static needs more steps for the same work."""
    from iterserve.config import EngineConfig
    from iterserve.engine import Engine
    from tests.fake_executor import FakeExecutor

    def factory(scheduling, kw):
        return Engine(EngineConfig(max_num_seqs=kw["max_num_seqs"], scheduling=scheduling),
                      executor=FakeExecutor(num_kv_blocks=512))

    trace = _trace(24, out=LengthDist("exponential", 16, high=64))
    cont, stat = run_targets(trace, ["continuous", "static"], {"max_num_seqs": 6}, engine_factory=factory)
    for r in (cont, stat):
        assert [m.output_len for m in r.requests] == [t.output_len for t in trace.requests]
        assert all(m.ttft is not None and m.e2e >= m.ttft for m in r.requests)
    assert len(cont.steps) < len(stat.steps)
    assert max(len(s.prefill_ids) + len(s.decode_ids) for s in cont.steps) <= 6
