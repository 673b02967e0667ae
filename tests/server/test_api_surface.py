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
