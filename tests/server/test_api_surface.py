"""The OpenAI API surface clients rely on, on the fake model: what is honoured and what gets a 400."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("route,body,field", [
    ("completions", {"prompt": "hi", "response_format": {"type": "nonsense"}}, "response_format"),
    ("completions", {"prompt": "hi", "no_such_field": 1}, "no_such_field"),
    ("chat/completions", {"messages": CHAT, "parallel_tool_calls": True}, "parallel_tool_calls"),
    ("chat/completions", {"messages": CHAT, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "refusal": "y"}]}, "messages.0.refusal"),
])
def test_a_field_that_is_not_implemented_is_a_400_naming_it(fake_server, route, body, field):
    r = httpx.post(f"{fake_server.url}/v1/{route}", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and "not supported" in err["message"]


@pytest.mark.parametrize("body,word", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {str(10**9): 1}}, "logit_bias"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
])
def test_bad_sampling_controls_are_400(fake_server, body, word):
    r = httpx.post(f"{fake_server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", **body})
    assert r.status_code == 400 and word in r.json()["error"]["message"], r.text


def test_min_tokens_holds_back_stop_strings_and_include_stop_str(fake_server):
    url = f"{fake_server.url}/v1/completions"
    base = {"model": MODEL, "prompt": "a b", "max_tokens": 12, "temperature": 0}
    text = httpx.post(url, json=base).json()["choices"][0]["text"]
    stop = text.split()[1]
    cut = httpx.post(url, json={**base, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[:text.index(stop)]
    kept = httpx.post(url, json={**base, "stop": [stop], "include_stop_str_in_output": True}).json()["choices"][0]
    assert kept["text"] == text[:text.index(stop) + len(stop)]
    late = httpx.post(url, json={**base, "stop": [stop], "min_tokens": 12}).json()["choices"][0]
    assert late["finish_reason"] == "length" and late["text"] == text
