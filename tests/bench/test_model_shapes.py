"""benchmarks/model_shapes.py's Hugging Face writer on the tiny shape: a directory transformers and iterserve
both load, with the shape's config. The llama.cpp steps are left to the script's own runs."""
import json

import pytest
import torch

from tests.bench import load_benchmark

shapes = load_benchmark("model_shapes")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, default_model_path):
    out = shapes.paths("tiny", tmp_path_factory.mktemp("models")).hf
    shapes.write_hf("tiny", out)
    return out


def test_paths_name_one_folder_per_shape(tmp_path):
    p = shapes.paths("8b", tmp_path)
    assert p.hf == tmp_path / "8b" / "hf"
    assert p.of("q4_k_m") == tmp_path / "8b" / "8b.Q4_K_M.gguf"


@pytest.mark.slow
def test_the_safetensors_file_holds_every_tensor_in_bf16(tiny_hf):
    from safetensors import safe_open
    with safe_open(tiny_hf / "model.safetensors", "pt") as f:
        got = {name: f.get_tensor(name) for name in f.keys()}
    want = dict(shapes.tensor_shapes(shapes.SHAPES["tiny"]))
    assert {n: tuple(t.shape) for n, t in got.items()} == want
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    q = got["model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() - shapes.STD) < 0.002
    assert torch.equal(got["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))


@pytest.mark.slow
def test_transformers_loads_the_directory_with_the_shape(tiny_hf):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32)
    c, s = model.config, shapes.SHAPES["tiny"]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (s.hidden, s.layers, s.heads, s.kv_heads, s.intermediate, s.vocab)
    assert c.tie_word_embeddings
    assert json.loads((tiny_hf / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_iterserve_loads_and_generates(tiny_hf, monkeypatch):
    from iterserve import LLM, SamplingParams
    from iterserve.model.loader import load_model_arch
    arch = load_model_arch(str(tiny_hf))
    assert (arch.hidden_size, arch.num_kv_heads, arch.tie_word_embeddings, arch.rope_scaling["rope_type"]) == \
        (64, 2, True, "llama3")
    monkeypatch.setenv("ITERSERVE_WEIGHT_CACHE", "0")  # nothing written beside the kernels
    llm = LLM(str(tiny_hf), num_kv_blocks=8, block_size=16, num_threads=1)
    assert llm.engine.vocab_size == shapes.SHAPES["tiny"].vocab
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 4
