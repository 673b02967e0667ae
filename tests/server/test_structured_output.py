"""Structured output with xgrammar on the real default model, through the official openai client."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field, create_model

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from tests.server.conftest import MODEL, start_server

pytestmark = pytest.mark.slow  # a real-model server; every test generates

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


class City(BaseModel):
    name: str
    country: str
    population: int


def test_the_issue_44_city_parses_greedy_in_96_tokens(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                                      response_format=City, max_tokens=96, temperature=0)
    assert isinstance(r.choices[0].message.parsed, City) and r.choices[0].finish_reason == "stop"


class Size(BaseModel):
    width: float
    height: float


class Part(BaseModel):
    label: str
    count: int


# 20 schemas from unbounded pieces (no maxLength, no maxItems): the grammar's number bounds and the
# steering near max_tokens are what make each end parsed.
_FIELDS = {
    "title": (str, ...), "year": (int, ...), "price": (float, ...), "kind": (Literal["book", "film", "song"], ...),
    "tags": (list[str], ...), "grid": (list[list[int]], ...), "size": (Size, ...), "parts": (list[Part], ...),
    "rating": (float, Field(ge=0, le=5)), "ok": (bool, ...),
}


def _schemas() -> list[type[BaseModel]]:
    names = list(_FIELDS)
    return [create_model(f"Thing{i}", **{n: _FIELDS[n] for n in (names[i % 10], names[(i * 3 + 1) % 10],
                                                                  names[(i * 7 + 4) % 10])})
            for i in range(20)]


def test_20_mixed_schemas_greedy_and_sampled_all_parse(client):
    def ask(i_model):
        i, model = i_model
        sampled = dict(temperature=0.9, seed=i) if i % 2 else dict(temperature=0)
        return model, client.chat.completions.parse(
            model=MODEL, response_format=model, max_tokens=64 + 8 * (i % 4), **sampled,
            messages=[{"role": "user", "content": f"Describe thing {i} as JSON, with long lists."}])
    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(ask, enumerate(_schemas())))
    for model, r in replies:
        assert isinstance(r.choices[0].message.parsed, model), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"


def test_maximum_and_max_items_are_never_exceeded(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["count", "share", "fruits"],
              "properties": {"count": {"type": "integer", "maximum": 100},
                             "share": {"type": "number", "maximum": 100},
                             "fruits": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": schema, "strict": True}}
    for i in range(6):
        r = client.chat.completions.create(
            model=MODEL, response_format=fmt, max_tokens=80, temperature=1.0 if i else 0, seed=i,
            messages=[{"role": "user", "content": "How many people live in Tokyo? List ten fruits too."}])
        obj = json.loads(r.choices[0].message.content)
        assert obj["count"] <= 100 and obj["share"] <= 100 and len(obj["fruits"]) <= 3, obj


def test_json_object_and_tool_arguments_end_parsed_near_max_tokens(client):
    for max_tokens in (24, 48):
        r = client.chat.completions.create(model=MODEL, max_tokens=max_tokens, temperature=0,
                                           response_format={"type": "json_object"},
                                           messages=[{"role": "user", "content": "A long JSON list of cities."}])
        assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    tool = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "required": ["text", "scores"], "additionalProperties": False,
        "properties": {"text": {"type": "string"}, "scores": {"type": "array", "items": {"type": "number"}}}}}}
    r = client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, tools=[tool], tool_choice="required",
                                       messages=[{"role": "user", "content": "Write a very long note about Rome."}])
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    assert {"text", "scores"} <= set(json.loads(r.choices[0].message.tool_calls[0].function.arguments))
