"""Tool calling: the parsers and the prompt on their own, then a round trip with the openai client
against the real default model (streamed and not), tool_choice required and named."""
from __future__ import annotations

import copy
import json

import openai
import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.server import tools
from tests.server.conftest import MODEL, start_server

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"], "additionalProperties": False,
                                       "properties": {"zone": {"type": "string", "maxLength": 10}}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_parsers_hermes_qwen_and_smollm2_lists():
    hermes = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    content, calls = tools.parse_reply(hermes, TOOLS, "auto")
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    smol = '<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]</tool_call>'
    content, calls = tools.parse_reply(smol, TOOLS, "auto")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert len({c["id"] for c in calls}) == 2
    assert tools.parse_reply("No tools needed.", TOOLS, "auto") == ("No tools needed.", [])
    assert tools.parse_reply("<tool_call>not json</tool_call>", TOOLS, "auto")[1] == []
    assert len(tools.parse_reply(smol, TOOLS, "auto", parallel=False)[1]) == 1
    assert tools.forced_schema(TOOLS, "required", parallel=False)["maxItems"] == 1


def test_tools_reach_the_prompt_through_the_template(tokenizer):
    plain = tokenizer.decode(tools.render_prompt(tokenizer, ASK, TOOLS))
    assert "<tools>" in plain and '"get_weather"' in plain and "<tool_call>" in plain  # SmolLM2: no tools in its template
    hermes = copy.deepcopy(tokenizer)
    hermes.chat_template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
                            "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
                            "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    text = hermes.decode(tools.render_prompt(hermes, history, TOOLS))
    assert "TOOL get_weather" in text and 'CALL get_time {"zone": "UTC"}' in text and "tool: 12:00" in text


@pytest.fixture(scope="module")
def client(default_model_path):
    server = start_server(Engine(EngineConfig(model=default_model_path, num_kv_blocks=512, max_num_seqs=16)))
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
    server.stop()


def check_call(call) -> dict:
    args = json.loads(call.function.arguments)
    fn = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
    assert set(args) == set(fn["parameters"]["required"]), args
    if call.function.name == "get_weather":
        assert args["unit"] in ("celsius", "fahrenheit") and len(args["city"]) <= 20
    return args


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.slow
def test_round_trip_with_the_openai_client(client, stream):
    kw = dict(model=MODEL, tools=TOOLS, max_tokens=80, temperature=0, parallel_tool_calls=False)
    if stream:
        chunks = list(client.chat.completions.create(messages=ASK, tool_choice="required", stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [tc for d in deltas for tc in d.tool_calls or []]
        assert chunks[-1].choices[0].finish_reason == "tool_calls" and calls
        call_id, name, arguments = calls[0].id, calls[0].function.name, calls[0].function.arguments
    else:
        r = client.chat.completions.create(messages=ASK, tool_choice="required", **kw)
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        check_call(call)
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    answer = client.chat.completions.create(messages=history, tool_choice="none", **kw)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.slow
def test_required_and_named_always_match_the_schema(client):
    questions = ["Weather in Rome?", "What time is it in Tokyo?", "Is it raining in Oslo?", "Hello!"]
    for i, q in enumerate(questions):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], tools=TOOLS,
                                           tool_choice="required", max_tokens=120, temperature=0.8, seed=i,
                                           parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        for call in r.choices[0].message.tool_calls:
            check_call(call)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and check_call(call)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
    message = auto.choices[0].message
    assert message.content or message.tool_calls  # the model decides; either way the reply parses
    for call in message.tool_calls or []:
        assert call.function.name in ("get_weather", "get_time")
