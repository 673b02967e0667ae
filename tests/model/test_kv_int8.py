"""The int8 KV cache at the kernel level: quantize/dequantize (the torch reference), the C++ write
byte for byte against it, and the C++ decode kernel reading int8 blocks in place against attention
over the dequantized cache; paged attention's mixed batches through both paths."""
from __future__ import annotations

import pytest
import torch

from iterserve.model import cpu_kernels
from iterserve.model.attention import build_plan, paged_attention, write_kv
from iterserve.model.kv_quant import SCALE_BYTES, dequantize_kv, head_dim_of, quantize_kv
from tests.model.test_attention_decode import reference
from tests.model.test_llama import BS, metadata, reference_attention

needs_kernel = pytest.mark.skipif(cpu_kernels.decode_attention_int8_kernel() is None, reason="no C++ compiler here")
needs_ops = pytest.mark.skipif(cpu_kernels.elementwise_ops() is None, reason="no C++ compiler here")


def int8_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, scale: float = 1.0) -> torch.Tensor:
    """[2, blocks, block_size, Hkv, head_dim + 4]: random K/V quantized (rows of different magnitudes)."""
    x = torch.randn(2, num_blocks, block_size, kv_heads, head_dim) * scale
    x *= torch.rand(2, num_blocks, block_size, kv_heads, 1) * 4 + 0.1
    return quantize_kv(x)


def test_quantize_round_trip_within_half_a_step_and_scale_inline():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 10
    x[7, 1] = 0.0  # an all-zero row: zeros back, not NaN
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 64 + SCALE_BYTES) and head_dim_of(rows) == 64
    scale = rows[..., 64:].view(torch.float32)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True).div(127).clamp_min(torch.finfo().tiny))
    assert rows[..., :64].abs().max() <= 127
    back = dequantize_kv(rows, torch.float32)
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-5)).all()
    assert torch.equal(back[7, 1], torch.zeros(64))
    assert dequantize_kv(rows, torch.bfloat16).dtype == torch.bfloat16


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_write_is_byte_for_byte_the_torch_quantizer(dtype):
    """k/v as the model passes them (views of the fused qkv rows), a skipped slot (-1), scattered slots."""
    torch.manual_seed(1)
    t, hkv, d, nblk = 11, 3, 64, 8
    qkv = (torch.randn(t, (9 + 2 * hkv) * d) * torch.rand(t, 1) * 5).to(dtype)
    k = qkv[:, 9 * d: (9 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (9 + hkv) * d:].view(t, hkv, d)
    slots = torch.randperm(nblk * BS)[:t]
    slots[4] = -1
    ours = torch.zeros(2, nblk, BS, hkv, d + SCALE_BYTES, dtype=torch.int8)
    cpu_kernels.write_kv_int8(ours[0], ours[1], k, v, slots)
    want = torch.zeros_like(ours)
    keep = slots >= 0
    write_kv(want, k[keep], v[keep], slots[keep], use_kernel=False)
    assert torch.equal(ours, want)
    assert ours.view(2, -1, hkv, d + SCALE_BYTES)[:, slots[keep]].ne(0).any(-1).all()  # every written row has data


def decode_against_dequantized(cache, q, tables, seq_lens, scale, threads, kernel=None, window=0, softcap=0.0):
    got = cpu_kernels.decode_attention(q, cache[0], cache[1], tables, seq_lens, scale, threads, kernel=kernel,
                                       window=window, softcap=softcap)
    bs, hkv = cache.shape[2], cache.shape[3]
    wide = dequantize_kv(cache, torch.float32)
    for b in range(q.shape[0]):
        rows = [tables[b, p // bs].item() * bs + p % bs for p in range(seq_lens[b])]
        k, v = (wide[i].view(-1, hkv, wide.shape[-1])[rows] for i in (0, 1))
        want = reference(q[b], k, v, scale, window, softcap)
        tol = 1e-5 if q.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[b].float(), want, atol=tol, rtol=tol)
    return got


@needs_kernel
@pytest.mark.parametrize("head_dim", [8, 64, 128])  # 8: the portable loop; 64, 128: the AVX-512 one where built
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4)])
def test_kernel_reads_int8_blocks_in_place(head_dim, dtype, heads, kv_heads):
    torch.manual_seed(2)
    cache = int8_cache(64, BS, kv_heads, head_dim)
    lens = [1, 5, 13, 16, 17, 40]  # around block and 16-lane boundaries
    tables = torch.randperm(64)[: len(lens) * 10].view(len(lens), 10).to(torch.int32).contiguous()
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    decode_against_dequantized(cache, q, tables, torch.tensor(lens, dtype=torch.int32), 0.125, 2)


@needs_kernel
@pytest.mark.parametrize("window,softcap", [(7, 0.0), (0, 2.0), (20, 1.5)])
def test_kernel_int8_windowed_and_soft_capped(window, softcap):
    torch.manual_seed(3)
    cache = int8_cache(40, BS, 3, 64)
    tables = torch.randperm(40).view(4, 10).to(torch.int32).contiguous()
    q = torch.randn(4, 9, 64)
    decode_against_dequantized(cache, q, tables, torch.tensor([3, 17, 33, 40], dtype=torch.int32), 0.125, 2,
                               window=window, softcap=softcap)


@needs_kernel
@pytest.mark.parametrize("threads", [2, 8])
def test_kernel_int8_splits_long_contexts_of_small_batches(threads):
    """Fewer sequences than threads: slices attended apart and merged, over int8 blocks too."""
    torch.manual_seed(4)
    bs, lens = 16, [1500, 37]
    blocks = [-(-n // bs) for n in lens]
    cache = int8_cache(sum(blocks), bs, 3, 64, scale=2.0)
    order = torch.randperm(sum(blocks)).to(torch.int32)
    tables = torch.zeros(2, max(blocks), dtype=torch.int32)
    tables[0, : blocks[0]], tables[1, : blocks[1]] = order[: blocks[0]], order[blocks[0]:]
    q = torch.randn(2, 9, 64)
    decode_against_dequantized(cache, q, tables, torch.tensor(lens, dtype=torch.int32), 0.125, threads)


@needs_kernel
# AVX-512 without VNNI (the integer Q.K of a bf16 query on vpmaddwd); AVX2; the portable loops
@pytest.mark.parametrize("flags", [("-mno-avx512vnni",), ("-mno-avx512f",), ("-mno-avx2", "-mno-avx512f")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_int8_builds_without_avx512_and_agrees(flags, dtype):
    kernel = cpu_kernels.decode_attention_int8_kernel(flags)
    assert kernel is not None
    torch.manual_seed(5)
    cache = int8_cache(40, BS, 2, 64)
    tables = torch.randperm(40).to(torch.int32).view(5, 8).contiguous()
    q = torch.randn(5, 6, 64, dtype=dtype)
    decode_against_dequantized(cache, q, tables, torch.tensor([1, 7, 16, 17, 32], dtype=torch.int32), 0.35, 2,
                               kernel=kernel)


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("window", [0, 6])
def test_paged_attention_on_an_int8_cache_matches_attention_over_its_values(use_kernel, window):
    """A decode, a fresh prompt, a later chunk and another decode in one flat batch, written into and
    read from an int8 cache: every row attends to the stored (quantized) K/V, its own included, the
    fresh prompt too, through the torch gather and the C++ kernels alike."""
    if use_kernel and (cpu_kernels.decode_attention_int8_kernel() is None or cpu_kernels.elementwise_ops() is None):
        pytest.skip("no C++ compiler here")
    torch.manual_seed(6)
    H, HKV, D = 4, 2, 64
    seq_lens, q_lens = [9, 5, 11, 3], [1, 5, 4, 1]
    tables = [[3, 0, 7], [1, 2], [4, 5, 6], [8]]
    cache = torch.zeros(2, 10, BS, HKV, D + SCALE_BYTES, dtype=torch.int8)
    full_k = [torch.randn(s, HKV, D) for s in seq_lens]
    full_v = [torch.randn(s, HKV, D) for s in seq_lens]
    for t, s, q, k, v in zip(tables, seq_lens, q_lens, full_k, full_v):  # earlier steps' K/V
        for p in range(s - q):
            cache[0, t[p // BS], p % BS], cache[1, t[p // BS], p % BS] = quantize_kv(k[p]), quantize_kv(v[p])
    qs = [torch.randn(q, H, D) for q in q_lens]
    new = lambda xs: torch.cat([x[s - q:] for x, s, q in zip(xs, seq_lens, q_lens)])  # noqa: E731
    plan = build_plan(metadata(q_lens, seq_lens, tables), BS, torch.float32, use_kernel=use_kernel)
    out = paged_attention(torch.cat(qs), new(full_k), new(full_v), cache, plan, 0.3, window)
    stored = lambda x: dequantize_kv(quantize_kv(x), torch.float32)  # noqa: E731
    want = torch.cat([reference_attention(q, stored(k), stored(v), 0.3, window)
                      for q, k, v in zip(qs, full_k, full_v)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    exact = torch.cat([reference_attention(q, k, v, 0.3, window) for q, k, v in zip(qs, full_k, full_v)])
    assert (out - exact).abs().max() < 0.05  # int8's error, small against values of order 1
