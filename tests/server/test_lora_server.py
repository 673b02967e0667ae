"""LoRA adapters over HTTP with the official openai client: the model field picks one, /v1/models lists
them, /v1/load_lora_adapter and /v1/unload_lora_adapter change them while requests run, and bad input
is a 400 (or a 404 for a name that is not there)."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from tests.model.test_lora import hf_greedy, make_adapter
from tests.server.conftest import MODEL, leaks, no_leaks, start_server, wait_for

pytestmark = pytest.mark.slow  # a real model, transformers + PEFT and a server start

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """name -> (path, transformers + PEFT's model); 'big' has rank 16, above the server's --max-lora-rank 8."""
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    out = {"base": (None, hf)}
    for i, (name, r) in enumerate([("a0", 8), ("a1", 4), ("a2", 8), ("big", 16)]):
        path = str(root / name)
        out[name] = (path, make_adapter(hf, path, seed=i + 1, r=r, b_std=0.2))
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters):
    config = EngineConfig(model=tiny_model_dir, dtype="float32", device="cpu", num_kv_blocks=256, max_loras=3,
                          max_lora_rank=8, lora_modules=[f"a0={adapters['a0'][0]}"])
    s = start_server(Engine(config), runtime_lora_updating=True)
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def expected(tokenizer, adapters, name: str, prompt: list[int], n: int = NEW_TOKENS) -> str:
    return tokenizer.decode(hf_greedy(adapters[name][1], prompt, n), skip_special_tokens=True)


def complete(client, model: str, prompt: list[int]) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


PROMPT = [1, 504, 3458, 282, 4649, 314, 253]


def test_models_lists_adapters_with_their_parent(server, client, adapters):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == MODEL and "a0" in ids
    cards = {c["id"]: c for c in httpx.get(server.base_url + "/models").json()["data"]}
    assert cards["a0"]["parent"] == MODEL and cards["a0"]["root"] == adapters["a0"][0]
    assert cards[MODEL]["parent"] is None
    assert client.models.retrieve("a0").id == "a0"


def test_the_model_field_picks_the_adapter(client, adapters, tokenizer):
    assert complete(client, "a0", PROMPT) == expected(tokenizer, adapters, "a0", PROMPT)
    assert complete(client, MODEL, PROMPT) == expected(tokenizer, adapters, "base", PROMPT)
    chat = client.chat.completions.create(model="a0", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "a0"
    with pytest.raises(openai.NotFoundError):
        complete(client, "no-such-adapter", PROMPT)


def test_loading_while_requests_are_in_flight_loses_nothing(server, client, adapters, tokenizer):
    prompts = [PROMPT[:k] for k in range(3, 8)]
    models = ["a0", MODEL, "a0", MODEL, "a0"]
    long = 96  # long enough to be running when the load lands
    want = [expected(tokenizer, adapters, "a0" if m == "a0" else "base", p, long) for m, p in zip(models, prompts)]

    async def scenario():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        streams = [await aclient.completions.create(model=m, prompt=p, max_tokens=long, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True})
                   for m, p in zip(models, prompts)]
        iters = [s.__aiter__() for s in streams]
        texts = [(await it.__anext__()).choices[0].text for it in iters]  # every one has started
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(server.url + "/v1/load_lora_adapter",
                                json={"lora_name": "a1", "lora_path": adapters["a1"][0]})
        assert r.status_code == 200, r.text
        loaded = asyncio.create_task(aclient.completions.create(model="a1", prompt=PROMPT, max_tokens=NEW_TOKENS,
                                                                temperature=0, extra_body={"ignore_eos": True}))
        after = 0  # chunks that came after the load: the requests were in flight
        for i, it in enumerate(iters):
            async for chunk in it:
                texts[i] += chunk.choices[0].text
                after += 1
        return texts, (await loaded).choices[0].text, after

    texts, new, after = asyncio.run(scenario())
    assert after > 0
    assert texts == want
    assert new == expected(tokenizer, adapters, "a1", PROMPT)
    assert "a1" in [m.id for m in client.models.list().data]
    wait_for(lambda: no_leaks(server), 10, f"leaks: {leaks(server)}")
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a1"})
    assert r.status_code == 200, r.text


def test_unloading_an_adapter_in_use_is_refused_then_allowed(server, client, adapters):
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"][0]}).status_code == 200

    async def scenario():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        stream = await aclient.completions.create(model="a2", prompt=PROMPT, max_tokens=64, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        it = stream.__aiter__()
        await it.__anext__()  # running
        async with httpx.AsyncClient(timeout=60) as http:
            busy = await http.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a2"})
        async for _ in it:
            pass
        return busy

    busy = asyncio.run(scenario())
    assert busy.status_code == 400 and "in use" in busy.json()["error"]["message"]
    wait_for(lambda: no_leaks(server), 10, f"leaks: {leaks(server)}")
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "a2", PROMPT)
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize("body, words", [
    ({"lora_name": "x", "lora_path": "/no/such/dir"}, "no adapter_config.json"),
    ({"lora_name": "x", "lora_path": "BIG"}, "rank 16, above --max-lora-rank 8"),
    ({"lora_name": "x", "lora_path": "/tmp/adapter.gguf"}, "as GGUF"),  # a corrupt one
    ({"lora_name": MODEL, "lora_path": "A0"}, "the base model's name"),
    ({"lora_name": "a0", "lora_path": "A0"}, "already loaded"),
    ({"lora_name": "x", "lora_path": "A0", "lora_int_id": 3}, "lora_int_id"),
    ({"lora_name": "x"}, "lora_path"),
    ({"lora_name": "x", "lora_path": "CORRUPT"}, "cannot read its weights"),
])
def test_bad_loads_are_400s(server, adapters, tmp_path, body, words):
    body = {k: adapters["big"][0] if v == "BIG" else adapters["a0"][0] if v == "A0" else v for k, v in body.items()}
    if body.get("lora_path") == "CORRUPT":
        body["lora_path"] = str(tmp_path)
        (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 8}')
        (tmp_path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    if body.get("lora_path", "").endswith(".gguf"):
        body["lora_path"] = str(tmp_path / "adapter.gguf")
        (tmp_path / "adapter.gguf").write_bytes(b"GGUF")
    r = post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"] or words == r.json()["error"].get("param")
    assert "x" not in [c["id"] for c in httpx.get(server.base_url + "/models").json()["data"]]


def test_runtime_loading_is_off_unless_asked(fake_server):
    r = httpx.post(fake_server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert r.status_code == 404
    r = httpx.post(fake_server.url + "/v1/completions", json={"model": "x", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
