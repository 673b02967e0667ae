"""GGUF LoRA adapters (model/lora_gguf.py): a PEFT adapter of a tiny random Llama written as llama.cpp's
convert_lora_to_gguf.py writes it, read back into the same weights and the same greedy tokens; refusals."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from iterserve.model.lora import read_adapter
from iterserve.model.loader import load_model_arch
from tests.model.test_lora import hf_greedy, make_adapter, prompts, run, tiny_engine
from tests.model.test_llama import tiny_checkpoint

pytestmark = pytest.mark.slow  # transformers + PEFT beside the engine

# PEFT's module -> llama.cpp's tensor name
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row permutation for Llama (rope on adjacent pairs), which the converter
    applies to lora_b's rows alone (they are the output rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_lora(peft_dir: str, out: str, n_head: int, n_kv_head: int, outtype: str = "f32",
                    arch: str = "llama", general_type: str = "adapter", adapter_type: str = "lora",
                    extra_tensors: dict[str, np.ndarray] | None = None) -> str:
    """The PEFT directory as convert_lora_to_gguf.py writes it: general.type adapter, adapter.type lora,
    adapter.lora.alpha; blk.N.<name>.weight.lora_a [r, in] and .lora_b [out, r] (numpy order; GGUF lists
    the dims innermost first); Q8_0 where a row is a whole number of blocks, else F16 (its fallback)."""
    import gguf
    from safetensors.torch import load_file
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        alpha = float(json.load(f)["lora_alpha"])
    writer = gguf.GGUFWriter(out, arch)
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, t in sorted(load_file(os.path.join(peft_dir, "adapter_model.safetensors")).items()):
        parts = key.split(".")
        layer, module, ab = parts[parts.index("layers") + 1], parts[-3], parts[-2]
        w = t.float().numpy()
        if ab == "lora_B" and module in ("q_proj", "k_proj") and arch == "llama":
            w = _permute(w, n_head if module == "q_proj" else n_kv_head)
        _add(writer, f"blk.{layer}.{GGUF_NAMES[module]}.weight.{ab.lower()}", w, outtype)
    for name, w in (extra_tensors or {}).items():
        _add(writer, name, w, outtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add(writer, name: str, w: np.ndarray, outtype: str) -> None:
    import gguf
    from gguf.quants import quantize
    types = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    qtype = types[outtype]
    if qtype == gguf.GGMLQuantizationType.Q8_0 and w.shape[-1] % 32:
        qtype = gguf.GGMLQuantizationType.F16
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    else:
        writer.add_tensor(name, quantize(np.ascontiguousarray(w, dtype=np.float32), qtype), raw_dtype=qtype)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The checkpoint, its architecture, and an adapter of every module as a PEFT directory (with its model)."""
    root = tmp_path_factory.mktemp("lora_gguf")
    base = str(root / "base")
    hf = tiny_checkpoint(base, "llama")
    peft_dir = str(root / "peft")
    return base, load_model_arch(base), peft_dir, make_adapter(hf, peft_dir, seed=3)


def _gguf(tiny, path, **kw) -> str:
    _, arch, peft_dir, _ = tiny
    return write_gguf_lora(peft_dir, str(path), arch.num_heads, arch.num_kv_heads, **kw)


def test_greedy_tokens_equal_the_peft_directorys(tiny, tmp_path):
    base, _, peft_dir, peft_model = tiny
    engine = tiny_engine(base, lora_modules=[f"g={_gguf(tiny, tmp_path / 'a.gguf')}", f"p={peft_dir}"])
    ps = prompts(3, seed=1)
    outs = run(engine, ps + ps, ["g"] * 3 + ["p"] * 3)
    for p, out in zip(ps, outs):
        assert out.token_ids == hf_greedy(peft_model, p)
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in outs[3:]]
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


@pytest.mark.parametrize("outtype,tol", [("f32", 0.0), ("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 1e-2)])
def test_each_outtype_reads_the_peft_weights(tiny, tmp_path, outtype, tol):
    _, arch, peft_dir, _ = tiny
    want = read_adapter("p", peft_dir, 64)
    got = read_adapter("g", _gguf(tiny, tmp_path / "a.gguf", outtype=outtype), 64, arch)
    assert got.rank == want.rank and set(got.weights) == set(want.weights)
    for key, (a, b) in want.weights.items():
        ga, gb = got.weights[key]
        torch.testing.assert_close(ga, a, atol=tol * a.abs().max().item(), rtol=tol)
        torch.testing.assert_close(gb, b, atol=tol * b.abs().max().item(), rtol=tol)


def test_what_is_not_a_lora_gguf_is_refused(tiny, tmp_path):
    base, arch, _, _ = tiny
    engine = tiny_engine(base, max_loras=2)
    cases = [
        (dict(general_type="model"), "general.type is 'model', not 'adapter'"),
        (dict(adapter_type="control_vector"), "adapter.type 'control_vector' is not supported"),
        (dict(arch="qwen2"), "is for a 'qwen2' model; this model is 'llama'"),
        (dict(extra_tensors={"token_embd.weight.lora_a": np.zeros((8, 128), np.float32)}),
         "tensor 'token_embd.weight.lora_a' is not a LoRA weight of a supported module"),
        (dict(extra_tensors={"blk.0.attn_norm.weight": np.zeros(64, np.float32)}), "'blk.0.attn_norm.weight'"),
    ]
    for i, (kw, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            engine.load_lora(f"x{i}", _gguf(tiny, tmp_path / f"x{i}.gguf", **kw))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="cannot read .* as GGUF"):
        engine.load_lora("b", str(broken))
    with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 4"):
        read_adapter("small", _gguf(tiny, tmp_path / "r.gguf"), 4, arch)
    assert engine.lora_adapters == {}
