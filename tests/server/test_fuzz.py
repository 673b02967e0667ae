"""Hostile input: schemathesis fuzzing from the server's own OpenAPI schema, plus the hard cases by hand.

Every answer is a 2xx, or a 4xx with an OpenAI error body; never a 500 or a hang; the engine
keeps serving and holds nothing afterwards. Runs on a fast fake model (no step delay) over real HTTP.
"""
from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server.conftest import MODEL, fake_engine, leaks, no_leaks, start_server, wait_for

MAX_BYTES = 64 << 10


@pytest.fixture(scope="module")
def fast_server(tokenizer):
    server = start_server(fake_engine(tokenizer, num_kv_blocks=2048), max_request_bytes=MAX_BYTES)
    yield server
    server.stop()


def _check(r, status: int | None = None, path: str = "") -> None:
    """2xx, or a 4xx whose body is an OpenAI error object (Anthropic's on /v1/messages)."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if status is not None:
        assert r.status_code == status, r.text[:500]
    if r.status_code >= 400 and path.startswith("/v1/messages"):
        body = r.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
    elif r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == r.status_code
    content_type = r.headers.get("content-type", "")
    if isinstance(content_type, list):  # schemathesis' response keeps every value of a header
        content_type = content_type[0] if content_type else ""
    if content_type.startswith("text/event-stream") and path.startswith(("/v1/messages", "/v1/responses")):
        # typed events (event: lines), no [DONE]; the last one ends the reply, none is an error
        types = [json.loads(line[6:])["type"] for line in r.text.splitlines() if line.startswith("data: ")]
        assert types[-1] in ("message_stop", "response.completed", "response.incomplete"), types[-3:]
        assert "error" not in types, types
    elif content_type.startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert all("error" not in json.loads(e) for e in events[:-1]), events[-3:]


def _schema(tokenizer):
    # Built from a throwaway app: the schema does not depend on the engine behind it.
    from iterserve.server.app import build_app
    from iterserve.server.async_engine import AsyncEngine
    return schemathesis.openapi.from_dict(build_app(AsyncEngine(fake_engine(tokenizer)), MODEL).openapi())


@pytest.mark.slow
def test_fuzz_every_route_from_the_openapi_schema(fast_server, tokenizer):
    schema = _schema(tokenizer)
    seen = []
    for result in schema.get_all_operations():
        operation = result.ok()

        # Bounded for CI: positive and negative cases per route, no deadline (the fake engine may
        # generate a few thousand tokens for a huge max_tokens).
        @settings(max_examples=40, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            r = case.call(base_url=fast_server.url, timeout=30)
            _check(r, path=operation.path)
            seen.append((operation.path, r.status_code))

        given(case=operation.as_strategy())(fuzz)()
    codes = {code for _, code in seen}
    assert 200 in codes and 400 in codes, codes  # both accepted and refused requests were made
    wait_for(lambda: no_leaks(fast_server), 20, f"the server still holds {leaks(fast_server)}")
    r = httpx.post(fast_server.url + "/v1/completions", json={"model": MODEL, "prompt": "still here", "max_tokens": 2})
    _check(r, 200)


CHAT = [{"role": "user", "content": "hi"}]
HOSTILE = [
    # (route, body: dict | raw bytes, expected status)
    ("completions", b"{not json", 400),
    ("completions", b'{"prompt": "hi", "max_tokens": 3', 400),  # truncated
    ("completions", b"[1, 2, 3]", 400),  # JSON, but not an object
    ("completions", b"", 400),
    ("completions", b'{"prompt": "\xff\xfe bad utf-8"}', 400),
    ("completions", {"prompt": 12}, 400),
    ("completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("completions", {"prompt": "hi", "max_tokens": 10**30}, 400),  # beyond the context: refused, not cut short
    ("completions", {"prompt": "hi", "max_tokens": -5}, 400),
    ("completions", {"prompt": "hi", "n": 10**9}, 400),
    ("completions", {"prompt": "hi", "n": 64, "max_tokens": 2}, 200),
    ("completions", {"prompt": "hi", "logprobs": 10**9}, 400),
    ("completions", {"prompt": "hi", "logprobs": -1}, 400),
    ("completions", {"prompt": "hi", "stop": ["x"] * 1000}, 400),
    ("completions", {"prompt": "hi", "stop": ["x" * 5000]}, 400),
    ("completions", {"prompt": "hi", "stop": [""]}, 400),
    ("completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400),
    ("completions", {"prompt": "hi", "stop_token_ids": [10**30]}, 200),  # never matches: harmless
    ("completions", {"prompt": [10**9]}, 400),  # token id out of vocabulary
    ("completions", {"prompt": [-1, 5]}, 400),
    ("completions", {"prompt": [[1, 2], [3]], "max_tokens": 2}, 200),  # a batch of two prompts
    ("completions", {"prompt": [[1, 2], [10**9]]}, 400),  # one bad prompt refuses the batch
    ("completions", {"prompt": ["hi"] * 300}, 400),  # more prompts than one request may carry
    ("completions", {"prompt": "word " * 12000}, 400),  # 60 KB: fits the body limit, not the context
    ("completions", {"prompt": "x" * (1 << 20)}, 413),  # 1 MB prompt: over --max-request-bytes
    ("completions", b'{"prompt": "hi", "temperature": NaN}', 400),
    ("completions", b'{"prompt": "hi", "temperature": Infinity}', 400),
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400),
    ("completions", {"prompt": "hi", "top_p": 2}, 400),
    ("completions", {"prompt": "hi", "top_k": -7}, 400),
    ("completions", {"prompt": "hi", "top_k": 10**12, "max_tokens": 2}, 200),
    ("completions", {"prompt": "hi", "seed": 10**40, "max_tokens": 2}, 200),
    ("completions", {"prompt": "hi", "seed": -(10**40), "max_tokens": 2}, 200),
    ("completions", {"prompt": "hi", "priority": 10**40, "max_tokens": 2}, 200),
    ("completions", {"prompt": "hi", "echo": True, "max_tokens": 0}, 200),  # scoring only
    ("completions", {"prompt": "hi", "echo": True, "stream": True}, 400),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400),  # 0 only with echo
    ("completions", {"prompt": "hi", "stream": "yes please"}, 400),
    ("completions", {"prompt": "hi", "stream_options": 5}, 400),
    ("completions", {"prompt": "hi", "model": "other"}, 404),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("chat/completions", {"messages": [{"role": "user"}], "max_tokens": 2}, 200),
    ("chat/completions", {"messages": [{"content": "no role"}]}, 400),
    ("chat/completions", {"messages": "hello"}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "{{ 7*7 }}{% for x in range(10**9) %}{% endfor %}"}],
                          "max_tokens": 2}, 200),  # template syntax in content is data, not code
    ("chat/completions", {"messages": CHAT, "top_logprobs": 5}, 400),  # needs logprobs: true
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400),
    ("chat/completions", {"messages": CHAT, "max_tokens": 2, "n": 3, "logprobs": True, "top_logprobs": 20}, 200),
]


@pytest.mark.parametrize("route,body,status", HOSTILE, ids=[f"{i}-{r}" for i, (r, _, _) in enumerate(HOSTILE)])
def test_hostile_input(fast_server, route, body, status):
    url = f"{fast_server.url}/v1/{route}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json={"model": MODEL, "messages": CHAT, **body} if route.startswith("chat")
                       else {"model": MODEL, **body}, timeout=30)
    _check(r, status)


def test_chunked_body_over_the_limit_is_413(fast_server):
    def chunks():
        for _ in range(MAX_BYTES // 1024 + 2):
            yield b" " * 1024  # no Content-Length: the limit is counted as the body arrives
    r = httpx.post(fast_server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    _check(r, 413)


def test_streamed_hostile_requests_end_cleanly(fast_server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": True, "n": 2}
    with httpx.stream("POST", fast_server.url + "/v1/completions", json=body, timeout=30) as r:
        r.read()
    _check(r, 200)
    wait_for(lambda: no_leaks(fast_server), 10, f"the server still holds {leaks(fast_server)}")
