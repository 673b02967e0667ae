"""Structured output with xgrammar on the real default model, through the official openai client."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from tests.server.conftest import MODEL, start_server

pytest.importorskip("xgrammar")


class Owner(BaseModel):
    name: str = Field(max_length=16)
    city: str = Field(max_length=16)


class Pet(BaseModel):
    name: str = Field(max_length=16)
    kind: Literal["cat", "dog", "bird", "fish"]
    age: int = Field(ge=0, le=30)
    toys: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)
    owner: Owner


@pytest.fixture(scope="module")
def real_server(default_model_path):
    server = start_server(Engine(EngineConfig(model=default_model_path, num_kv_blocks=1024, max_num_seqs=32)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.base_url, api_key="unused", max_retries=0, timeout=600)


def test_parse_returns_a_valid_object_for_20_prompts(client):
    animals = ["cat", "dog", "parrot", "goldfish", "kitten"]
    def ask(i: int):
        return client.chat.completions.parse(
            model=MODEL, response_format=Pet, max_tokens=200, temperature=0.7, seed=i,
            messages=[{"role": "user", "content": f"Invent pet number {i}, a {animals[i % 5]}, as JSON."}])
    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(ask, range(20)))
    for r in replies:
        pet = r.choices[0].message.parsed
        assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert pet.kind in ("cat", "dog", "bird", "fish") and len(pet.toys) <= 3 and 0 <= pet.age <= 30


def test_constrained_and_free_requests_share_a_batch_of_32(client, real_server):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "reasons": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                           "maxItems": 2}},
              "required": ["answer", "reasons"], "additionalProperties": False}

    def ask(i: int):
        kw = dict(model=MODEL, max_tokens=60, temperature=0.8, seed=i,
                  messages=[{"role": "user", "content": f"Is {i} an even number? Explain."}])
        if i % 2:
            return None, client.chat.completions.create(**kw)
        return schema, client.chat.completions.create(
            **kw, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})

    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(ask, range(32)))
    free = []
    for constrained, r in replies:
        text = r.choices[0].message.content
        if constrained:
            obj = json.loads(text)
            assert obj["answer"] in ("yes", "no") and len(obj["reasons"]) <= 2 and set(obj) == {"answer", "reasons"}
        else:
            free.append(text)
    assert sum(not t.lstrip().startswith("{") for t in free) >= 12  # the free rows were not masked


def test_vllm_fields_choice_regex_grammar_and_json_object(client):
    msg = [{"role": "user", "content": "Pick one."}]
    r = client.chat.completions.create(model=MODEL, messages=msg, max_tokens=10,
                                       extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].message.content in ("left", "right")
    r = client.completions.create(model=MODEL, prompt="The year is", max_tokens=10,
                                  extra_body={"structured_outputs": {"regex": r" (19|20)\d\d"}})
    assert r.choices[0].text.strip().isdigit() and len(r.choices[0].text) == 5
    r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=10,
                                  extra_body={"guided_grammar": 'root ::= " " ("yes" | "no") "."'})
    assert r.choices[0].text in (" yes.", " no.")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A tiny JSON object, please."}],
                                       max_tokens=80, response_format={"type": "json_object"},
                                       extra_body={"presence_penalty": 1.0})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "nonsense"}},
    {"response_format": {"type": "json_schema"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
    {"guided_regex": "(unclosed"},
    {"guided_grammar": "root ::= "},
    {"guided_choice": []},
    {"guided_json": "{not json"},
    {"guided_regex": "a", "guided_choice": ["a"]},
])
def test_bad_constraints_are_400(real_server, body):
    r = httpx.post(real_server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
