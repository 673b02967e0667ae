"""--max-num-queued-tokens: a request whose prompt would take the waiting requests' tokens past the limit
gets a 429 with Retry-After, beside --max-waiting-requests' limit on their count; one that fits is admitted,
and so is any request that finds nothing waiting."""
from __future__ import annotations

import httpx

from iterserve.server.cli import build_parser
from iterserve.config import ServerConfig
from iterserve.entrypoints.args import config_from_args
from tests.server.conftest import MODEL, fake_engine, no_leaks, start_server, wait_for

LIMIT = 100


def _body(num_tokens: int, stream: bool = True) -> dict:
    return {"model": MODEL, "prompt": [5] * num_tokens, "max_tokens": 400, "stream": stream}


def test_the_flag_reaches_the_server_config():
    args = build_parser().parse_args(["--max-num-queued-tokens", "2048"])
    assert config_from_args(args, ServerConfig).max_num_queued_tokens == 2048
    assert config_from_args(build_parser().parse_args([]), ServerConfig).max_num_queued_tokens is None


def test_queued_tokens_past_the_limit_are_refused_with_429(tokenizer):
    server = start_server(fake_engine(tokenizer, step_delay=0.02, max_num_seqs=1), max_num_queued_tokens=LIMIT)
    url = server.url + "/v1/completions"
    try:
        with httpx.Client(timeout=30) as http, http.stream("POST", url, json=_body(10)) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            with http.stream("POST", url, json=_body(60)) as waiting:
                engine = server.async_engine.engine
                wait_for(lambda: engine.stats.num_queued_tokens == 60, 10, "the second request is not waiting")
                r = http.post(url, json=_body(50, stream=False))
                assert r.status_code == 429, r.text
                err = r.json()["error"]
                assert err["type"] == "rate_limit_exceeded" and err["code"] == 429 and "60" in err["message"]
                assert r.headers["retry-after"]
                with http.stream("POST", url, json=_body(40)) as fits:  # 60 + 40 is within the limit
                    assert fits.status_code == 200
                assert waiting.status_code == 200
        wait_for(lambda: no_leaks(server), 10, "the server did not go idle")
        assert server.async_engine.engine.stats.num_queued_tokens == 0  # the aborted waiting requests left it
        alone = httpx.post(url, json={**_body(3 * LIMIT, stream=False), "max_tokens": 2}, timeout=30)
        assert alone.status_code == 200, alone.text  # nothing waiting: admitted whatever its size
    finally:
        server.stop()
