"""The HTTP API on the real default model (SmolLM2-135M), driven by the official openai client."""
from __future__ import annotations

import httpx
import openai
import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.llm import apply_chat_template
from tests.server.conftest import MODEL, start_server

CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def real_server(default_model_path):
    engine = Engine(EngineConfig(model=default_model_path, num_kv_blocks=512, max_num_seqs=16))
    server = start_server(engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
def test_completion_greedy_streamed_equals_whole(client, tokenizer):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text.strip()
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_chat_streamed_and_whole(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert r.usage.prompt_tokens == len(apply_chat_template(tokenizer, CHAT))
    assert 1 <= r.usage.completion_tokens <= 10
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in r.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_string(client):
    prompt = "One, two, three, four, five,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[stop], stream=True))
    assert streamed == r.choices[0].text


def test_seeded_sampling_repeats(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b


def test_prompt_longer_than_context_is_400(real_server):
    max_len = real_server.async_engine.engine.scheduler.max_model_len
    r = httpx.post(real_server.url + "/v1/completions", json={"model": MODEL, "prompt": list(range(1, max_len + 5))})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


@pytest.mark.slow
def test_penalties_bias_and_min_tokens_steer_the_real_model(client, tokenizer):
    prompt = "One, two, one, two, one, two,"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True})
    ids = tokenizer.encode(plain.choices[0].text, add_special_tokens=False)
    repeated = client.completions.create(**kw, extra_body={"ignore_eos": True, "repetition_penalty": 1.8})
    assert repeated.choices[0].text != plain.choices[0].text
    fresh = client.completions.create(**kw, presence_penalty=2.0, frequency_penalty=2.0, extra_body={"ignore_eos": True})
    fresh_ids = tokenizer.encode(fresh.choices[0].text, add_special_tokens=False)
    assert len(set(fresh_ids)) > len(set(ids))  # penalised: more distinct tokens than the loop
    forced = tokenizer.encode(" cat", add_special_tokens=False)[0]
    r = client.completions.create(**kw, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert tokenizer.encode(r.choices[0].text, add_special_tokens=False) == [forced] * 12
    # a greedy chat answer that ends early runs on to min_tokens
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=40, temperature=0)
    short = client.chat.completions.create(**chat)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    longer = client.chat.completions.create(**chat, extra_body={"min_tokens": 20})
    assert longer.usage.completion_tokens >= 20


def test_echo_scores_the_prompt_as_lm_eval_asks(client, tokenizer):
    """lm-eval's loglikelihood request: token-id prompts in a batch, echo, logprobs 1, max_tokens 0/1."""
    contexts = ["The capital of France is", "Two plus two is"]
    prompts = [tokenizer.encode(c + " Paris") for c in contexts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 0
    for c, ids, ctx in zip(r.choices, prompts, contexts):
        lp = c.logprobs
        assert c.text == tokenizer.decode(ids) and len(lp.tokens) == len(ids)
        assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
        assert all(1 <= len(top) <= 2 and max(top.values()) >= v - 1e-5
                   for top, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    one = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert one.choices[0].logprobs.token_logprobs[:-1] == r.choices[0].logprobs.token_logprobs
    assert len(one.choices[0].logprobs.tokens) == len(prompts[0]) + 1
