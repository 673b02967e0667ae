"""The live dashboard in a real browser: headless Chromium (Debian's `chromium`) loads /dashboard from a
server under traffic and must show the running requests. Set ITERSERVE_SCREENSHOT=PATH to keep the
screenshot (docs/img/dashboard.png is made this way)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading

import httpx
import pytest

from iterserve.engine.diagnostics import KINDS, Capacity, Diagnostics, Thresholds
from tests.server.conftest import MODEL, fake_engine, start_server, wait_for

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1400,1250"]


def find_chromium() -> str:
    """Debian's chromium, installed here when missing (and we may); otherwise the test is skipped."""
    path = shutil.which("chromium")
    if path is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "chromium"], capture_output=True, timeout=600)
        path = shutil.which("chromium")
    if path is None:
        pytest.skip("no chromium browser: `apt-get install -y chromium` (Debian) needs root and a package mirror")
    return path


def chromium(browser: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"  # a fresh profile every run
    return subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_the_dashboard_shows_the_running_requests(tokenizer, tmp_path):
    browser = find_chromium()
    engine = fake_engine(tokenizer, step_delay=0.03, max_num_seqs=12, num_kv_blocks=40)
    diag = Diagnostics(Capacity.of_engine(engine),
                       thresholds=Thresholds(min_requests=6, min_steps=10, evaluate_every_s=0.2))
    server = start_server(engine, diagnostics=diag)
    ids, stop = [], threading.Event()

    def client(k: int) -> None:  # a steady load: mixed lengths, enough to overflow the small pool
        while not stop.is_set():
            body = {"model": MODEL, "prompt": "Once upon a time " * (1 + k % 5), "max_tokens": 20 + 37 * (k % 4),
                    "stream": True, "ignore_eos": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        rid = json.loads(line[6:])["id"]
                        if rid not in ids:
                            ids.append(rid)
                    if stop.is_set():
                        return

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(16)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(ids) >= 8, 30, "no traffic")
        wait_for(lambda: diag.active, 30, "no diagnostic under this load")
        dom = chromium(browser, tmp_path, "--virtual-time-budget=4000", "--dump-dom", server.url + "/dashboard")
        assert dom.returncode == 0, dom.stderr[-2000:]
        running = dom.stdout.split('id="running"', 1)[1].split("</div>", 1)[0]
        shown = [rid for rid in ids if rid in running]
        assert " running: " in running and shown, running[:500]
        listed = dom.stdout.split('id="diagnostics"', 1)[1].split("</ul>", 1)[0]
        assert any(f'class="kind">{kind}: ' in listed for kind in KINDS), listed  # the active diagnostics
        assert 'id="updated">updated ' in dom.stdout  # the page fetched and rendered at least once
        shot = tmp_path / "dashboard.png"
        out = chromium(browser, tmp_path, "--virtual-time-budget=4000", f"--screenshot={shot}", server.url + "/dashboard")
        assert out.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out.stderr[-2000:]
        if os.environ.get("ITERSERVE_SCREENSHOT"):
            shutil.copy(shot, os.environ["ITERSERVE_SCREENSHOT"])
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        server.stop()
