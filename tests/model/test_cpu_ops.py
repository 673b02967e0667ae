"""The fused C++ elementwise ops (cpu_ops.cpp) against the torch ops they replace in llama.py."""
from __future__ import annotations

import shutil
import threading

import pytest
import torch
import torch.nn.functional as F

from iterserve.model import cpu_build, cpu_kernels
from iterserve.model.llama import _rope

needs_ops = pytest.mark.skipif(cpu_kernels.elementwise_ops() is None, reason="cpu_ops.cpp not built here")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler here")
def test_every_kernel_builds_where_there_is_a_compiler():
    """Otherwise a compile error would only show as skipped tests and a slower torch fallback."""
    assert cpu_kernels.elementwise_ops() is not None
    assert cpu_kernels.decode_attention_kernel() is not None
    assert cpu_kernels.prompt_attention_kernel() is not None


FAKE_COMPILER = """#!/bin/sh
# Logs its start, then finishes only once every build has started (each waits for the others: a
# sequential build would fail here), and links an empty library at the -o path.
echo start >> "{log}"
i=0
while [ "$(grep -c start "{log}")" -lt {n} ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i + 1)); done
[ "$(grep -c start "{log}")" -ge {n} ] || exit 1
while [ "$1" != "-o" ]; do shift; done
echo 'int iterserve_fake;' | {cxx} -shared -fPIC -x c++ - -o "$2"
"""


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path):
    """FAKE_COMPILER as CXX over an empty (cold) kernel cache; its log of starts."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    log, compiler = tmp_path / "compiles.log", tmp_path / "fake-cxx"
    compiler.write_text(FAKE_COMPILER.format(log=log, n=len(cpu_build.DEFAULT_BUILDS), cxx=shutil.which("g++")))
    compiler.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(compiler))
    return log


def test_prebuild_compiles_every_library_side_by_side_once(fake_compiler):
    """A cold start's compiles run at once (prebuild), and a kernel's own build waits for its compile
    under way instead of starting a second."""
    log, n = fake_compiler, len(cpu_build.DEFAULT_BUILDS)
    cpu_build.prebuild()
    assert all(cpu_build._build(source, flags) is not None for source, flags in cpu_build.DEFAULT_BUILDS)
    assert log.read_text().count("start") == n
    cpu_build.prebuild()  # built and cached: nothing compiles again
    assert cpu_build._build(*cpu_build.DEFAULT_BUILDS[0]) is not None
    assert log.read_text().count("start") == n


def test_prebuild_at_install_returns_with_every_library_built(fake_compiler):
    cpu_build.prebuild(wait=True)
    assert sorted(p.name.split("-")[0] for p in cpu_build.cache_dir().glob("*.so")) == \
        sorted(source.stem for source, _ in cpu_build.DEFAULT_BUILDS)


def test_no_compiler_is_said_once(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ or c++ on it
    monkeypatch.setattr(cpu_build, "_no_compiler_said", threading.Event())
    with caplog.at_level("WARNING", logger="iterserve.model"):
        for _ in range(3):
            cpu_build.prebuild()
        assert all(cpu_build._build(source, flags) is None for source, flags in cpu_build.DEFAULT_BUILDS)
    assert sum("no C++ compiler" in r.getMessage() for r in caplog.records) == 1


def torch_rms_norm(x, weight, eps):
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def assert_close_to_rounding(got, want):
    """Equal up to a last-bit difference in a float sum or exp, which can flip a bf16 rounding."""
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2 ** -6)  # a flip, then the weight product
        assert (got != want).float().mean() < 0.01  # nearly all bit-identical
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows: past the size where it runs threaded
def test_rms_norm_matches_torch(dtype, rows):
    torch.manual_seed(0)
    x, w = torch.randn(rows, 584, dtype=dtype) * 30, torch.randn(584, dtype=dtype)  # 584: vectors and a tail
    assert_close_to_rounding(cpu_kernels.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5))


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_the_residual_in_place_first(dtype):
    torch.manual_seed(1)
    x, residual, w = torch.randn(9, 64, dtype=dtype), torch.randn(9, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    total = residual + x
    got = cpu_kernels.rms_norm(x, w, 1e-6, residual)
    assert torch.equal(residual, total)  # the residual stream now holds the sum, rounded as torch's add
    assert_close_to_rounding(got, torch_rms_norm(total, w, 1e-6))


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rope_in_place_matches_torch_and_leaves_v_alone(dtype, head_dim):
    torch.manual_seed(2)
    heads, kv_heads, rows = 6, 2, 11
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.randint(0, 500, (rows,))
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(512).float(), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos().to(dtype), torch.cat([freqs, freqs], -1).sin().to(dtype)
    n = (heads + kv_heads) * head_dim
    want = _rope(qkv[:, :n].view(rows, -1, head_dim), cos[positions], sin[positions]).reshape(rows, n)
    got = qkv.clone()
    cpu_kernels.rope_(got, heads + kv_heads, head_dim, cos, sin, positions)
    assert torch.equal(got[:, :n], want)  # no sums: bit-identical to torch's op-by-op rounding
    assert torch.equal(got[:, n:], qkv[:, n:])


# The vector loop this CPU takes (AVX-512 or AVX2), the AVX2 one where it has both, and the portable one.
VECTOR_PATHS = pytest.mark.parametrize("flags", [(), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")],
                                       ids=["native", "no-avx512", "portable"])


@needs_ops
@VECTOR_PATHS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_silu_mul_matches_torch(dtype, rows, flags):
    torch.manual_seed(3)
    gate_up = torch.randn(rows, 2 * 1548, dtype=dtype) * 4  # 16- and 8-wide vectors, then a scalar tail
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close_to_rounding(cpu_kernels.silu_mul(gate_up, cpu_kernels.elementwise_ops(flags)), F.silu(gate) * up)


@needs_ops
@VECTOR_PATHS
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_takes_the_first_maximum_like_torch(dtype, flags):
    torch.manual_seed(4)
    x = torch.randn(6, 1000, dtype=dtype)
    x[1, 10] = x[1, 900] = 50.0  # a tie: the first one wins
    x[2] = float("-inf")  # nothing but -inf: index 0
    x[3, 999] = 60.0  # in the tail past the last full 16
    x[4, 5], x[4, 700] = 70.0, float("nan")  # a NaN counts as the maximum, as in torch
    x[5, :3] = float("nan")
    want = x.float().max(dim=-1).indices.tolist()
    assert cpu_kernels.argmax_rows(x, cpu_kernels.elementwise_ops(flags)) == want == [want[0], 10, 0, 999, 700, 0]


@needs_ops
@pytest.mark.parametrize("dtype,cache_dtype", [(d, d) for d in DTYPES] + [(torch.float32, torch.bfloat16)])
def test_write_kv_copies_strided_rows_to_their_slots_and_skips_padding(dtype, cache_dtype):
    """float32 rows into a bfloat16 cache (bf16-storage) are rounded as torch's .to() rounds them."""
    torch.manual_seed(5)
    cache = torch.zeros(2, 8, 4, 2, 16, dtype=cache_dtype)  # [K/V, blocks, block_size, Hkv, D]
    qkv = torch.randn(5, 6 * 16, dtype=dtype)
    qkv[0, 32:34] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8])  # ties to even, down and up
    k, v = qkv[:, 32:64].view(5, 2, 16), qkv[:, 64:].view(5, 2, 16)  # rows 96 elements apart, like the model's
    slots = torch.tensor([3, 17, -1, 30, 4])
    cpu_kernels.write_kv(cache[0], cache[1], k, v, slots)
    want = torch.zeros_like(cache)
    keep = slots >= 0
    want[0].view(32, 2, 16)[slots[keep]] = k[keep].to(cache_dtype)
    want[1].view(32, 2, 16)[slots[keep]] = v[keep].to(cache_dtype)
    assert torch.equal(cache, want)
