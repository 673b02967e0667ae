"""Shared fixtures: the default model, its tokenizer and transformers' own float32 model of it.

Each loads once per session, and only when a test asks for it."""
from __future__ import annotations


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
    from iterserve.model.loader import load_transformers_model
    return load_transformers_model(path, dtype)
