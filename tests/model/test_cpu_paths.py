"""cpu_paths, the one place that decides a CPU's kernel path: what it picks for each kind of x86 CPU,
that this machine's builds run what it says, and the AMX tiles against the vdpbf16ps tiles they replace."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from iterserve.model import cpu_build, cpu_kernels, cpu_packing, cpu_paths

ZEN3 = b"flags : fpu sse2 avx fma avx2 bmi2"
SKYLAKE_X = ZEN3 + b" avx512f avx512bw avx512_vnni"
ZEN4 = SKYLAKE_X + b" avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + b" amx_bf16 amx_tile amx_int8"
ALL = dict(kernels=True, pairs=True, amx=True, w8a8=True, weight_only=False)


@pytest.mark.parametrize("flags,isa,dtype,layout,amx", [
    (b"flags : fpu sse2", "baseline", "bf16-storage", "plain", False),
    (ZEN3, "avx2", "bf16-storage", "plain", False),
    (SKYLAKE_X, "avx512", "bf16-storage", "plain", False),
    (ZEN4, "avx512_bf16", "bfloat16", "pairs", False),
    (SAPPHIRE_RAPIDS, "amx", "bfloat16", "pairs", True),
])
def test_each_kind_of_cpu_gets_its_path(flags, isa, dtype, layout, amx):
    """A build that takes everything: the CPU's flags decide. bfloat16 runs natively from AVX-512 BF16 on,
    in the pairs panels (on AMX tiles too where there are some); below, bf16 weights widen under float32."""
    paths = cpu_paths.decide(flags, **{**ALL, "amx": amx})
    assert (paths.isa, paths.default_dtype, paths.bf16_layout, paths.amx_tiles) == (isa, dtype, layout, amx)
    assert paths.decode_loop and paths.isa in paths.summary()


def test_what_the_build_lacks_the_cpu_does_not_get():
    """An AMX CPU under a build without the pairs layout (-mno-avx512bf16, an old compiler) keeps bfloat16
    weights in oneDNN's layout, so no C decode loop; no kernels at all: float32 through torch."""
    no_pairs = cpu_paths.decide(SAPPHIRE_RAPIDS, **{**ALL, "pairs": False})
    assert no_pairs.bf16_layout is None and not no_pairs.amx_tiles and not no_pairs.decode_loop
    bare = cpu_paths.decide(SAPPHIRE_RAPIDS, kernels=False, pairs=False, amx=False, w8a8=False, weight_only=False)
    assert bare.default_dtype == "bfloat16" and bare.bf16_layout is None and not bare.w8a8


def test_weight_only_panels_unpack_to_bf16_where_the_pairs_build():
    """Weight-only int8/int4 unpack into the pairs panels' layout, for the AMX tiles or vdpbf16ps (Zen 4): a
    build that takes them gives them only with the pairs layout, and summary() says so."""
    for amx in (True, False):
        on = cpu_paths.decide(SAPPHIRE_RAPIDS if amx else ZEN4, **{**ALL, "amx": amx}, weight_only_bf16=True)
        assert on.weight_only_bf16 and "int8/int4 panels unpacked to bf16" in on.summary()
    for caps in ({"pairs": False}, {"kernels": False}):
        assert not cpu_paths.decide(SAPPHIRE_RAPIDS, **{**ALL, **caps}, weight_only_bf16=True).weight_only_bf16


def test_this_machine_runs_what_cpu_paths_says():
    paths = cpu_paths.current()
    assert paths == cpu_paths.decide(cpu_build.cpu_flags(), kernels=paths.kernels, pairs=paths.bf16_layout == "pairs",
                                     amx=paths.amx_tiles, w8a8=paths.w8a8, weight_only=paths.weight_only_panels,
                                     weight_only_bf16=paths.weight_only_bf16)
    assert paths.kernels == (cpu_kernels.linear_kernel() is not None)
    assert paths.weight_only_bf16 == (paths.kernels and cpu_kernels.linear_pairs_supported() and
                                      cpu_kernels.linear_weight_only_bf16_supported())
    if paths.isa in ("avx512", "avx512_bf16", "amx") and paths.kernels:
        assert cpu_kernels.linear_int8_supported() == paths.w8a8
    from iterserve.executor.dtypes import pick_dtype  # --dtype auto follows it
    assert pick_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if paths.bf16_arithmetic else torch.float32)


@pytest.mark.slow
def test_iterserve_env_prints_the_paths():
    out = subprocess.run([sys.executable, "-m", "iterserve.cli", "env", "--json"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    info = json.loads(out)
    assert info["paths"]["isa"] == cpu_paths.current().isa and info["summary"] == cpu_paths.current().summary()


NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
needs_amx = pytest.mark.skipif(not cpu_kernels.linear_amx_supported(), reason="AMX tiles: this CPU or OS has none")


@needs_amx
@pytest.mark.parametrize("m", [1, 3, 4, 15, 16, 17, 31, 32, 33, 70])
@pytest.mark.parametrize("n,k", [(70, 64), (96, 576), (1, 32), (33, 30)])
def test_amx_tiles_sum_the_pairs_as_the_vdpbf16ps_tiles_do(m, n, k):
    """Blocks of 32 and 16 rows and a zero-padded last partial one, a last partial panel, bias or none,
    rows read in place with a stride; K not a multiple of 32 stays on vdpbf16ps. Both float32 sums of the same bf16 products, rounded once: within a bf16 ulp of each
    other and of torch's float32 product."""
    assert not cpu_kernels.linear_amx_supported(NO_AMX) and cpu_kernels.linear_pairs_supported(NO_AMX)
    torch.manual_seed(m * 7 + n + k)
    w, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(m, 2, k).bfloat16()[:, 1]
    panels = cpu_packing.pack_panels(w, pairs=True)
    for b in (None, bias):
        got = cpu_kernels.linear(x, panels, n, b)
        dpbf16 = cpu_kernels.linear(x, panels, n, b, cpu_kernels.linear_kernel(NO_AMX))
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        for y in (got, dpbf16):
            torch.testing.assert_close(y.float(), want, atol=1e-5, rtol=2 ** -7)
        assert (got != want.bfloat16()).float().mean() < 0.02


@needs_amx
def test_amx_keeps_a_nan_in_its_row():
    w, x = torch.randn(64, 64).bfloat16(), torch.randn(20, 64).bfloat16()
    x[5, 9] = float("nan")
    got = cpu_kernels.linear(x, cpu_packing.pack_panels(w, pairs=True), 64)
    assert got[5].isnan().all() and not got[torch.arange(20) != 5].isnan().any()


@pytest.mark.skipif(cpu_kernels.linear_weight_only_supported() or cpu_kernels.linear_weight_only_supported(
    ("-mno-avx512f",)) is False, reason="this CPU runs the weight-only panels natively (the tests run there)")
@pytest.mark.slow
def test_a_wider_cpu_runs_the_avx2_paths_under_a_cap():
    """On an AVX-512 CPU the decode loop's weight-only int8/int4 cases skip (their panels are the AVX2
    build's): ITERSERVE_CPU_ISA=avx2 runs them here as a Zen 3 would, and cpu_paths says avx2."""
    env = {**os.environ, "ITERSERVE_CPU_ISA": "avx2"}
    probe = subprocess.run([sys.executable, "-m", "iterserve.cli", "env", "--json"], capture_output=True, text=True,
                           timeout=120, check=True, env=env).stdout
    paths = json.loads(probe)["paths"]
    assert (paths["isa"], paths["weight_only_panels"], paths["amx_tiles"]) == ("avx2", True, False)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",  # not the bf16 panels' cases
                          "(auto-int8 or int8-int8 or int4) and not bfloat16-auto and not bfloat16-int8-int4",
                          "tests/model/test_cpu_decode.py::test_decode_steps_in_c_give_the_python_loops_logits_and_cache"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stdout[-3000:]
    assert "24 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-1000:]


@needs_amx
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """One row alone, in a block of 16, in 32 + a partial block: the same bits (a speculative verify step
    and a decode step must agree), on AMX tiles as on vdpbf16ps."""
    w, x = torch.randn(96, 576).bfloat16(), torch.randn(40, 576).bfloat16()
    panels = cpu_packing.pack_panels(w, pairs=True)
    for kernel in (None, cpu_kernels.linear_kernel(NO_AMX)):
        alone = torch.cat([cpu_kernels.linear(x[i:i + 1], panels, 96, None, kernel) for i in range(40)])
        for m in (2, 16, 33, 40):
            assert torch.equal(cpu_kernels.linear(x[:m], panels, 96, None, kernel), alone[:m])
