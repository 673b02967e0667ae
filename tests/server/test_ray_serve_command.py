"""`iterserve serve --data-parallel-size 2` as a user runs it: a local Ray starts, two replicas serve the
openai client on one endpoint, and SIGTERM takes it all down (exit 0, the Ray it started gone)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (pip install 'iterserve[serve]')")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.server.conftest import wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def replica_pids() -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"EngineReplica" in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def raylet_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "raylet/raylet"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


@pytest.mark.slow
def test_serve_data_parallel_two_replicas_then_sigterm(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = raylet_pids()
    proc = subprocess.Popen([sys.executable, "-m", "iterserve.cli", "serve", "--model", tiny_model_dir,
                             "--data-parallel-size", "2", "--num-cpus-per-replica", "0.5", "--num-threads", "1",
                             "--kv-cache-memory", "8MiB", "--max-num-seqs", "4", "--served-model-name", "tiny",
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            try:
                r = httpx.get(f"{url}/health", timeout=5)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and len(r.json()["replicas"]) == 2
        wait_for(ready, 240, "the two replicas did not come up", interval=1.0)
        # the local Ray runs the engines at normal priority, not at Ray's default worker nice of 15
        assert replica_pids() and all(os.getpriority(os.PRIO_PROCESS, p) == 0 for p in replica_pids())
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4
        chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"serve did not stop within 90 s of SIGTERM:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # the local Ray this command started went down with it
    deadline = time.monotonic() + 30
    while raylet_pids() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not raylet_pids() - before
