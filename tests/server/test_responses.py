"""POST /v1/responses: the request's mapping onto chat messages, the streamed events, stored responses and
their errors on the fake model; then the openai client against the real default model (plain, streamed,
previous_response_id, a function-tool round trip, text.format json_schema, retrieve, an unknown field)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.server.responses_protocol import ResponsesRequest
from tests.server.conftest import MODEL, no_leaks, start_server, wait_for

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 20}}}}


def test_input_items_become_chat_messages():
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                     {"type": "input_text", "text": "Rome?"}]},
        {"type": "message", "role": "assistant", "content": "Let me look.", "id": "msg_1", "status": "completed"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    assert body.chat_messages() == [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert ResponsesRequest(input="hi").chat_messages() == [{"role": "user", "content": "hi"}]


def _post(server, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=30, **kw)


def _events(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/responses", json={"model": MODEL, "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    return events


def test_streamed_events_in_order(fake_server):
    events = _events(fake_server, {"input": "hi", "max_output_tokens": 6})
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == text and final["output"][0]["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"} and final["usage"]["output_tokens"] == 6
    item_id = events[2]["item"]["id"]
    assert {e.get("item_id", e.get("item", {}).get("id")) for e in events[2:-1]} == {item_id}
    assert _post(fake_server, {"input": "hi"}).json()["id"] != final["id"]
    assert _post(fake_server, {"previous_response_id": final["id"], "input": "more",
                                 "max_output_tokens": 2}).status_code == 200  # streamed: stored too


def test_stored_responses_continue_retrieve_and_delete(fake_server):
    url = fake_server.url + "/v1/responses"
    first = _post(fake_server, {"input": "hi", "max_output_tokens": 5, "instructions": "Be brief."}).json()
    assert first["status"] == "incomplete" and first["instructions"] == "Be brief." and first["store"]
    usage = first["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    second = _post(fake_server, {"input": "and?", "previous_response_id": first["id"], "max_output_tokens": 2}).json()
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens"] > usage["input_tokens"] + usage["output_tokens"]  # the whole turn, again
    assert httpx.get(f"{url}/{first['id']}").json() == first
    cancel = httpx.post(f"{url}/{first['id']}/cancel")
    assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
    assert httpx.delete(f"{url}/{first['id']}").json() == {"id": first["id"], "object": "response", "deleted": True}
    for r in (httpx.get(f"{url}/{first['id']}"), httpx.delete(f"{url}/{first['id']}"),
              _post(fake_server, {"input": "x", "previous_response_id": first["id"]})):
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    assert _post(fake_server, {"input": "hi", "max_output_tokens": 2, "tool_choice": "auto"}).status_code == 200
    unstored = _post(fake_server, {"input": "hi", "max_output_tokens": 2, "store": False}).json()
    assert httpx.get(f"{url}/{unstored['id']}").status_code == 404
    wait_for(lambda: no_leaks(fake_server), 10, "the server did not go idle")


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "background": True, "stream": True}, "stream"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": []}, None),
    ({"input": "hi", "tool_choice": "required"}, None),  # needs tools
])
def test_what_is_not_served_is_a_400_naming_it(fake_server, body, param):
    r = _post(fake_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and (param is None or param in (err["param"] or "")), err


@pytest.fixture(scope="module")
def client(default_model_path):
    server = start_server(Engine(EngineConfig(model=default_model_path, num_kv_blocks=512, max_num_seqs=16)))
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
    server.stop()


@pytest.mark.slow
def test_plain_streamed_and_continued(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France? Answer in one word.",
                                instructions="You answer briefly.", max_output_tokens=60, temperature=0)
    assert r.status == "completed" and r.output_text.strip() and r.usage.output_tokens > 0
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=60, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.status == "completed"
    raw = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=60, temperature=0,
                                       stream=True))
    assert raw[0].type == "response.created" and raw[-1].type == "response.completed"
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == raw[-1].response.output_text
    again = client.responses.create(model=MODEL, input="And of Italy?", previous_response_id=r.id,
                                    max_output_tokens=60, temperature=0)
    assert again.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens - 20  # the earlier turn is in
    assert client.responses.retrieve(again.id).output_text == again.output_text
    with pytest.raises(openai.BadRequestError, match="store_everything"):
        client.responses.create(model=MODEL, input="hi", extra_body={"store_everything": True})


@pytest.mark.slow
def test_function_tool_round_trip(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", max_output_tokens=80, temperature=0)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"} and r.status == "completed"
    answer = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": json.dumps({"temperature": 21, "sky": "sunny"})}],
                                     max_output_tokens=60, temperature=0)
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=80, temperature=0) as stream:
        args = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert json.loads(args) == json.loads(final.output[-1].arguments)


@pytest.mark.slow
def test_text_format_json_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "country": {"type": "string", "maxLength": 20}}}
    r = client.responses.create(model=MODEL, input="Name a city in Japan.", max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"city", "country"}


@pytest.mark.slow
def test_background_response_polled_to_completion(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France? Answer in one word.",
                                max_output_tokens=60, temperature=0, background=True)
    assert r.status == "queued" and r.background
    done = wait_for(lambda: (got := client.responses.retrieve(r.id)).status not in ("queued", "in_progress") and got,
                    120, "the background response did not finish")
    assert done.status == "completed" and "Paris" in done.output_text and done.usage.output_tokens > 0
    assert done.output[0].type == "message" and done.output[0].status == "completed"
