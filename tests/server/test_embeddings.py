"""/v1/embeddings: pooled final-norm hidden states equal transformers' on a tiny random checkpoint, for a
batch of different-length inputs; in the engine (last and mean pooling, chunked prefill beside a
generating request, blocks freed) and through the official openai client against the real server."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.sampling_params import SamplingParams
from tests.server.conftest import MODEL, no_leaks, start_server

TEXTS = ["The cat sat on the mat.", "Hi", "A much longer sentence about birds that sang while the cat ran far away "
         "from home, past the river and over the hill.", "Paris is the capital of France."]


def reference(model_dir: str, token_lists: list[list[int]], pooling: str) -> list[torch.Tensor]:
    """transformers' final-norm hidden states, one input at a time (no padding), pooled and L2-normalized."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in token_lists:
            h = model(torch.tensor([ids])).last_hidden_state[0]
            out.append(torch.nn.functional.normalize(h[-1] if pooling == "last" else h.mean(0), dim=0))
    return out


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float32), b, dim=0).item()


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_engine_pools_like_transformers_in_chunks_beside_a_generation(tiny_model_dir, tokenizer, pooling):
    # 16 tokens a step: the long input is pooled over several chunks, with a decode in the same steps
    engine = Engine(EngineConfig(model=tiny_model_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16))
    ids = [tokenizer.encode(t) for t in TEXTS]
    engine.add_request("Once upon a time", SamplingParams(max_tokens=8, temperature=0), request_id="gen")
    for i, p in enumerate(ids):
        engine.add_request(p, SamplingParams(max_tokens=1, pooling=pooling), request_id=f"e{i}")
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(done["gen"].token_ids) == 8 and done["gen"].embedding is None
    for i, ref in enumerate(reference(tiny_model_dir, ids, pooling)):
        out = done[f"e{i}"]
        assert out.finish_reason == "stop" and out.token_ids == [] and len(out.embedding) == ref.numel()
        assert cosine(out.embedding, ref) > 0.999, (i, pooling)
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = start_server(Engine(EngineConfig(model=tiny_model_dir, dtype="float32", num_kv_blocks=128)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_openai_client_batch_equals_transformers(client, server, tiny_model_dir, tokenizer):
    ids = [tokenizer.encode(t) for t in TEXTS]
    refs = reference(tiny_model_dir, ids, "last")
    r = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    assert all(cosine(d.embedding, ref) > 0.999 for d, ref in zip(r.data, refs))
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    floats = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")  # token ids, as floats
    assert all(cosine(d.embedding, ref) > 0.999 for d, ref in zip(floats.data, refs))
    one = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and cosine(one.data[0].embedding, refs[0]) > 0.999
    assert no_leaks(server)


@pytest.mark.slow
def test_refusals_name_the_field(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="hi", dimensions=8)
    assert e.value.body["param"] == "dimensions"
    r = httpx.post(server.base_url + "/embeddings", json={"model": MODEL, "input": "hi", "truncate": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate" and "not supported" in r.text
    r = httpx.post(server.base_url + "/embeddings", json={"model": MODEL, "input": ""})
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/embeddings", json={"model": "other", "input": "hi"})
    assert r.status_code == 404
