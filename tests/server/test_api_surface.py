"""The OpenAI API surface clients rely on, on the fake model: what is honoured and what gets a 400."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("route,body,field", [
    ("completions", {"prompt": "hi", "modalities": ["text"]}, "modalities"),
    ("completions", {"prompt": "hi", "no_such_field": 1}, "no_such_field"),
    ("chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
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


def test_a_list_of_prompts_is_one_request_each_with_choices_numbered_as_openai_does(fake_server, tokenizer):
    import openai
    client = openai.OpenAI(base_url=fake_server.base_url, api_key="unused", max_retries=0)
    prompts = ["a b", "the cat", "x y z"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
             for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for t in alone for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 30
    ids = [tokenizer.encode(p) for p in prompts]
    assert [c.text for c in client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0).choices] == alone
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {}
    for c in chunks[:-1]:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert [texts[i] for i in range(3)] == alone
    assert chunks[-1].usage.completion_tokens == 15


def test_max_tokens_beyond_the_context_is_a_400_naming_the_limit(fake_server):
    r = httpx.post(f"{fake_server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "2048" in r.json()["error"]["message"]
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2047})
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"]


def test_tokenize_detokenize_and_model_card(fake_server, tokenizer):
    import openai
    url = fake_server.url
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    chat = httpx.post(url + "/tokenize", json={"messages": CHAT}).json()
    from iterserve.llm import apply_chat_template
    assert chat["tokens"] == apply_chat_template(tokenizer, CHAT)
    assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    assert httpx.post(url + "/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert httpx.post(url + "/tokenize", json={}).status_code == 400
    client = openai.OpenAI(base_url=fake_server.base_url, api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_developer_role_is_the_system_role(fake_server, tokenizer):
    from iterserve.llm import apply_chat_template
    dev = [{"role": "developer", "content": "Be brief."}, *CHAT]
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", json={"model": MODEL, "messages": dev, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(apply_chat_template(tokenizer, [{**dev[0], "role": "system"}, *CHAT]))


def test_bearer_is_case_insensitive(tokenizer):
    from tests.server.conftest import fake_engine, start_server
    server = start_server(fake_engine(tokenizer), api_key="s3cret")
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"{scheme} s3cret"})
            assert r.status_code == 200, (scheme, r.text)
        assert httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    finally:
        server.stop()


def test_logprobs_keep_each_tokens_bytes_and_alternatives_never_collapse(tokenizer):
    from iterserve.server.token_text import TokenText
    text = TokenText(tokenizer)
    ids = tokenizer.encode("I love 🐱", add_special_tokens=False)
    assert b"".join(text.bytes(t) for t in ids) == "I love 🐱".encode()
    partial = [t for t in ids if text.str(t).startswith("bytes:")]
    assert partial and len({text.str(t) for t in partial}) == len(partial)  # distinct pieces, distinct strings
    assert len({text.str(t) for t in range(len(tokenizer))}) == len(tokenizer)  # every token its own entry
