"""Weight-only int8/int4: the packed kernels against float, and the quantized engine against float32;
float weights in oneDNN's layout against F.linear."""
from __future__ import annotations

import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.executor.model_runner import ModelRunner
from iterserve.model import cpu_kernels
from iterserve.model.quant import (INT4_GROUP, PackedFloatWeight, PanelWeight, linear, pack_float, panel_layout, quantize,
                                     quantize_int4)
from iterserve.sampling_params import SamplingParams
from tests.model.test_cpu_linear import needs_int8


def dequantized(w) -> torch.Tensor:
    """The float weight a packed one stands for: x = I reads it back through the kernel."""
    k = w.shape[1]
    return linear(torch.eye(k, dtype=torch.bfloat16), w).float().t()


@pytest.mark.parametrize("mode,tol", [("int8", 1 / 127), ("int4", 1 / 15)])
def test_packed_linear_matches_float(mode, tol):
    torch.manual_seed(0)
    w = torch.randn(96, 128, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16)
    q = quantize(w, mode)
    err = (dequantized(q) - w.float()).abs().max() / w.float().abs().max()
    assert err <= tol  # half a step, with room for the scales' rounding to bf16
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x, q, bias).float(), (x.float() @ dequantized(q).t() + bias.float()),
                               atol=0.1, rtol=0.02)


@pytest.mark.parametrize("mode,tol", [("int8", 1e-4), ("int4", 2e-2)])
def test_weight_only_takes_the_kernels_panels_where_the_build_has_them(monkeypatch, mode, tol):
    """On AVX2 without AVX-512 weight-only int8 and int4 run on cpu_linear.cpp's panels, elsewhere on
    torch's kernels; the same product either way (int4: up to its scales' rounding, bf16 on the panels,
    float32 in torch's layout here)."""
    torch.manual_seed(1)
    w, x = torch.randn(80, 96), torch.randn(3, 96)  # torch's int4 layout takes N in multiples of 16
    ours = quantize(w, mode)
    on_panels = ours.panels if mode == "int8" else ours.scales_zeros is None
    assert on_panels == cpu_kernels.linear_weight_only_supported()
    monkeypatch.setattr(cpu_kernels, "linear_weight_only_supported", lambda flags=(): False)
    torchs = quantize(w, mode)
    if mode == "int8":
        assert not torchs.panels and torchs.qweight.shape == (80, 96)
    else:
        assert torchs.scales_zeros is not None
    torch.testing.assert_close(linear(x, ours), linear(x, torchs), atol=tol * 10, rtol=tol)


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_float_linear_matches_f_linear(dtype, rows):
    torch.manual_seed(rows)
    w = torch.randn(200, 96, dtype=dtype)
    bias = torch.randn(200, dtype=dtype)
    packed = pack_float(w)
    assert isinstance(packed, PackedFloatWeight | PanelWeight) and packed.shape == w.shape  # float32: test_cpu_linear
    x = torch.randn(rows, 3, 96, dtype=dtype)[:, 1]  # a strided view, as a slice of a larger activation
    for b in (None, bias):
        ours, ref = linear(x, packed, b), torch.nn.functional.linear(x, w, b)
        assert ours.shape == ref.shape == (rows, 200)
        if isinstance(packed, PackedFloatWeight) and dtype == torch.bfloat16:  # the same oneDNN kernel F.linear
            torch.testing.assert_close(ours, ref, atol=0, rtol=0)              # runs, minus the per-call re-layout
        elif dtype == torch.bfloat16:  # float32 sums in another order, rounded once: a last-bit flip at most
            torch.testing.assert_close(ours.float(), ref.float(), atol=1e-5, rtol=2 ** -7)
        else:  # oneDNN's or our sgemm against MKL's: the order of the K sum differs
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)


def test_pack_float_declines_what_onednn_cannot_take():
    """float16 needs AVX-512 fp16 on CPU and CUDA weights are never packed: the weight comes back
    as it was (where oneDNN does take float16, the packed linear must still be F.linear's)."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 32, dtype=torch.float16), torch.randn(3, 32, dtype=torch.float16)
    packed = pack_float(w)
    assert packed is w or isinstance(packed, PackedFloatWeight)
    torch.testing.assert_close(linear(x, packed).float(), torch.nn.functional.linear(x, w).float(),
                               atol=1e-2, rtol=1e-3)
    if torch.cuda.is_available():
        wc = w.cuda()
        assert pack_float(wc) is wc


@needs_onednn
def test_cpu_model_packs_its_float_weights():
    runner = ModelRunner(EngineConfig(num_kv_blocks=8, dtype="bfloat16"))
    layer = runner.model.layers[0]
    kind = PanelWeight if panel_layout(torch.bfloat16) else PackedFloatWeight
    assert all(isinstance(w, kind) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert isinstance(runner.model.lm_head, kind)
    # a tied embedding is read from the head's panels, not held twice; oneDNN's layout cannot be read so
    assert (runner.model.embed is None) == (kind is PanelWeight)


def test_int4_recovers_a_q4_1_grid():
    """Q4_1 blocks (w = d * q + m, q spanning 0..15) come back on the same grid."""
    torch.manual_seed(0)
    n, k = 16, 4 * INT4_GROUP
    q = torch.randint(0, 16, (n, k // INT4_GROUP, INT4_GROUP))
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 takes the block's min and max as its ends
    d = torch.rand(n, k // INT4_GROUP, 1) * 0.01 + 0.001
    m = -torch.rand(n, k // INT4_GROUP, 1) * 0.1
    exact = d * q + m
    got = dequantized(quantize_int4(exact.view(n, k).to(torch.bfloat16))).view_as(exact)
    assert ((got - exact).abs() < d / 4).all()  # every code comes back; the rest is bf16 rounding


def test_int4_refuses_inputs_it_cannot_group():
    with pytest.raises(ValueError, match="groups of 32 inputs; this model has a linear layer of 48 inputs"):
        quantize_int4(torch.randn(16, 48))


# ------------------------------------------------------------ the engine, vs float32

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "List three colors:"]
NEW_TOKENS = 16


def greedy(runner, prompts):
    engine = Engine(EngineConfig(), executor=runner)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = (o.token_ids, [{t for t, _ in lp.top} for lp in o.logprobs])
    return [got[str(i)] for i in range(len(prompts))]


def close(a, b) -> bool:
    """vLLM's check_logprobs_close: equal up to the first difference, each there in the other's top-5."""
    (ta, top_a), (tb, top_b) = a, b
    for i in range(NEW_TOKENS):
        if ta[i] != tb[i]:
            return ta[i] in top_b[i] and tb[i] in top_a[i]
    return True


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def float32_outputs(default_model_path, prompt_ids):
    return greedy(ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=64)), prompt_ids)


W8A8 = pytest.param("w8a8", marks=needs_int8)


@pytest.mark.parametrize("mode", ["int8", "int4", W8A8])
@pytest.mark.slow
def test_quantized_engine_is_close_to_float32(mode, prompt_ids, float32_outputs):
    runner = ModelRunner(EngineConfig(quantization=mode, num_kv_blocks=64))
    ours = greedy(runner, prompt_ids)
    for i, (a, b) in enumerate(zip(ours, float32_outputs)):
        assert close(a, b), f"{mode} prompt {i}: {a[0]} vs {b[0]}"


def test_quantization_needs_cpu():
    from iterserve.model.quant import check_supported
    with pytest.raises(ValueError, match="cpu"):
        check_supported("int8", torch.device("meta"))
