"""A decode step's layers in one C call (cpu_decode.cpp) against the Python layer loop: the same
kernels, in the same order, on the same arguments, so the same bits in the logits and in the cache."""
from __future__ import annotations

import pytest
import torch

from iterserve.model import cpu_decode, cpu_kernels, cpu_paths
from iterserve.model.kv_quant import SCALE_BYTES
from iterserve.model.llama import LlamaModel
from iterserve.model.loader import load_model_arch, load_weights
from tests.model.test_cpu_linear import needs_int8
from tests.model.test_families import build_checkpoint
from tests.model.test_llama import BS, metadata

needs_kernels = pytest.mark.skipif(cpu_kernels.linear_kernel() is None or cpu_kernels.elementwise_ops() is None,
                                   reason="the C kernels do not build here")
PROMPTS = [5, 9, 14]  # three sequences, each in its own blocks
TABLES = [list(range(16 * i, 16 * i + 16)) for i in range(len(PROMPTS))]


def model_of(path, dtype: str, quantization: str | None = None) -> LlamaModel:
    """dtype "bf16-storage": bfloat16 weights under float32 arithmetic."""
    arch, storage = load_model_arch(str(path)), torch.bfloat16 if dtype == "bf16-storage" else getattr(torch, dtype)
    return LlamaModel(arch, load_weights(str(path), arch, storage), BS, quantization=quantization,
                      dtype=torch.float32 if dtype == "bf16-storage" else storage)


def empty_cache(model: LlamaModel, kv: str) -> torch.Tensor:
    """kv: "auto" (the model's dtype), "bfloat16" (bf16 storage's cache) or "int8"."""
    cfg = model.cfg
    width = cfg.head_dim + (SCALE_BYTES if kv == "int8" else 0)
    return torch.zeros(cfg.num_layers, 2, 16 * len(PROMPTS), BS, cfg.num_kv_heads, width,
                       dtype=model.dtype if kv == "auto" else getattr(torch, kv))


W8A8 = pytest.param("bfloat16", "auto", "w8a8", marks=needs_int8)
needs_weight_only = pytest.mark.skipif(not cpu_kernels.linear_weight_only_supported(),
                                       reason="weight-only int8/int4 under float32 arithmetic run on torch's kernels "
                                       "in an AVX-512 build (test_cpu_paths runs these under ITERSERVE_CPU_ISA=avx2)")
needs_weight_only_bf16 = pytest.mark.skipif(not cpu_paths.current().weight_only_bf16,
                                           reason="cpu_paths: no weight-only panels unpacked to bf16 here")
WEIGHT_ONLY = [pytest.param(dtype, kv, mode, marks=needs_weight_only)
               for dtype, kv, mode in [("float32", "auto", "int8"), ("float32", "auto", "int4"),
                                       ("bf16-storage", "bfloat16", "int4"), ("bf16-storage", "int8", "int8")]]
WEIGHT_ONLY += [pytest.param("bfloat16", kv, mode, marks=needs_weight_only_bf16)
                for kv, mode in [("auto", "int8"), ("auto", "int4"), ("int8", "int4")]]


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "llama3.2", "mistral", "qwen2", "granite", "phi3"])
@pytest.mark.parametrize("dtype,kv,quantization", [("float32", "auto", None), ("bfloat16", "auto", None),
                                                   ("bf16-storage", "bfloat16", None), ("bfloat16", "int8", None),
                                                   ("bf16-storage", "int8", None), W8A8, *WEIGHT_ONLY])
@pytest.mark.slow
def test_decode_steps_in_c_give_the_python_loops_logits_and_cache(tmp_path, family, dtype, kv, quantization,
                                                                  monkeypatch):
    build_checkpoint(tmp_path, family)
    model = model_of(tmp_path, dtype, quantization)
    if model.decode_layers is None:  # only where cpu_paths keeps bfloat16 weights in oneDNN's layout
        assert dtype == "bfloat16" and cpu_paths.current().bf16_layout is None and quantization is None
        pytest.skip("bfloat16 weights stay oneDNN's on this CPU's build")
    calls = []
    real = cpu_decode.DecodeLayers.__call__
    monkeypatch.setattr(cpu_decode.DecodeLayers, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    cache = empty_cache(model, kv)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (sum(PROMPTS),), generator=g)
    positions = torch.cat([torch.arange(n) for n in PROMPTS])
    with torch.inference_mode():
        model.forward(ids, positions, cache, metadata(PROMPTS, PROMPTS, TABLES), torch.arange(len(PROMPTS)))
        assert not calls  # prompt rows: the Python loop
        lens = list(PROMPTS)
        for _ in range(12):  # past the sliding window and across blocks
            lens = [n + 1 for n in lens]
            ids = torch.randint(3, model.cfg.vocab_size, (len(lens),), generator=g)
            positions, md = torch.tensor([n - 1 for n in lens]), metadata([1] * len(lens), lens, TABLES)
            before = cache.clone()
            got = model.forward(ids, positions, cache, md, torch.arange(len(lens)))
            got_cache, cache = cache, before
            decode_layers, model.decode_layers = model.decode_layers, None
            want = model.forward(ids, positions, cache, md, torch.arange(len(lens)))
            model.decode_layers = decode_layers
            assert torch.equal(got, want) and torch.equal(got_cache, cache)
    assert len(calls) == 12


@needs_kernels
def test_a_step_with_prompt_rows_runs_the_python_loop(tmp_path, monkeypatch):
    build_checkpoint(tmp_path, "llama")
    model = model_of(tmp_path, "float32")
    assert model.decode_layers is not None
    monkeypatch.setattr(cpu_decode.DecodeLayers, "__call__", lambda *a: pytest.fail("a mixed step ran in C"))
    cache = empty_cache(model, "auto")
    with torch.inference_mode():  # one decode row beside a prompt
        md = metadata([1, 4], [6, 4], TABLES[:2])
        logits = model.forward(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([5, 0, 1, 2, 3]), cache, md,
                               torch.tensor([0, 4]))
    assert logits.shape == (2, model.cfg.vocab_size)


@needs_kernels
@pytest.mark.parametrize("family", ["qwen3", "gemma2", "olmo2", "qwen3_moe"])
def test_layers_it_does_not_implement_keep_the_python_loop(tmp_path, family):
    """q/k norms, sandwich or post norms, experts: DecodeLayers.build declines, whatever the step."""
    build_checkpoint(tmp_path, family)
    assert model_of(tmp_path, "float32").decode_layers is None


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_only_layers_on_torchs_kernels_keep_the_python_loop(tmp_path, monkeypatch, mode):
    """Weight-only int8/int4 in torch's layouts (a build with neither the AVX2 nor the bf16 panels), or under
    the arithmetic the panels do not take (float32 on AVX-512 BF16, whose panels take bfloat16): DecodeLayers.build
    declines."""
    build_checkpoint(tmp_path, "llama")
    if cpu_paths.current().weight_only_bf16:
        assert model_of(tmp_path, "float32", mode).decode_layers is None
    monkeypatch.setattr(cpu_kernels, "linear_weight_only_supported", lambda flags=(): False)
    monkeypatch.setattr(cpu_kernels, "linear_weight_only_bf16_supported", lambda flags=(): False)
    for dtype in ("bfloat16", "float32"):
        assert model_of(tmp_path, dtype, mode).decode_layers is None


@needs_kernels
@needs_weight_only_bf16
def test_linears_of_different_kinds_run_in_one_c_loop(tmp_path):
    """A Q4_K_M file's layers: int4 linears beside per-row int8 ones (its Q6_K tensors), each with its own code in
    the C loop: the Python loop's logits and cache, bit for bit."""
    from iterserve.model.quant import Int4Weight, Int8Weight, quantize
    build_checkpoint(tmp_path, "llama")
    model = model_of(tmp_path, "bfloat16", "int4")
    floats = load_weights(str(tmp_path), model.cfg, torch.bfloat16)
    model.layers[0].down = quantize(floats["model.layers.0.mlp.down_proj.weight"], "int8", torch.bfloat16)
    model.decode_layers = cpu_decode.DecodeLayers.build(model)
    assert isinstance(model.layers[0].down, Int8Weight) and isinstance(model.layers[1].down, Int4Weight)
    assert model.decode_layers is not None
    cache = empty_cache(model, "auto")
    with torch.inference_mode():
        model.forward(torch.arange(3, 3 + sum(PROMPTS)), torch.cat([torch.arange(n) for n in PROMPTS]), cache,
                      metadata(PROMPTS, PROMPTS, TABLES), torch.arange(len(PROMPTS)))
        lens = [n + 1 for n in PROMPTS]
        ids, positions, md = torch.tensor([7, 8, 9]), torch.tensor([n - 1 for n in lens]), metadata([1] * 3, lens, TABLES)
        before = cache.clone()
        got = model.forward(ids, positions, cache, md, torch.arange(3))
        got_cache, cache = cache, before
        model.decode_layers = None
        want = model.forward(ids, positions, cache, md, torch.arange(3))
    assert torch.equal(got, want) and torch.equal(got_cache, cache)


@needs_kernels
def test_timed_parts_add_up_each_layer_call_and_leave_the_step_bit_for_bit(tmp_path):
    """step_time.py --parts: the C loop's timers see every part of every layer, change no bit, stop."""
    build_checkpoint(tmp_path, "llama")
    model = model_of(tmp_path, "float32")
    cache = empty_cache(model, "auto")
    with torch.inference_mode():
        model.forward(torch.arange(3, 3 + sum(PROMPTS)), torch.cat([torch.arange(n) for n in PROMPTS]), cache,
                      metadata(PROMPTS, PROMPTS, TABLES), torch.arange(len(PROMPTS)))
        lens = [n + 1 for n in PROMPTS]
        ids, positions = torch.tensor([7, 8, 9]), torch.tensor([n - 1 for n in lens])
        md = metadata([1] * len(lens), lens, TABLES)
        before = cache.clone()
        untimed = model.forward(ids, positions, cache, md, torch.arange(len(lens)))
        untimed_cache, cache = cache, before
        model.decode_layers.time_parts()
        timed = model.forward(ids, positions, cache, md, torch.arange(len(lens)))
        parts = model.decode_layers.parts()
        model.decode_layers.time_parts(False)
    assert torch.equal(timed, untimed) and torch.equal(cache, untimed_cache)
    assert list(parts) == list(cpu_decode.PARTS) and all(seconds > 0 for seconds in parts.values()), parts
    assert model.decode_layers.part_seconds is None and not any(model.decode_layers.parts().values())
