"""n > 1 (parallel sampling), priority and cache_salt through both OpenAI endpoints."""
from __future__ import annotations

import httpx
import openai
import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.llm import apply_chat_template
from iterserve.sampling_params import SamplingParams
from tests.server.conftest import MODEL, metric, no_leaks, start_server, wait_for

CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(fake_server):
    return openai.OpenAI(base_url=fake_server.base_url, api_key="unused", max_retries=0)


def test_completion_n3_whole_and_streamed(client, fake_server, tokenizer):
    prompt = "Once upon a time"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, n=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.text for c in r.choices)
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))  # the prompt once
    assert r.usage.completion_tokens == 21 and r.usage.total_tokens == r.usage.prompt_tokens + 21

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, n=3, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts, reasons = {}, {}
    for c in chunks[:-1]:
        (choice,) = c.choices  # one choice per chunk, tagged with its index
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert texts == {c.index: c.text for c in r.choices} and set(reasons.values()) == {"length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
    wait_for(lambda: no_leaks(fake_server), 10)


def test_chat_n3_whole_and_streamed(client, fake_server, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, n=3,
                                       extra_body={"priority": 2, "cache_salt": "tenant-a"})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(apply_chat_template(tokenizer, CHAT)) and r.usage.completion_tokens == 15

    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, n=3, stream=True,
                                            stream_options={"include_usage": True})
    texts, roles, finished = {}, {}, {}
    for c in stream:
        for choice in c.choices:
            roles[choice.index] = choice.delta.role or roles.get(choice.index)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finished[choice.index] = choice.finish_reason or finished.get(choice.index)
        usage = c.usage
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert texts == {c.index: c.message.content for c in r.choices}
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 15
    wait_for(lambda: no_leaks(fake_server), 10)


def test_n_errors(fake_server):
    for n in (0, 65, 2.5, None):
        r = httpx.post(fake_server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": n})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text


def test_cache_salt_separates_prefix_cache_hits(fake_server):
    url = fake_server.url
    prompt = "shared system prompt " * 20  # several full blocks

    def hits() -> float:
        return metric(httpx.get(url + "/metrics").text, "iterserve:prefix_cache_hits_total")

    def ask(salt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": salt}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 200

    ask("a")
    h0 = hits()
    ask("a")
    assert hits() > h0  # same salt: the prompt's blocks are reused
    h1 = hits()
    ask("b")
    assert hits() == h1  # another tenant's salt: no hit
    assert metric(httpx.get(url + "/metrics").text, "iterserve:prefix_cache_queries_total") > 0


@pytest.fixture(scope="module")
def real_client(default_model_path):
    engine = Engine(EngineConfig(model=default_model_path, num_kv_blocks=256, max_num_seqs=8, max_model_len=512))
    server = start_server(engine)
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    server.stop()


@pytest.mark.slow
def test_seeded_n_gives_distinct_reproducible_choices_on_the_real_model(real_client):
    kwargs = dict(model=MODEL, prompt="My favourite animal is the", max_tokens=6, n=3, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    a = real_client.completions.create(**kwargs)
    b = real_client.completions.create(**kwargs)
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]  # reproducible
    assert len(set(texts)) == 3  # distinct: each choice draws from its own seed
    chunks = real_client.completions.create(**kwargs, stream=True)
    streamed = {}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[k] for k in range(3)] == texts
    chat = real_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=3, seed=7,
                                               temperature=1.0)
    assert [c.index for c in chat.choices] == [0, 1, 2] and 3 <= chat.usage.completion_tokens <= 18


@pytest.mark.slow
def test_llm_generate_and_chat_return_n_outputs_per_prompt(default_model_path):
    """Regression: LLM.generate with n=2 raised KeyError and left requests in the engine."""
    from iterserve.llm import LLM
    llm = LLM(default_model_path, num_kv_blocks=128, max_num_seqs=8)
    params = SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=3, ignore_eos=True)
    outs = llm.generate(["The sky is", "My name is", "One, two,"], params)
    assert [(o.parent_id is not None, o.index) for o in outs] == [(True, 0), (True, 1)] * 3
    assert len({o.parent_id for o in outs}) == 3 and all(len(o.token_ids) == 5 for o in outs)
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids != outs[2].prompt_token_ids
    assert outs[0].token_ids != outs[1].token_ids  # siblings draw from their own seeds
    chat = llm.chat([{"role": "user", "content": "Hi"}], params)
    assert [o.index for o in chat] == [0, 1]
    mixed = llm.generate(["a", "b"], [SamplingParams(max_tokens=2), params])
    assert [o.index for o in mixed] == [0, 0, 1]
    assert not llm.engine.has_unfinished() and not llm.engine.states and not llm.engine.parents
