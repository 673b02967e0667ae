"""Anthropic's POST /v1/messages and /v1/messages/count_tokens: content blocks onto chat messages, errors in
Anthropic's shape, stop sequences and the streamed events on the fake model; then the official anthropic
client against the real default model (plain, streamed, a tool_use / tool_result round trip, count_tokens,
an unknown field)."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.server.messages import Message
from tests.server.conftest import MODEL, start_server

HELLO = [{"role": "user", "content": "Hello"}]
GREEDY = {"temperature": 0}  # sampling controls: the anthropic client sends them only in extra_body
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 20}}}}


def test_content_blocks_become_chat_messages():
    call = Message.model_validate({"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": ""}, {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}}]})
    assert call.chat_messages() == [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}]
    result = Message.model_validate({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
        {"type": "tool_result", "tool_use_id": "t2", "content": "no such city", "is_error": True},
        {"type": "text", "text": "And tomorrow?"}]})
    assert result.chat_messages() == [{"role": "tool", "tool_call_id": "t1", "content": "sunny"},
                                      {"role": "tool", "tool_call_id": "t2", "content": "Error: no such city"},
                                      {"role": "user", "content": "And tomorrow?"}]


def _post(server, body: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=30)


@pytest.mark.parametrize("body,words", [
    ({"messages": HELLO, "max_tokens": 5, "thinking": {"type": "enabled"}}, ["thinking", "not supported"]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "bogus": 1}]}], "max_tokens": 5},
     ["messages.0.content", "bogus"]),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5}, ["image"]),
    ({"messages": HELLO}, ["max_tokens"]),
    ({"messages": HELLO, "max_tokens": 5, "tools": [{"name": "web_search", "type": "web_search_20250305"}]},
     ["tools.0"]),
    ({"messages": HELLO, "max_tokens": 5, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
     ["nope"]),
    ({"messages": HELLO, "max_tokens": 10**9}, ["max_tokens"]),
])
def test_errors_are_400_in_anthropics_shape(fake_server, body, words):
    r = _post(fake_server, body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert all(w in r.json()["error"]["message"] for w in words), r.text


def test_unknown_model_is_404_and_count_tokens_matches_tokenize(fake_server):
    r = httpx.post(fake_server.url + "/v1/messages", json={"model": "claude", "messages": HELLO, "max_tokens": 5})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    counted = _post(fake_server, {"messages": HELLO, "system": "Be brief."}, "/v1/messages/count_tokens").json()
    tokenized = httpx.post(fake_server.url + "/tokenize", json={"messages": [
        {"role": "system", "content": "Be brief."}, *HELLO]}).json()
    assert counted == {"input_tokens": tokenized["count"]}
    assert _post(fake_server, {"messages": HELLO, "max_tokens": 2, "tool_choice": {"type": "auto"}}).status_code == 200


def test_stop_sequence_and_max_tokens(fake_server):
    whole = _post(fake_server, {"messages": HELLO, "max_tokens": 12, "temperature": 0}).json()
    assert whole["stop_reason"] == "max_tokens" and whole["usage"]["output_tokens"] == 12
    text = whole["content"][0]["text"]
    stop = text.split()[2]
    cut = _post(fake_server, {"messages": HELLO, "max_tokens": 12, "temperature": 0, "stop_sequences": [stop]}).json()
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
    assert cut["content"][0]["text"] == text[:text.index(stop)]


def test_streamed_events_in_order(fake_server):
    with httpx.stream("POST", fake_server.url + "/v1/messages", timeout=30,
                      json={"model": MODEL, "messages": HELLO, "max_tokens": 6, "stream": True}) as r:
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"] == {"output_tokens": 6}
    assert events[0]["message"]["usage"]["input_tokens"] > 0


@pytest.fixture(scope="module")
def client(default_model_path):
    server = start_server(Engine(EngineConfig(model=default_model_path, num_kv_blocks=512, max_num_seqs=16)))
    yield anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
    server.stop()


@pytest.mark.slow
def test_plain_streamed_and_count_tokens(client):
    m = client.messages.create(model=MODEL, max_tokens=60, system="You answer briefly.", extra_body=GREEDY,
                               messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert m.content[0].type == "text" and m.content[0].text.strip()
    assert (m.stop_reason, m.usage.output_tokens == 60) in (("end_turn", False), ("max_tokens", True))
    count = client.messages.count_tokens(model=MODEL, system="You answer briefly.",
                                         messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert count.input_tokens == m.usage.input_tokens
    with client.messages.stream(model=MODEL, max_tokens=60, messages=HELLO, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="top_n"):
        client.messages.create(model=MODEL, max_tokens=5, messages=HELLO, extra_body={"top_n": 3})


@pytest.mark.slow
def test_tool_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model=MODEL, max_tokens=80, messages=ask, tools=[WEATHER], extra_body=GREEDY,
                               tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city"}
    history = ask + [{"role": "assistant", "content": m.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": json.dumps({"temperature": 21, "sky": "sunny"})}]}]
    answer = client.messages.create(model=MODEL, max_tokens=60, messages=history, tools=[WEATHER], extra_body=GREEDY,
                                    tool_choice={"type": "none"})
    assert answer.content and answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(model=MODEL, max_tokens=80, messages=ask, tools=[WEATHER], extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert set(final.content[-1].input) == {"city"}


@pytest.mark.slow
def test_output_config_json_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 20}}}
    m = client.messages.create(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "A city in Japan?"}],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert set(json.loads(m.content[0].text)) == {"city"}
