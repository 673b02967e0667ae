"""Shared fixtures: the default model, its tokenizer and transformers' own float32 model of it.

Each loads once per session, and only when a test asks for it."""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from iterserve.model.loader import default_model_path as find
    try:
        return find()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    from iterserve.model.loader import load_tokenizer
    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def hf_reference_model(default_model_path):
    """transformers' LlamaForCausalLM, float32, from the same GGUF through transformers' GGUF loader."""
    return load_hf_gguf_model(default_model_path, torch.float32)


def load_hf_gguf_model(path: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
    d, f = os.path.dirname(path), os.path.basename(path)
    try:
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    except ValueError as e:  # transformers wants `accelerate` for GGUF; same loader, called by hand
        if "accelerate" not in str(e):
            raise
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d, gguf_file=f), dtype=dtype)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, _ = model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embedding
    model.tie_weights()
    return model.eval()
