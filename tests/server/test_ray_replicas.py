"""Two engine replicas on a local Ray Serve behind our router: the openai client, both replicas used,
a replica killed mid-request (only its requests fail; Ray restarts it and the app serves again), and
the latencies the ingress measures on /metrics."""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (pip install 'iterserve[serve]')")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from iterserve.config import EngineConfig  # noqa: E402
from iterserve.engine import Engine  # noqa: E402
from tests.fake_executor import FakeExecutor  # noqa: E402
from tests.server.conftest import wait_for  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "test-model"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # slow: Ray starts


class SlowFakeExecutor(FakeExecutor):
    """Steps that take real time, so requests are still in flight when a replica is killed."""

    def execute(self, plan):
        time.sleep(0.02)
        return super().execute(plan)


def build_engine() -> Engine:
    return Engine(EngineConfig(max_num_seqs=8, num_kv_blocks=64), executor=SlowFakeExecutor())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def step_log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("steps")


@pytest.fixture(scope="module")
def cluster(step_log_dir):
    from ray import serve

    from iterserve.server.ray_app import build_ray_app, start_ray, wait_until_ready
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    start_ray(None, num_cpus=2)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_ray_app(build_engine, 2, MODEL, policy="round-robin", num_cpus_per_replica=0.5,
                                step_log_dir=str(step_log_dir)), blocking=False)
        wait_until_ready(120)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()["replicas"]


def read_step_log(path) -> tuple[list[dict], dict[str, int]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [x["step"] for x in lines if "step" in x], {x["request_id"]: x["prompt_len"] for x in lines if "prompt_len" in x}


def test_two_replicas_serve_the_openai_client_then_survive_a_killed_one(cluster, step_log_dir):
    url = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    wait_for(lambda: len(health(url)) == 2, 60, "two replicas did not report")
    done = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=5)
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 4 and any(c.choices for c in chunks)
    for _ in range(4):
        client.completions.create(model=MODEL, prompt=[9, 9, 9], max_tokens=2)
    # both replicas took requests (their reports arrive on Ray's stats poll)
    wait_for(lambda: all(s["num_requests"] >= 2 for s in health(url).values()), 30,
             "requests did not reach both replicas")
    # each replica timed the first token of every request it served, from its own side of the hop
    wait_for(lambda: all(s["num_first_tokens"] >= 2 and s["ttft_sum_s"] > 0 for s in health(url).values()), 30,
             "the replicas did not report their TTFTs")
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert metrics.count('iterserve:replica_requests_total{model_name="test-model",replica=') == 2
    # each replica logged its steps and its requests' prompt lengths (flushed at each stats poll), and
    # reports its engine thread's CPU time
    wait_for(lambda: len(list(step_log_dir.iterdir())) == 2, 30, "the replicas did not log their steps")
    for path in step_log_dir.iterdir():
        steps, prompt_lens = read_step_log(path)
        ids = {rid for step in steps for rid in step["prefill_ids"] + step["decode_ids"]}
        assert ids and ids <= set(prompt_lens) and set(prompt_lens.values()) <= {3, 4}
        assert all(len(step["prefill_starts"]) == len(step["prefill_ids"]) for step in steps)
    assert all(s["engine_cpu_s"] > 0 for s in health(url).values())

    # more requests than Ray's default of 5 ongoing per deployment replica reach the engines at once
    with ThreadPoolExecutor(12) as pool:
        batch = [pool.submit(client.completions.create, model=MODEL, prompt=[k + 20] * 4, max_tokens=150)
                 for k in range(12)]
        wait_for(lambda: sum(s["num_running"] + s["num_waiting"] for s in health(url).values()) == 12, 30,
                 "the ingress held requests back from the replicas")
        assert all(f.result().usage.completion_tokens == 150 for f in batch)

    # four long streams, two per replica (round-robin); kill one replica while all four run
    def long_stream(k: int) -> str:
        try:
            usage = None
            for chunk in client.completions.create(model=MODEL, prompt=[k + 1] * 8, max_tokens=400, stream=True,
                                                   stream_options={"include_usage": True}):
                usage = chunk.usage or usage
            return f"ok {usage.completion_tokens}"
        except openai.APIError as e:
            return f"failed {e}"

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(long_stream, k) for k in range(4)]
        running = wait_for(lambda: (h := health(url)) and all(s["num_running"] == 2 for s in h.values()) and h,
                           30, "the long requests did not all start")
        victim, stats = next(iter(running.items()))
        os.kill(stats["pid"], signal.SIGKILL)
        results = [f.result(timeout=90) for f in futures]
    failed = [r for r in results if r.startswith("failed")]
    assert len(failed) == 2, results  # the victim's two, with a clear message
    assert all("replica serving this request died" in r for r in failed), failed
    assert sorted(r for r in results if r.startswith("ok")) == ["ok 400", "ok 400"], results

    # Ray restarts the replica (a new id); the app serves on both again
    wait_for(lambda: (h := health(url)) and victim not in h and len(h) == 2 and all(s["alive"] for s in h.values()),
             60, "the killed replica was not restarted")
    for _ in range(4):
        out = client.completions.create(model=MODEL, prompt=[3, 1, 4, 1, 5], max_tokens=3)
        assert out.usage.completion_tokens == 3
    wait_for(lambda: all(s["num_requests"] >= 1 for s in health(url).values()), 30,
             "the restarted replica took no request")
    # every request has ended, so the router counts none in flight (no leak through the kill and retries)
    assert all(s["routed_in_flight"] == 0 for s in health(url).values()), health(url)


def test_bad_input_is_a_400_from_the_replica(cluster):
    r = httpx.post(f"{cluster}/v1/completions", json={"model": MODEL, "prompt": [10**9], "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]



def latency_counts(url: str) -> dict[tuple[str, str], float]:
    """(sample name, replica) -> value of the ingress's latency histograms' _count and success counter."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=10).text
    wanted = ("iterserve:time_to_first_token_seconds_count", "iterserve:inter_token_latency_seconds_count",
              "iterserve:e2e_request_latency_seconds_count", "iterserve:request_success_total")
    return {(s.name, s.labels["replica"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name in wanted and s.labels.get("finished_reason") in (None, "length")}


def test_metrics_have_the_latencies_the_ingress_measured_per_replica(cluster):
    url = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    wait_for(lambda: len(health(url)) == 2 and all(s["alive"] for s in health(url).values()), 60,
             "two live replicas did not report")
    before = latency_counts(url)
    for k in range(4):  # round-robin: two on each replica, one of each streamed
        if k % 2:
            list(client.completions.create(model=MODEL, prompt=[k + 2] * 3, max_tokens=3, stream=True))
        else:
            client.completions.create(model=MODEL, prompt=[k + 2] * 3, max_tokens=3)
    after = latency_counts(url)

    def added(name: str) -> dict[str, float]:
        return {r: v - before.get((n, r), 0.0) for (n, r), v in after.items() if n == name}

    replicas = set(health(url))
    ttft = added("iterserve:time_to_first_token_seconds_count")
    assert set(ttft) >= replicas and sum(ttft[r] for r in replicas) == 4 and all(ttft[r] >= 1 for r in replicas)
    assert sum(added("iterserve:e2e_request_latency_seconds_count").values()) == 4
    assert sum(added("iterserve:request_success_total").values()) == 4
    # 2 gaps per 3-token request, fewer where a replica's stream sent two tokens in one delta
    assert 1 <= sum(added("iterserve:inter_token_latency_seconds_count").values()) <= 8
