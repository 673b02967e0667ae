"""The C++ linear kernel over panel-packed weights (cpu_linear.cpp) against F.linear, and the engine
with it against the engine on oneDNN's packed weights."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.executor.model_runner import ModelRunner
from iterserve.model import cpu_arena, cpu_kernels, cpu_packing, cpu_paths
from iterserve.model.loader import load_model_arch, load_weights
from iterserve.model.quant import PanelWeight, linear, pack_float, panel_layout
from iterserve.sampling_params import SamplingParams
from tests.model.test_llama import tiny_checkpoint

needs_kernel = pytest.mark.skipif(cpu_kernels.linear_kernel() is None, reason="cpu_linear.cpp not built here (no "
                                  "compiler, or neither AVX-512 nor AVX2)")
# this CPU's build, and the AVX2 one (the same build where the CPU has no AVX-512)
BUILDS = pytest.mark.parametrize("flags", [(), ("-mno-avx512f",)], ids=["native", "avx2"])

# (rows, outputs, inputs): one row (decode), a tile's worth, several tiles of unequal height (13 = 6 + 7),
# outputs short of a panel and not a multiple of 16, odd inputs, a single output, no rows at all
SHAPES = [(1, 64, 64), (1, 33, 17), (5, 200, 96), (12, 1, 1), (13, 100, 301), (40, 47, 513), (64, 96, 128), (0, 70, 20)]


@needs_kernel
@BUILDS
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_float32_matches_f_linear(m, n, k, flags):
    kernel = cpu_kernels.linear_kernel(flags)
    torch.manual_seed(m * 1000 + n + k)
    w, bias = torch.randn(n, k), torch.randn(n)
    x = torch.randn(m, 3, k)[:, 1]  # rows strided, as a slice of a wider activation
    panels = cpu_packing.pack_panels(w)
    assert panels.shape == (-(-n // cpu_packing.PANEL), k, cpu_packing.PANEL)
    for b in (None, bias):
        got = cpu_kernels.linear(x, panels, n, b, kernel)
        assert got.shape == (m, n) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5 * k ** 0.5, rtol=1e-5)


@needs_kernel
@BUILDS
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bfloat16_is_summed_in_float32_and_rounded_once(m, n, k, flags):
    kernel = cpu_kernels.linear_kernel(flags)
    """bf16 in and out: the float32 product of the bf16 values, plus bias, rounded to bf16 once."""
    torch.manual_seed(m + n + k)
    w, x, bias = (torch.randn(*s).bfloat16() for s in ((n, k), (m, k), (n,)))
    got = cpu_kernels.linear(x, cpu_packing.pack_panels(w), n, bias, kernel)
    want = F.linear(x.float(), w.float(), bias.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=2 ** -7)  # a last-bit flip at most
    assert (got != want).float().mean().nan_to_num() < 0.02  # from float32 sums taken in another order


@needs_kernel
@BUILDS
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bfloat16_panels_under_float32_activations(m, n, k, flags):
    kernel = cpu_kernels.linear_kernel(flags)
    """bf16-storage: bf16 weights widened exactly, float32 x, bias and y: F.linear on the widened weights."""
    torch.manual_seed(7 * m + n + k)
    w, bias = torch.randn(n, k).bfloat16(), torch.randn(n)
    x = torch.randn(m, 3, k)[:, 1]
    panels = cpu_packing.pack_panels(w)
    assert panels.dtype == torch.bfloat16
    for b in (None, bias):
        got = cpu_kernels.linear(x, panels, n, b, kernel)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got, F.linear(x, w.float(), b), atol=1e-5 * k ** 0.5, rtol=1e-5)
    packed = pack_float(w, panels=True)
    assert isinstance(packed, PanelWeight) and packed.panels.dtype == torch.bfloat16
    torch.testing.assert_close(linear(x, packed, bias), F.linear(x, w.float(), bias), atol=1e-5 * k ** 0.5, rtol=1e-5)


needs_pairs = pytest.mark.skipif(not cpu_kernels.linear_pairs_supported(), reason="the pairs layout needs AVX-512 BF16")


@needs_pairs
@pytest.mark.parametrize("m,n,k", [(m, n, k + k % 2) for m, n, k in SHAPES])
def test_bfloat16_pairs_are_summed_in_float32_and_rounded_once(m, n, k):
    """AVX-512 BF16 dot products over the pairs layout: the float32 product of the bf16 values, plus bias,
    rounded to bf16 once (vdpbf16ps sums each pair's two products before adding them: a last bit at most).
    Rows read in place (one tile, strided) and packed (several tiles)."""
    torch.manual_seed(m + 3 * n + k)
    w, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(m, 3, k).bfloat16()[:, 1]
    panels = cpu_packing.pack_panels(w, pairs=True)
    assert panels.shape == (-(-n // cpu_packing.PANEL), k // 2, cpu_packing.PANEL, 2)
    assert cpu_packing.panel_in_features(panels) == k
    for b in (None, bias):
        got = cpu_kernels.linear(x, panels, n, b)
        want = F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
        assert got.dtype == torch.bfloat16 and got.shape == (m, n) and got.is_contiguous()
        torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=2 ** -7)
        assert (got != want).float().mean().nan_to_num() < 0.02
    ids = torch.tensor([n - 1, 0, n // 2])  # a tied embedding's lookups read the head's panels
    assert torch.equal(cpu_packing.panel_rows(panels, ids), w[ids])


def test_the_pairs_layout_wants_bfloat16_and_an_even_k_and_a_bf16_build():
    with pytest.raises(ValueError, match="even number of inputs"):
        cpu_packing.pack_panels(torch.randn(8, 5).bfloat16(), pairs=True)
    with pytest.raises(ValueError, match="even number of inputs"):
        cpu_packing.pack_panels(torch.randn(8, 4), pairs=True)
    if cpu_kernels.linear_kernel(("-mno-avx512bf16",)) is None:
        pytest.skip("cpu_linear.cpp not built here")
    assert not cpu_kernels.linear_pairs_supported(("-mno-avx512bf16",))
    panels = cpu_packing.pack_panels(torch.randn(8, 4).bfloat16(), pairs=True)
    with pytest.raises(ValueError, match="no AVX-512 BF16"):
        cpu_kernels.linear(torch.randn(2, 4).bfloat16(), panels, 8, None, cpu_kernels.linear_kernel(("-mno-avx512bf16",)))


@needs_kernel
def test_pack_float_takes_panels_for_float32_and_the_model_uses_them():
    w = torch.randn(96, 64)
    packed = pack_float(w)
    assert isinstance(packed, PanelWeight) and packed.shape == w.shape and packed.nbytes == w.nbytes
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(linear(x, packed), F.linear(x, w), atol=1e-5, rtol=1e-5)


def greedy_tokens(path: str, prompts: list[list[int]]) -> tuple[list[list[int]], set[str]]:
    """Each prompt's 12 greedy tokens on a float32 engine, and the kinds of weight its linears run on."""
    config = EngineConfig(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    arch = load_model_arch(path)
    runner = ModelRunner(config, arch, load_weights(path, arch, torch.float32, torch.device("cpu")))
    engine = Engine(config, runner)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    kinds = {type(runner.model.layers[0].qkv).__name__, type(runner.model.lm_head).__name__}
    return [done[i] for i in ids], kinds


PROMPTS = [[5, 17, 99, 3, 42], [7] * 20, list(range(30, 70)), [1]]  # a batch of 4, then fewer as they finish


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-linear")
    tiny_checkpoint(path, "qwen2")  # q/k/v biases: the kernel's bias path
    return str(path)


@needs_kernel
def test_engine_greedy_tokens_equal_with_the_kernel_and_with_onednn(tiny, monkeypatch):
    on, kinds_on = greedy_tokens(tiny, PROMPTS)
    assert kinds_on == {"PanelWeight"}
    monkeypatch.setattr(cpu_kernels, "linear_kernel", lambda: None)  # what a build without it does
    off, kinds_off = greedy_tokens(tiny, PROMPTS)
    assert kinds_off <= {"PackedFloatWeight", "Tensor"} and len(on[0]) == 12
    assert on == off


@pytest.mark.slow
def test_without_cpu_kernels_the_engine_runs_on_onednn_weights(tiny):
    """ITERSERVE_CPU_KERNELS=0 (read once per process): a fresh interpreter, the same greedy tokens."""
    code = ("import json, sys; from tests.model.test_cpu_linear import greedy_tokens, PROMPTS; "
            "tokens, kinds = greedy_tokens(sys.argv[1], PROMPTS); print(json.dumps([tokens, sorted(kinds)]))")
    env = {**os.environ, "ITERSERVE_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code, tiny], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    tokens, kinds = json.loads(out.stdout.strip().splitlines()[-1])
    assert not {"PanelWeight"} & set(kinds)
    here, _ = greedy_tokens(tiny, PROMPTS)
    assert tokens == here


@pytest.mark.skipif(cpu_kernels.elementwise_ops() is None, reason="no C++ compiler here")
def test_a_build_without_avx2_declines_and_the_weights_stay_onednns(monkeypatch):
    assert cpu_kernels.linear_kernel(("-mno-avx2", "-mno-avx512f")) is None
    monkeypatch.setattr(cpu_kernels, "linear_kernel", lambda: None)
    assert not isinstance(pack_float(torch.randn(64, 32)), PanelWeight)


def test_panels_are_carved_from_shared_huge_page_mappings_and_freed_with_their_weights():
    if cpu_arena._arena is None:
        pytest.skip("no MADV_HUGEPAGE on this OS")
    ws = [torch.randn(n, 40) for n in (64, 33, 200)]
    for w in ws:  # the layout, read back through the kernel
        torch.testing.assert_close(cpu_kernels.linear(torch.eye(40), cpu_packing.pack_panels(w), w.shape[0]), w.t())
    arena = cpu_arena._HugePageArena()  # its own, so no other test's weights share the mapping
    tensors = [arena.empty(shape, dtype) for shape, dtype in [((3, 5), torch.float32), ((7,), torch.bfloat16),
                                                               ((2, 40, 32), torch.float32)]]
    assert all(t.data_ptr() % 64 == 0 and t.is_contiguous() for t in tensors)
    ends = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # one mapping, no two overlapping
    mapping = weakref.ref(arena.mapping())
    assert ends[-1][1] - ends[0][0] < 2 ** 20
    del tensors
    gc.collect()
    assert mapping() is None  # the arena kept no strong reference: the mapping went with its tensors
    assert arena.empty((4,), torch.float32).shape == (4,)  # and it maps a new one when asked again


@needs_kernel
def test_bfloat16_weights_take_the_panels_cpu_paths_chose():
    """Whatever this CPU is, pack_float gives bfloat16 weights the layout cpu_paths names, and the
    kernel that runs it matches torch's product."""
    layout = cpu_paths.current().bf16_layout
    torch.manual_seed(3)
    w, x, bias = torch.randn(70, 48).bfloat16(), torch.randn(3, 48).bfloat16(), torch.randn(70).bfloat16()
    packed = pack_float(w)
    assert panel_layout(torch.bfloat16) == layout and isinstance(pack_float(w.float()), PanelWeight)
    assert isinstance(packed, PanelWeight) == (layout is not None)
    if layout is not None:
        assert packed.panels.dim() == (4 if layout == "pairs" else 3)
    got = linear(x, packed, bias)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), bias.float()), atol=1e-5, rtol=2 ** -7)


# ------------------------------------------------------------ int8 panels (--quantization w8a8)

needs_int8 = pytest.mark.skipif(not cpu_kernels.linear_int8_supported(),
                                reason="no AVX-512 VNNI build of cpu_linear.cpp here")
GROUP = cpu_packing.INT8_GROUP


def w8a8_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the int8 panels compute, in float64 from the same codes: W per output row symmetric; x in
    groups of GROUP inputs, asymmetric u8 over each group's range with 0 in it; float32 out."""
    m, k = x.shape
    kp = -(-k // GROUP) * GROUP
    wf = w.float()
    w_scale = (wf.abs().amax(dim=1) / 127).clamp(min=1e-10)
    qw = F.pad(torch.round(wf / w_scale[:, None]).clamp(-127, 127), (0, kp - k)).double()
    xg = F.pad(x.float(), (0, kp - k)).view(m, kp // GROUP, GROUP)
    lo, hi = xg.amin(dim=-1).clamp(max=0), xg.amax(dim=-1).clamp(min=0)
    scale = torch.where(hi > lo, (hi - lo) / 255, torch.ones_like(hi))
    zero = torch.round(-lo * (1 / scale)).clamp(0, 255)
    qx = (torch.round(xg * (1 / scale)[..., None]) + zero[..., None]).clamp(0, 255).double()
    y = torch.zeros(m, w.shape[0], dtype=torch.float64)
    for g in range(kp // GROUP):
        qw_g = qw[:, g * GROUP:(g + 1) * GROUP]
        y += (qx[:, g] @ qw_g.T - zero[:, g, None].double() * qw_g.sum(dim=1)) * scale[:, g, None].double()
    y = y * w_scale.double()
    return (y + bias.double() if bias is not None else y).float()


def test_int8_panels_layout():
    w = torch.randn(40, 100)
    panels = cpu_packing.pack_int8_panels(w)
    kp = 2 * GROUP  # 100 inputs rounded up to two groups
    assert panels.dtype == torch.int8 and panels.shape == (2, kp * 32 + 4 * 32 * (1 + 2))
    assert cpu_packing.panel_in_features(panels) == kp
    codes = panels[:, :kp * 32].view(2, kp // 4, 32, 4).transpose(1, 2).reshape(64, kp)
    tail = panels[:, kp * 32:].view(torch.float32)
    scales = tail[:, :32].reshape(64)
    torch.testing.assert_close(codes[:40, :100].float() * scales[:40, None], w, atol=scales.max().item() / 2, rtol=0)
    assert (codes[40:] == 0).all() and (codes[:, 100:] == 0).all()  # padding: no output, no input
    assert codes.abs().max() == 127
    groups = kp // GROUP
    sums = tail[:, 32:].view(2, groups, 32).transpose(1, 2).reshape(64, groups)
    assert torch.equal(sums, codes.view(64, groups, GROUP).sum(dim=-1).float())


@needs_int8
@pytest.mark.parametrize("m,n,k", SHAPES + [(7, 65, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_panels_compute_the_quantized_product(m, n, k, dtype):
    """The kernel's sums are exact integers; what is left is float32 rounding of the group sums and, in
    bf16, the one rounding of y. Against float: within what 8-bit codes allow."""
    torch.manual_seed(3 * m + n + k)
    w, bias = torch.randn(n, k), torch.randn(n).to(dtype)
    x = torch.randn(m, 3, k)[:, 1].to(dtype)
    x[:, :1] *= 30  # an outlier channel: its group's scale is coarse, the others' are not
    panels = cpu_packing.pack_int8_panels(w)
    for b in (None, bias):
        got = cpu_kernels.linear(x, panels, n, b)
        assert got.shape == (m, n) and got.dtype == dtype and got.is_contiguous()
        want = w8a8_reference(x, w, b)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-4 * k ** 0.5, rtol=1e-5)
        else:
            torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=2 ** -7)
        exact = F.linear(x.float(), w, None if b is None else b.float())
        err = (got.float() - exact).abs()
        bound = 0.05 * exact.abs().amax(dim=1, keepdim=True).clamp(min=1) if m else err
        assert (err <= bound).all()


@needs_int8
def test_int8_panels_serve_the_model_linear():
    """quant.quantize(w, "w8a8") is a PanelWeight over int8 panels; quant.linear takes any leading shape."""
    from iterserve.model.quant import quantize
    w = torch.randn(96, 128)
    q = quantize(w, "w8a8")
    assert isinstance(q, PanelWeight) and q.panels.dtype == torch.int8 and q.shape == w.shape
    x = torch.randn(2, 5, 128).bfloat16()
    got = linear(x, q)
    assert got.shape == (2, 5, 96)
    torch.testing.assert_close(got.float(), w8a8_reference(x.view(10, 128), w, None).view(2, 5, 96),
                               atol=1e-3, rtol=2 ** -7)


def test_w8a8_is_refused_where_the_kernel_cannot_run(monkeypatch):
    from iterserve.model import quant
    monkeypatch.setattr(cpu_kernels, "linear_int8_supported", lambda *a: False)
    with pytest.raises(ValueError, match="AVX-512 VNNI"):
        quant.check_supported("w8a8", torch.device("cpu"))


AVX2_BUILD = ("-mno-avx512f",)  # weight-only int8/int4 panels are the AVX2 build's (any x86 CPU with AVX2 runs it)
needs_weight_only = pytest.mark.skipif(not cpu_kernels.linear_weight_only_supported(AVX2_BUILD),
                                        reason="no AVX2 build of cpu_linear.cpp here")


@needs_weight_only
@pytest.mark.parametrize("m,n,k", SHAPES + [(7, 65, 1536)])
def test_int8_weight_panels_compute_codes_times_scales(m, n, k):
    """Weight-only int8 (--quantization int8 on AVX2): the codes times each row's scale, against x as the
    kernel codes it (check_x_coded)."""
    torch.manual_seed(5 * m + n + k)
    q, scales = cpu_packing.int8_codes(torch.randn(n, k))
    panels = cpu_packing.pack_int8_weight_panels(q, scales)
    check_x_coded(cpu_kernels.linear_int8_weights, panels, q.float() * scales[:, None], m)


def check_x_coded(linear, panels, w: torch.Tensor, m: int) -> None:
    """The weight-only kernels take x in as 16-bit codes (a symmetric scale a row) and sum against the weight's
    codes exactly in integers: linear(x, panels, ..) is x's coded values times the dequantized weight w (+
    bias) to float32's rounding, and within the coding's bound (half a step of x's scale a weight) of x w."""
    n, k = w.shape
    x = torch.randn(m, 3, k)[:, 1]  # rows 3 k apart: read in place
    x[:, :k // 3] *= 40  # rows with outliers, as activations have
    amax = x.abs().amax(dim=1, keepdim=True)
    x_scale = torch.where(amax > 0, amax / 32767, 1.0)
    x_coded = torch.round(x * (1 / x_scale)) * x_scale
    for bias in (None, torch.randn(n)):
        got = linear(x, panels, n, k, bias, kernel=cpu_kernels.linear_kernel(AVX2_BUILD))
        assert got.shape == (m, n) and got.dtype == torch.float32 and got.is_contiguous()
        b = bias.double() if bias is not None else None
        rounding = 1e-6 * (x_coded.abs() @ w.abs().T).double() + 1e-6  # float32's, on the sums' magnitude
        assert ((got - torch.nn.functional.linear(x_coded.double(), w.double(), b)).abs() <= rounding).all()
        bound = x_scale / 2 * w.abs().sum(dim=1) + rounding
        assert ((got - torch.nn.functional.linear(x.double(), w.double(), b)).abs() <= bound).all()


@needs_weight_only
@pytest.mark.parametrize("k,at", [(64, 9), (63, 60)])  # 60: in the row's scalar tail (63 = 7 x 8 + 7)
def test_weight_only_panels_pass_a_nan_on_to_its_row(k, at):
    """A NaN in a row of x makes that row's outputs NaN (as a float product's), never finite values from its
    16-bit codes; the other rows are untouched."""
    x = torch.randn(3, k)
    x[1, at] = float("nan")
    q, scales = cpu_packing.int8_codes(torch.randn(40, k))
    cases = [(cpu_kernels.linear_int8_weights, cpu_packing.pack_int8_weight_panels(q, scales))]
    if k % cpu_packing.INT4_GROUP == 0:
        q4 = torch.randint(0, 16, (40, k))
        cases.append((cpu_kernels.linear_int4_weights, cpu_packing.pack_int4_weight_panels(
            q4, torch.ones(40, k // cpu_packing.INT4_GROUP), torch.zeros(40, k // cpu_packing.INT4_GROUP))))
    for linear, panels in cases:
        y = linear(x, panels, 40, k, kernel=cpu_kernels.linear_kernel(AVX2_BUILD))
        assert y[1].isnan().all() and y[[0, 2]].isfinite().all()


INT4_SHAPES = [(1, 64, 64), (5, 200, 96), (3, 33, 32), (6, 17, 64), (13, 100, 320), (40, 47, 512), (0, 70, 32),
               (50, 65, 1536)]


@needs_weight_only
@pytest.mark.parametrize("m,n,k", INT4_SHAPES)
def test_int4_weight_panels_compute_codes_times_scales_plus_minimums(m, n, k):
    """Weight-only int4 (--quantization int4 on AVX2): each group's codes times its scale plus its minimum
    (bf16 both), against x as the kernel codes it (check_x_coded)."""
    torch.manual_seed(7 * m + n + k)
    groups = k // cpu_packing.INT4_GROUP
    q = torch.randint(0, 16, (n, k))
    scales = (torch.rand(n, groups) + 0.1).bfloat16().float()  # what the panels hold, so exact
    minimums = torch.randn(n, groups).bfloat16().float()
    w = q * scales.repeat_interleave(cpu_packing.INT4_GROUP, 1) + minimums.repeat_interleave(cpu_packing.INT4_GROUP, 1)
    check_x_coded(cpu_kernels.linear_int4_weights, cpu_packing.pack_int4_weight_panels(q, scales, minimums), w, m)


@needs_kernel
def test_weight_only_panels_are_declined_by_a_build_without_them():
    """Where the build has AVX-512 (its own w8a8 panels instead), codes 6 and 7 are refused, never misread."""
    declining = [flags for flags in [(), AVX2_BUILD] if not cpu_kernels.linear_weight_only_supported(flags)]
    if not declining:
        pytest.skip("every build here has them (AVX2 without AVX-512)")
    q, scales = cpu_packing.int8_codes(torch.randn(40, 64))
    panels = cpu_packing.pack_int8_weight_panels(q, scales)
    for flags in declining:
        with pytest.raises(ValueError, match="weight-only int8"):
            cpu_kernels.linear_int8_weights(torch.randn(2, 64), panels, 40, 64, kernel=cpu_kernels.linear_kernel(flags))
    panels = cpu_packing.pack_int4_weight_panels(torch.randint(0, 16, (40, 64)), torch.ones(40, 2), torch.zeros(40, 2))
    for flags in declining:
        with pytest.raises(ValueError, match="weight-only int4"):
            cpu_kernels.linear_int4_weights(torch.randn(2, 64), panels, 40, 64, kernel=cpu_kernels.linear_kernel(flags))


NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
# this build (AMX tiles here where cpu_paths says so) and one without AMX (vdpbf16ps, as on Zen 4)
BF16_BUILDS = pytest.mark.parametrize("flags", [(), NO_AMX], ids=["native", "no-amx"])
ROWS = [0, 1, 3, 16, 17, 33, 100]  # none; one block of 16 or 32 rows (the panel a depth at a time); more
DEPTHS = [(70, 64), (100, 4064)]  # a last partial panel; 4064 inputs: a last partial depth


def bf16_unpacking(flags: tuple[str, ...]):
    """The kernel of the build with these flags, which unpacks the weight-only panels to bf16 pairs; skips where
    it does not (this build: as cpu_paths says)."""
    takes = cpu_paths.current().weight_only_bf16 if not flags else cpu_kernels.linear_weight_only_bf16_supported(flags)
    if not takes:
        pytest.skip("no weight-only panels unpacked to bf16 in this build (AVX-512 BF16 only)")
    return cpu_kernels.linear_kernel(flags)


def int4_case(n: int, k: int, exact: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(panels, the weight q * scale + minimum in float32, each weight's scale) of random codes, bf16 scales and
    minimums; exact: each minimum -8 scales (Q4_0's), which the kernel unpacks with one rounding, as the float32
    weight's."""
    torch.manual_seed(seed)
    groups = k // cpu_packing.INT4_GROUP
    q = torch.randint(0, 16, (n, k))
    scales = (torch.rand(n, groups) * 0.02 + 1e-3).bfloat16().float()
    minimums = -8 * scales if exact else (torch.randn(n, groups) * 0.05).bfloat16().float()
    w = (q.view(n, groups, -1) * scales[..., None] + minimums[..., None]).view(n, k)
    return cpu_packing.pack_int4_weight_panels(q, scales, minimums), w, scales.repeat_interleave(32, 1)


def read_back(linear, panels, n: int, k: int, kernel) -> torch.Tensor:
    """The bf16 weight [n, k] a weight-only kernel multiplies by: x = I reads it back exactly."""
    return linear(torch.eye(k, dtype=torch.bfloat16), panels, n, k, kernel=kernel).t()


@BF16_BUILDS
@pytest.mark.parametrize("exact", [True, False])
def test_int4_panels_unpack_to_the_weights_in_bf16(exact, flags):
    """Each weight q * scale + minimum rounded to bf16 once; with any minimum, off by at most scale / 2^9 before
    that rounding (cpu_linear_weight_only_amx.h)."""
    kernel = bf16_unpacking(flags)
    panels, w, scale = int4_case(70, 128, exact, seed=1)
    got = read_back(cpu_kernels.linear_int4_weights, panels, 70, 128, kernel).float()
    if exact:
        assert torch.equal(got, w.bfloat16().float())
    else:
        assert ((got - w).abs() <= 2 ** -8 * w.abs() + scale * 2 ** -9).all()
        assert (got != w.bfloat16().float()).float().mean() < 0.05


@BF16_BUILDS
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", DEPTHS)
def test_int4_panels_are_the_bf16_pairs_linear_over_their_weights(m, n, k, flags):
    """Bit for bit the bf16 pairs panels' linear of the same build (AMX tiles, or vdpbf16ps) over the unpacked
    weight, bias or none, rows read in place with a stride; and within bf16's rounding of the float32 product."""
    kernel = bf16_unpacking(flags)
    panels, w, _ = int4_case(n, k, exact=True, seed=m + n + k)
    pairs = cpu_packing.pack_panels(w.bfloat16(), pairs=True)
    x = torch.randn(m, 2, k).bfloat16()[:, 1]
    for bias in (None, torch.randn(n).bfloat16()):
        got = cpu_kernels.linear_int4_weights(x, panels, n, k, bias, kernel=kernel)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert torch.equal(got, cpu_kernels.linear(x, pairs, n, bias, kernel=kernel))
        want = F.linear(x.float(), w.bfloat16().float(), None if bias is None else bias.float())
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=2 ** -7)


@BF16_BUILDS
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", DEPTHS)
def test_int8_panels_unpacked_to_bf16_compute_codes_times_scales(m, n, k, flags):
    """The codes in bf16 exactly, the row scale applied to the float32 sums (AMX; vdpbf16ps: to the codes): within
    bf16's rounding of x (codes * scales)^T (+ bias) in float32, and x = I reads back the weights rounded once."""
    kernel = bf16_unpacking(flags)
    torch.manual_seed(3 * m + n + k)
    q, scales = cpu_packing.int8_codes(torch.randn(n, k))
    panels = cpu_packing.pack_int8_weight_panels(q, scales)
    w = q.float() * scales[:, None]
    on_tiles = not flags and cpu_paths.current().amx_tiles
    x = torch.randn(m, 2, k).bfloat16()[:, 1]
    for bias in (None, torch.randn(n).bfloat16()):
        got = cpu_kernels.linear_int8_weights(x, panels, n, k, bias, kernel=kernel)
        want = F.linear(x.float(), w if on_tiles else w.bfloat16().float(), None if bias is None else bias.float())
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=2 ** -7)
    if k <= 64:
        assert torch.equal(read_back(cpu_kernels.linear_int8_weights, panels, n, k, kernel), w.bfloat16())


@BF16_BUILDS
def test_a_rows_result_on_weight_only_panels_does_not_depend_on_the_rows_beside_it(flags):
    """Alone (on AMX the panel a depth at a time), in 16, in 33 and 100 (the whole panel, then block by block):
    the same bits, as the bf16 pairs linear gives (a speculative verify step and a decode step must agree)."""
    kernel = bf16_unpacking(flags)
    panels4 = int4_case(96, 4064, exact=False, seed=2)[0]
    q, scales = cpu_packing.int8_codes(torch.randn(96, 4064))
    panels8 = cpu_packing.pack_int8_weight_panels(q, scales)
    x = torch.randn(100, 4064).bfloat16()
    for linear, panels in ((cpu_kernels.linear_int4_weights, panels4), (cpu_kernels.linear_int8_weights, panels8)):
        alone = torch.cat([linear(x[i:i + 1], panels, 96, 4064, kernel=kernel) for i in range(100)])
        for m in (16, 33, 100):
            assert torch.equal(linear(x[:m], panels, 96, 4064, kernel=kernel), alone[:m])


@BF16_BUILDS
def test_weight_only_panels_under_bf16_keep_a_nan_in_its_row(flags):
    kernel = bf16_unpacking(flags)
    panels = int4_case(64, 64, exact=True, seed=3)[0]
    q, scales = cpu_packing.int8_codes(torch.randn(64, 64))
    x = torch.randn(20, 64).bfloat16()
    x[5, 9] = float("nan")
    for linear, p in ((cpu_kernels.linear_int4_weights, panels),
                      (cpu_kernels.linear_int8_weights, cpu_packing.pack_int8_weight_panels(q, scales))):
        got = linear(x, p, 64, 64, kernel=kernel)
        assert got[5].isnan().all() and not got[torch.arange(20) != 5].isnan().any()


@needs_kernel
def test_weight_only_panels_under_bf16_are_declined_by_a_build_without_avx512_bf16():
    """Codes 8 and 9 (bfloat16 activations) need the pairs layout's build: another refuses them, never misreads."""
    flags = ("-mno-avx512bf16", *NO_AMX)
    if cpu_kernels.linear_weight_only_bf16_supported(flags):
        pytest.fail("a build without AVX-512 BF16 says it unpacks the weight-only panels to bf16")
    panels = int4_case(40, 64, exact=True, seed=4)[0]
    with pytest.raises(ValueError, match="weight-only int4"):
        cpu_kernels.linear_int4_weights(torch.randn(2, 64).bfloat16(), panels, 40, 64,
                                        kernel=cpu_kernels.linear_kernel(flags))
    q, scales = cpu_packing.int8_codes(torch.randn(40, 64))
    with pytest.raises(ValueError, match="weight-only int8"):
        cpu_kernels.linear_int8_weights(torch.randn(2, 64).bfloat16(), cpu_packing.pack_int8_weight_panels(q, scales),
                                        40, 64, kernel=cpu_kernels.linear_kernel(flags))


@needs_kernel
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_only_weights_take_the_bf16_panels_where_cpu_paths_says(mode):
    """quant.quantize under bfloat16: the kernel's panels where cpu_paths.weight_only_bf16, torch's layouts
    elsewhere (and under float32 arithmetic, or int8 of K not a multiple of 32); the same linear either way."""
    from iterserve.model import quant
    torch.manual_seed(6)
    w = torch.randn(80, 128).bfloat16()  # torch's int4 layout takes outputs in 16s
    x = torch.randn(5, 128).bfloat16()
    served = quant.quantize(w, mode, torch.bfloat16)
    assert (quant.panel_tensor(served) is not None) == (cpu_paths.current().weight_only_bf16 or
                                                        cpu_kernels.linear_weight_only_supported())
    if cpu_paths.current().weight_only_bf16:
        assert quant.kernel_panels(served, torch.bfloat16)[1] == 8 + (mode == "int4")
        assert quant.panel_tensor(quant.quantize(w.float(), mode, torch.float32)) is None
        assert quant.panel_tensor(quant.quantize(torch.randn(40, 100).bfloat16(), "int8", torch.bfloat16)) is None
    if mode == "int8":
        q, scales = cpu_packing.int8_codes(w)
        grid = q.float() * scales[:, None]
    else:  # quantize_int4's min/max grid, its scale and minimum in bf16 as both layouts hold them
        wf = w.float().view(80, 4, 32)
        lo, scale = wf.amin(dim=-1), ((wf.amax(dim=-1) - wf.amin(dim=-1)) / 15).clamp(min=1e-10)
        q = torch.round((wf - lo[..., None]) / scale[..., None]).clamp(0, 15)
        grid = (q * scale.bfloat16().float()[..., None] + lo.bfloat16().float()[..., None]).view(80, 128)
    torch.testing.assert_close(linear(x, served).float(), F.linear(x.float(), grid), atol=0.15, rtol=2 ** -6)
