"""Graceful shutdown with a limit, in a real server process: SIGTERM stops admissions (503), lets the
running requests finish until --shutdown-timeout, ends the rest with an SSE error event, then exits."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL, wait_for

ROOT = Path(__file__).resolve().parents[2]
SHUTDOWN_TIMEOUT = 2.0


def _stream(url: str, max_tokens: int, events: list, started: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "Tell a story", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            if r.status_code != 200:
                events.append(f"status {r.status_code}: {r.read()!r}")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as exc:  # a cut connection is a failure the test reports
        events.append(f"cut: {exc!r}")
    started.set()


@pytest.mark.slow
def test_sigterm_drains_within_the_limit_then_exits(tmp_path):
    port_file, log = tmp_path / "port", open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.server.fake_serve", str(port_file), str(SHUTDOWN_TIMEOUT)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(port_file.exists, 60, "the server process did not start")
        url = f"http://127.0.0.1:{port_file.read_text()}"
        wait_for(lambda: _status(url + "/health") == 200, 30, "the server did not answer /health")
        short, long_ = [], []
        s1, s2 = threading.Event(), threading.Event()
        threads = [threading.Thread(target=_stream, args=(url, 100, short, s1)),    # ~1 s at 10 ms a step
                   threading.Thread(target=_stream, args=(url, 1900, long_, s2))]   # ~19 s: past the limit
        for t in threads:
            t.start()
        assert s1.wait(10) and s2.wait(10)
        assert short[0].startswith("{") and long_[0].startswith("{"), (short[:1], long_[:1])

        os.kill(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        # draining: still listening, but no new work, and /health tells the load balancer
        wait_for(lambda: _status(url + "/health") == 503, 2, "/health did not turn 503")
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_shutting_down"

        for t in threads:
            t.join(SHUTDOWN_TIMEOUT + 10)
        # the short request finished normally, after the signal
        assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
        # the long one was ended at the limit with an error event, not cut
        assert len(long_) >= 2 and long_[-1] == "[DONE]", long_[-3:]
        assert json.loads(long_[-2])["error"]["type"] == "server_shutting_down", long_[-3:]
        assert proc.wait(SHUTDOWN_TIMEOUT + 10) in (0, -signal.SIGTERM)
        elapsed = time.monotonic() - sent
        assert SHUTDOWN_TIMEOUT - 0.5 < elapsed < SHUTDOWN_TIMEOUT + 6, elapsed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert "SIGTERM: draining 2 open requests" in text, text[-2000:]


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None
