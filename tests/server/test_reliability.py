"""Faults, overload, timeouts and abort storms, end to end over HTTP on the fake model.

Every test ends by checking the server holds nothing: no KV block, no scheduler request, no
engine text state, no open stream (conftest.leaks)."""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from iterserve.sampling_params import SamplingParams
from iterserve.config import SchedulerConfig
from iterserve.server.async_engine import AsyncEngine, EngineDeadError
from tests.faulty_executor import FaultyExecutor
from tests.server.conftest import MODEL, fake_engine, leaks, metric, no_leaks, start_server, wait_for

LONG = {"model": MODEL, "prompt": "Tell a very long story", "max_tokens": 1500}


def _events(lines) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def _wait_idle(server) -> None:
    wait_for(lambda: no_leaks(server), 10, f"the server still holds {leaks(server)}")


@pytest.fixture
def faulty_server(tokenizer):
    # Two seats: the third request waits in the queue while the first two run into the fault.
    server = start_server(fake_engine(tokenizer, step_delay=0.01, max_num_seqs=2, wrap=FaultyExecutor))
    yield server
    server.stop()


def test_a_step_fault_fails_only_that_steps_requests(faulty_server):
    server, executor = faulty_server, faulty_server.async_engine.engine.executor
    with httpx.Client(timeout=10) as http, \
            http.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as s1, \
            http.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as s2:
        l1, l2 = s1.iter_lines(), s2.iter_lines()
        next(l1), next(l2)  # both running
        waiting = threading.Thread(target=lambda: results.append(
            http.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 5})))
        results: list[httpx.Response] = []
        waiting.start()
        wait_for(lambda: server.async_engine.engine.scheduler.num_waiting == 1, 10)
        executor.fail(1)
        for lines in (l1, l2):
            events = _events(lines)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
            assert "injected fault" in events[-2]["error"]["message"]
        waiting.join(10)
    assert executor.num_faults == 1 and len(executor.faulted_ids[0]) == 2
    assert results[0].status_code == 200 and results[0].json()["usage"]["completion_tokens"] == 5
    _wait_idle(server)
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "iterserve:request_success_total", finished_reason="error") == 2


def test_a_step_fault_is_a_500_for_a_whole_answer_and_fails_all_n(faulty_server):
    server, executor = faulty_server, faulty_server.async_engine.engine.executor
    executor.fail(1)
    err = _error(httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 5}, timeout=10), 500)
    assert err["type"] == "internal_error"
    # n = 2: the fault hits the parent before it forks; the request fails as one, nothing left behind.
    executor.fail(1)
    _error(httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 5, "n": 2}, timeout=10), 500)
    _wait_idle(server)
    r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 3, "n": 2}, timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6


def test_a_fatal_fault_fails_everything_promptly_and_health_turns_503(faulty_server):
    server, executor = faulty_server, faulty_server.async_engine.engine.executor
    with httpx.Client(timeout=10) as http, \
            http.stream("POST", server.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500,
                "stream": True}) as s1:
        lines = s1.iter_lines()
        next(lines)
        whole: list[httpx.Response] = []
        t = threading.Thread(target=lambda: whole.append(http.post(server.url + "/v1/completions", json=LONG)))
        t.start()
        wait_for(lambda: server.async_engine.engine.scheduler.num_running == 2, 10)
        t0 = time.monotonic()
        executor.kill()
        events = _events(lines)
        t.join(10)
        assert time.monotonic() - t0 < 5
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
    assert events[-2]["error"]["type"] == "engine_dead"
    _error(whole[0], 503)
    assert _error(httpx.get(server.url + "/health"), 503)["type"] == "engine_dead"
    t0 = time.monotonic()
    _error(httpx.post(server.url + "/v1/completions", json=LONG, timeout=10), 503)
    assert time.monotonic() - t0 < 2
    assert server.async_engine.num_open_requests == 0


def test_request_timeout_aborts_and_frees(tokenizer):
    server = start_server(fake_engine(tokenizer, step_delay=0.01, max_num_seqs=1), request_timeout=0.5)
    try:
        with httpx.Client(timeout=10) as http, \
                http.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as s:
            t0 = time.monotonic()
            # Queued behind the stream (one seat): it times out while waiting, never having run.
            r = http.post(server.url + "/v1/completions", json=LONG)
            assert _error(r, 504)["type"] == "timeout"
            events = _events(s.iter_lines())
            assert time.monotonic() - t0 < 3
        assert events[-2]["error"]["code"] == 504 and events[-1] == "[DONE]"
        _wait_idle(server)
        text = httpx.get(server.url + "/metrics").text
        assert metric(text, "iterserve:request_success_total", finished_reason="abort") == 2
        r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 3})
        assert r.status_code == 200
    finally:
        server.stop()


def test_waiting_queue_is_bounded_by_default(tokenizer):
    assert AsyncEngine(fake_engine(tokenizer)).max_waiting_requests == SchedulerConfig().max_waiting_requests


def test_engine_death_between_check_and_submit_does_not_hang(tokenizer):
    """A request that arrives as the loop dies gets EngineDeadError, not a future no one resolves."""
    async_engine = AsyncEngine(fake_engine(tokenizer))
    async_engine._thread = threading.current_thread()  # a loop that never drains: start() is a no-op
    submit = async_engine._submit

    def submit_then_die(command) -> None:
        submit(command)
        async_engine.dead = RuntimeError("the loop died just now")
    async_engine._submit = submit_then_die
    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(async_engine.add_request("hi", SamplingParams(max_tokens=2)), 5))


async def _num_tasks() -> int:
    return len(asyncio.all_tasks())


def _count_tasks(server) -> int:
    """asyncio tasks alive on the server's event loop (counted on that loop)."""
    return asyncio.run_coroutine_threadsafe(_num_tasks(), server.async_engine._loop).result(5)


def test_abort_storm_leaks_nothing(tokenizer):
    """64 clients, each dropping its connection at a random point (before the first byte, mid-stream,
    while waiting for a whole answer, with n = 2): no KV block, request, task or thread is left."""
    server = start_server(fake_engine(tokenizer, step_delay=0.002, max_num_seqs=16, num_kv_blocks=256))
    rng = random.Random(0)
    try:
        assert httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 2}).status_code == 200
        threads, tasks = threading.active_count(), _count_tasks(server)

        async def client(i: int, http: httpx.AsyncClient) -> None:
            body = {**LONG, "max_tokens": rng.choice([5, 50, 400]), "n": rng.choice([1, 1, 2]),
                    "stream": rng.random() < 0.7}
            cut = rng.choice([0.0, 0.01, 0.05, 0.2])
            try:
                async with asyncio.timeout(cut if not body["stream"] else 5):
                    async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                        async for n, _ in _aenumerate(r.aiter_lines()):
                            if body["stream"] and n >= rng.randrange(1, 40):
                                return  # leaving the block closes the connection mid-stream
            except TimeoutError:
                pass

        async def storm():
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=10, limits=limits) as http:
                await asyncio.gather(*(client(i, http) for i in range(64)))

        asyncio.run(storm())
        _wait_idle(server)
        wait_for(lambda: _count_tasks(server) <= tasks, 10, "server tasks were left behind")
        wait_for(lambda: threading.active_count() <= threads, 10, "threads were left behind")
        r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 3, "n": 3})
        assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    finally:
        server.stop()


async def _aenumerate(it):
    n = 0
    async for x in it:
        yield n, x
        n += 1


def test_cors_is_off_by_default_and_on_when_asked(fake_server, tokenizer):
    r = httpx.options(fake_server.url + "/v1/models", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in r.headers
    server = start_server(fake_engine(tokenizer), api_key="k", allowed_origins=["http://ok.example"])
    try:
        ok = httpx.options(server.url + "/v1/models", headers={
            "Origin": "http://ok.example", "Access-Control-Request-Method": "GET"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ok.example"
        bad = httpx.options(server.url + "/v1/models", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "GET"})
        assert "access-control-allow-origin" not in bad.headers
    finally:
        server.stop()


def test_serve_binds_loopback_by_default():
    from iterserve.server.cli import build_parser
    args = build_parser().parse_args([])
    assert args.host == "127.0.0.1" and args.allowed_origins is None and args.request_timeout is None


def route_paths(routes) -> list[str]:
    """Every route's path, those of included routers too (FastAPI keeps an included router as one entry)."""
    out = []
    for route in routes:
        inner = getattr(route, "original_router", None)
        out += route_paths(inner.routes) if inner is not None else [route.path]
    return out


def test_no_route_serves_files(fake_server):
    """The whole surface: nothing takes a file name (no static directory, no model loading by URL; the
    dashboard is two fixed files read from the package; /v1/models/{id} takes a model name, which may
    hold a slash as Hugging Face ids do, and only compares it with the served name)."""
    app = fake_server.uvicorn_server.config.app
    paths = set(route_paths(app.routes))
    assert paths == {"/v1/embeddings", "/health", "/version", "/v1/models", "/v1/models/{model_id:path}", "/metrics",
                     "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                     "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
                     "/dashboard", "/dashboard.js", "/v1/dashboard", "/v1/diagnostics",
                     "/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
                     "/v1/messages", "/v1/messages/count_tokens"}
    assert httpx.get(fake_server.url + "/../../etc/passwd").status_code == 404
    assert httpx.get(fake_server.url + "/v1/models/../../etc/passwd").status_code == 404


def test_an_engine_built_by_a_factory_is_built_and_stepped_on_the_engine_thread(tokenizer):
    threads = []

    def build():
        threads.append(threading.current_thread())
        return fake_engine(tokenizer)

    async_engine = AsyncEngine(build)
    try:
        assert threads == [async_engine._thread] and threads[0] is not threading.current_thread()

        async def one():
            return [o async for o in async_engine.generate("hi", SamplingParams(max_tokens=3))]
        outs = asyncio.run(asyncio.wait_for(one(), 30))
        assert outs[-1].finished and len(outs[-1].token_ids) == 3
    finally:
        async_engine.shutdown()


def test_a_factory_that_fails_raises_in_the_caller():
    def build():
        raise ValueError("no such model file")
    with pytest.raises(ValueError, match="no such model file"):
        AsyncEngine(build)


def test_the_heap_is_trimmed_once_per_busy_spell(tokenizer, monkeypatch):
    """The freed step activations go back to the OS as the engine goes idle, not on every idle wake."""
    from iterserve.server import async_engine as module
    calls = []
    monkeypatch.setattr(module, "trim_heap", lambda: calls.append(time.monotonic()))
    engine = AsyncEngine(fake_engine(tokenizer))
    try:
        async def spell():
            return [o async for o in engine.generate("hi", SamplingParams(max_tokens=3))]
        for expected in (1, 2):
            outs = asyncio.run(asyncio.wait_for(spell(), 30))
            assert outs[-1].finished
            deadline = time.monotonic() + 10
            while len(calls) < expected and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(calls) == expected
        engine._wake.set()  # an idle wake with nothing done: no trim
        time.sleep(0.2)
        assert len(calls) == 2
    finally:
        engine.shutdown()
    module.trim_heap()  # the real one runs here (glibc), or is a no-op
