"""The HTTP API end to end on a deterministic fake model (real tokenizer): fast, no weights."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import openai
import pytest

from iterserve.llm import apply_chat_template
from iterserve.sampling_params import SamplingParams
from tests.server.conftest import MODEL, fake_engine, metric, start_server, wait_for

CHAT = [{"role": "user", "content": "Tell me about cats."}]


def reference(tokenizer, prompt, max_tokens: int) -> str:
    """What the same fake model generates offline, one request alone."""
    engine = fake_engine(tokenizer)
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    while True:
        for out in engine.step():
            if out.finished:
                return out.text


@pytest.fixture(scope="module")
def client(fake_server):
    return openai.OpenAI(base_url=fake_server.base_url, api_key="unused", max_retries=0)


def test_completion(client, fake_server, tokenizer):
    prompt = "Once upon a time"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == reference(tokenizer, prompt, 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_chat(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10)
    prompt_ids = apply_chat_template(tokenizer, CHAT)
    assert r.choices[0].message.content == reference(tokenizer, prompt_ids, 10)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 10

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_max_completion_tokens_and_stop_token_ids(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3
    engine = fake_engine(tokenizer)
    engine.add_request("a b", SamplingParams(max_tokens=8))
    while not (outs := [o for o in engine.step() if o.finished]):
        pass
    ids = outs[0].token_ids
    r = client.completions.create(model=MODEL, prompt="a b", max_tokens=8, extra_body={"stop_token_ids": [ids[2]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ids.index(ids[2]) + 1


def test_32_concurrent_streaming_chats_are_batched(fake_server, tokenizer):
    convs = [[{"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}] for i in range(32)]
    expected = [reference(tokenizer, apply_chat_template(tokenizer, c), 24) for c in convs]
    before = httpx.get(fake_server.url + "/metrics").text

    async def one(client, conv):
        stream = await client.chat.completions.create(model=MODEL, messages=conv, max_tokens=24, stream=True,
                                                      stream_options={"include_usage": True})
        text, usage, reason = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                reason = c.choices[0].finish_reason or reason
            usage = c.usage or usage
        return text, usage, reason

    async def run_all():
        async with openai.AsyncOpenAI(base_url=fake_server.base_url, api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, c) for c in convs))

    results = asyncio.run(run_all())
    for (text, usage, reason), want in zip(results, expected):
        assert text == want and reason == "length" and usage.completion_tokens == 24
    after = httpx.get(fake_server.url + "/metrics").text
    # Batched: some step computed more than one request (steps of batch size <= 1 are not all of them).
    steps = metric(after, "iterserve:batch_size_count") - metric(before, "iterserve:batch_size_count")
    single = metric(after, "iterserve:batch_size_bucket", le="1.0") - metric(before, "iterserve:batch_size_bucket", le="1.0")
    assert steps > 0 and single < steps
    big = metric(after, "iterserve:batch_size_bucket", le="16.0") - metric(before, "iterserve:batch_size_bucket", le="16.0")
    assert big < steps  # some step ran more than 16 requests at once
    gen = metric(after, "iterserve:generation_tokens_total") - metric(before, "iterserve:generation_tokens_total")
    assert gen == 32 * 24


def _aborted(server) -> float:
    return metric(httpx.get(server.url + "/metrics").text, "iterserve:request_success_total", finished_reason="abort")


def _idle(server) -> bool:
    s = server.async_engine.engine.scheduler
    text = httpx.get(server.url + "/metrics").text
    return s.num_running == 0 and s.num_waiting == 0 and metric(text, "iterserve:kv_cache_usage_perc") == 0.0


def test_client_disconnect_mid_stream_aborts(fake_server):
    aborted = _aborted(fake_server)
    body = {"model": MODEL, "prompt": "Tell a very long story", "max_tokens": 1500, "stream": True}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", fake_server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert fake_server.async_engine.engine.scheduler.kv_usage > 0
    wait_for(lambda: _aborted(fake_server) == aborted + 1, 10, "the request was not counted as aborted")
    wait_for(lambda: _idle(fake_server), 10, "KV blocks were not freed")


def test_client_disconnect_while_waiting_for_a_whole_answer_aborts(fake_server):
    aborted = _aborted(fake_server)
    body = {"model": MODEL, "prompt": "Tell a very long story", "max_tokens": 1500}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_server.url + "/v1/completions", json=body, timeout=0.3)
    wait_for(lambda: _aborted(fake_server) == aborted + 1, 10, "the request was not counted as aborted")
    wait_for(lambda: _idle(fake_server), 10, "KV blocks were not freed")


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "temperature": -1}, None),
    ({"prompt": "hi", "top_p": 0}, None),
    ({"prompt": "hi", "max_tokens": 0}, None),
    ({"prompt": "hi", "max_tokens": "lots"}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, None),
    ({"prompt": "hi", "n": 65}, None),
    ({"prompt": "hi", "logprobs": 99}, None),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": ""}, None),
    ({"prompt": [10**9]}, None),
    ({"prompt": "word " * 3000}, None),  # longer than the 2048-token context
])
def test_invalid_completion_requests_are_400(fake_server, body, param):
    err = _error(httpx.post(fake_server.url + "/v1/completions", json={"model": MODEL, **body}), 400)
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


def test_other_errors_and_server_keeps_serving(fake_server):
    url = fake_server.url
    _error(httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), 400)
    _error(httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
    _error(httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert _error(httpx.post(url + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404)["param"] == "model"
    _error(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x" * (70 << 10)}), 413)
    _error(httpx.get(url + "/v1/nothing-here"), 404)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "still here?", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_info_routes(fake_server):
    url = fake_server.url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json()["version"]
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    text = httpx.get(url + "/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "batch_size", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "request_success_total"):
        assert f"iterserve:{name}" in text, name


def _thread_cpu_ticks(thread: threading.Thread) -> int:
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_idle_engine_thread_uses_no_cpu_and_wakes_at_once(fake_server):
    wait_for(lambda: _idle(fake_server), 10)
    thread = fake_server.async_engine._thread
    before = _thread_cpu_ticks(thread)
    time.sleep(0.5)
    assert _thread_cpu_ticks(thread) == before
    t0 = time.monotonic()
    r = httpx.post(fake_server.url + "/v1/completions", json={"model": MODEL, "prompt": "wake", "max_tokens": 1})
    assert r.status_code == 200 and time.monotonic() - t0 < 2.0


def test_api_key(tokenizer):
    server = start_server(fake_engine(tokenizer), api_key="s3cret")
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert _error(httpx.post(server.url + "/v1/completions", json=body), 401)["type"] == "authentication_error"
        _error(httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        _error(httpx.get(server.url + "/v1/models"), 401)
        client = openai.OpenAI(base_url=server.base_url, api_key="s3cret", max_retries=0)
        assert client.completions.create(**body).usage.completion_tokens == 2
        assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    finally:
        server.stop()


def test_queue_full_is_503_with_retry_after(tokenizer):
    server = start_server(fake_engine(tokenizer, step_delay=0.02, max_num_seqs=1), max_waiting_requests=1)
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 400, "stream": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body) as first:
            first_lines = first.iter_lines()  # keep it: a dropped iterator closes the connection
            next(first_lines)  # running
            with http.stream("POST", server.url + "/v1/completions", json=body) as second:
                wait_for(lambda: server.async_engine.engine.scheduler.num_waiting == 1, 10)
                r = http.post(server.url + "/v1/completions", json={**body, "stream": False})
                _error(r, 503)
                assert r.headers["retry-after"]
                assert second.status_code == 200
        wait_for(lambda: _idle(server), 10)
        r = httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert r.status_code == 200
    finally:
        server.stop()


def test_engine_death_fails_streams_and_health(tokenizer):
    server = start_server(fake_engine(tokenizer, step_delay=0.01))
    try:
        engine = server.async_engine.engine
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1000, "stream": True}
        with httpx.Client(timeout=10) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)

            def broken_step():
                raise RuntimeError("scheduler bug")
            engine.step = broken_step  # an exception escaping step() kills the loop
            rest = [line for line in lines if line.startswith("data: ")]
        assert json.loads(rest[-2][6:])["error"]["code"] == 503 and rest[-1] == "data: [DONE]"
        assert httpx.get(server.url + "/health").status_code == 503
        _error(httpx.post(server.url + "/v1/completions", json={**body, "stream": False}), 503)
    finally:
        server.stop()


def test_chat_cli_against_a_server(fake_server, monkeypatch, capsys):
    from iterserve.server import chat_cli
    inputs = iter(["hello there", "/reset", "again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(inputs))
    assert chat_cli.main(["--url", fake_server.url, "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 2 and any(w in out for w in ("cat", "sat", "mat", "the", "ran"))
