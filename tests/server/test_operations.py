"""What operators read: metrics they can trust (n > 1 counted once, vLLM's per-request histograms),
the diagnostics through the server, the dashboard's JSON, and deploy/'s Grafana panels against /metrics."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from iterserve.engine.diagnostics import Capacity, Diagnostics, Thresholds
from tests.server.conftest import MODEL, fake_engine, metric, start_server, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(tokenizer):
    engine = fake_engine(tokenizer, step_delay=0.002)
    s = start_server(engine, diagnostics=Diagnostics(Capacity.of_engine(engine)))
    yield s
    s.stop()


def _metrics(server) -> str:
    return httpx.get(server.url + "/metrics").text


def test_a_request_with_n_sequences_counts_once(server):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "n": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    wait_for(lambda: metric(_metrics(server), "iterserve:request_success_total", finished_reason="length") == 1, 5)
    text = _metrics(server)
    assert metric(text, "iterserve:request_success_total", finished_reason="length") == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert metric(text, f"iterserve:{name}_count") == 1, name
    assert metric(text, "iterserve:prompt_tokens_total") == len(prompt)
    assert metric(text, "iterserve:request_prompt_tokens_sum") == len(prompt)
    assert metric(text, "iterserve:request_generation_tokens_sum") == 4 * 6  # every sequence's tokens
    assert metric(text, "iterserve:generation_tokens_total") == 4 * 6
    # a second, plain request adds one more of each
    body.update(n=1)
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    wait_for(lambda: metric(_metrics(server), "iterserve:request_success_total", finished_reason="length") == 2, 5)
    text = _metrics(server)
    assert metric(text, "iterserve:time_to_first_token_seconds_count") == 2
    assert metric(text, "iterserve:prompt_tokens_total") == 2 * len(prompt)


def test_vllm_metrics_with_their_meanings(server):
    body = {"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": 9, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    wait_for(lambda: metric(_metrics(server), "iterserve:request_success_total", finished_reason="length") == 1, 5)
    text = _metrics(server)
    assert metric(text, "iterserve:request_generation_tokens_sum") == 9
    assert metric(text, "iterserve:request_prompt_tokens_sum") == 37
    # prefill + decode = inference (first scheduled -> last token); decode / 8 gaps = TPOT
    prefill = metric(text, "iterserve:request_prefill_time_seconds_sum")
    decode = metric(text, "iterserve:request_decode_time_seconds_sum")
    assert metric(text, "iterserve:request_inference_time_seconds_sum") == pytest.approx(prefill + decode)
    assert metric(text, "iterserve:request_time_per_output_token_seconds_sum") == pytest.approx(decode / 8)
    # every step's tokens: the prompt once, then one per decode step
    assert metric(text, "iterserve:iteration_tokens_total_sum") == 37 + 8
    assert metric(text, "iterserve:num_requests_swapped") == 0
    engine = server.async_engine.engine
    assert metric(text, "iterserve:cache_config_info", block_size="16",
                  num_gpu_blocks=str(engine.stats.num_kv_blocks), enable_prefix_caching="True") == 1
    assert metric(text, "process_resident_memory_bytes") > 0 and "process_cpu_seconds_total" in text
    assert metric(text, "iterserve:diagnostic", kind="preemption") == 0


def test_diagnostics_fire_through_the_server(tokenizer):
    engine = fake_engine(tokenizer, step_delay=0.002, max_num_seqs=16, num_kv_blocks=24)
    diag = Diagnostics(Capacity.of_engine(engine), thresholds=Thresholds(min_requests=8, min_steps=10,
                                                                         evaluate_every_s=0.1))
    server = start_server(engine, diagnostics=diag)
    try:
        with httpx.Client(timeout=60) as http:
            import concurrent.futures as cf
            body = {"model": MODEL, "prompt": list(range(3, 60)), "max_tokens": 60, "ignore_eos": True}
            with cf.ThreadPoolExecutor(16) as pool:
                codes = list(pool.map(lambda _: http.post(server.url + "/v1/completions", json=body).status_code,
                                      range(16)))
            assert codes == [200] * 16
            report = wait_for(lambda: (r := http.get(server.url + "/v1/diagnostics").json())["diagnostics"] and r, 10)
            kinds = {d["kind"]: d for d in report["diagnostics"]}
            assert report["enabled"] and "preemption" in kinds, report
            assert kinds["preemption"]["knobs"]["max-num-seqs"] == int(24 * 16 * 0.99 // (57 + 60))
            assert metric(http.get(server.url + "/metrics").text, "iterserve:diagnostic", kind="preemption") == 1
            state = http.get(server.url + "/v1/dashboard").json()
            assert "preemption" in [d["kind"] for d in state["diagnostics"]]
    finally:
        server.stop()


def test_dashboard_state_shows_the_running_requests(server):
    import threading
    ids, done = [], threading.Event()
    server.async_engine.engine.executor.step_delay = 0.02

    def stream():
        body = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and not ids:
                    ids.append(json.loads(line[6:])["id"])
                if done.is_set():
                    return

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    try:
        wait_for(lambda: ids, 10)
        state = wait_for(lambda: (s := httpx.get(server.url + "/v1/dashboard").json())["running"] and s, 5)
        assert ids[0] in state["running"] and ids[0] in state["arrivals"]
        step = state["steps"][-1]
        assert ids[0] in step["decode"] and step["running"] >= 1 and 0 < step["kv_usage"] <= 1
        assert state["config"]["diagnostics"] is True
        page = httpx.get(server.url + "/dashboard")
        assert page.status_code == 200 and '<script src="/dashboard.js">' in page.text
        assert "drawTimeline" in httpx.get(server.url + "/dashboard.js").text
    finally:
        done.set()
        t.join(10)


# ---- deploy/: every Grafana panel's metric exists in the real /metrics ----------------------------

def _exposed_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_grafana_panels_use_only_metrics_the_server_exposes(server):
    body = {"model": MODEL, "prompt": [4, 5, 6], "max_tokens": 3}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    exposed = _exposed_names(_metrics(server))
    dashboard = json.loads((ROOT / "deploy/grafana/iterserve-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and all(p["targets"] for p in dashboard["panels"])
    for expr in exprs:
        names = {n for n in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if ":" in n or n.startswith("process_")}
        assert names, expr
        missing = names - exposed
        assert not missing, f"panel query {expr!r} names metrics /metrics does not have: {missing}"
    scrape = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
    assert "metrics_path: /metrics" in scrape and "job_name: iterserve" in scrape


def test_an_aborted_request_with_n_sequences_counts_once(server):
    server.async_engine.engine.executor.step_delay = 0.01
    body = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 500, "n": 3, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # running: then the client leaves
    wait_for(lambda: metric(_metrics(server), "iterserve:request_success_total", finished_reason="abort") > 0, 5)
    wait_for(lambda: server.async_engine.num_open_requests == 0, 5)
    text = _metrics(server)
    assert metric(text, "iterserve:request_success_total", finished_reason="abort") == 1
    assert metric(text, "iterserve:e2e_request_latency_seconds_count") == 1
    assert metric(text, "iterserve:prompt_tokens_total") == metric(text, "iterserve:request_prompt_tokens_sum") > 0


def test_serve_flags_for_operations_have_defaults_and_help():
    from iterserve.server.cli import build_parser
    parser = build_parser()
    args = parser.parse_args([])
    assert (args.shutdown_timeout, args.diagnostics, args.slo_ttft, args.slo_tpot) == (30.0, True, None, None)
    args = parser.parse_args(["--no-diagnostics", "--slo-tpot", "0.05", "--shutdown-timeout", "5"])
    assert (args.shutdown_timeout, args.diagnostics, args.slo_tpot) == (5.0, False, 0.05)
    text = parser.format_help()
    assert "--shutdown-timeout" in text and "(default: 30.0)" in text and "--slo-ttft" in text
