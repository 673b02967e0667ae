"""The pair layout of a bfloat16 cache (attention.py): the C write and pairs_to_rows agree on where
every value goes, and the decode kernel reads it in place to the row kernel's results (to a bf16
ulp) for every head dim, grouping, block size, window, soft-cap and slice of a long context, never
reading the unwritten half of a last pair."""
from __future__ import annotations

import pytest
import torch

from iterserve.model import cpu_kernels
from iterserve.model.attention import pairs_to_rows, rows_to_pairs, write_kv

needs_pairs = pytest.mark.skipif(not cpu_kernels.pairs_supported(64, 16, 8),
                                 reason="the pair layout needs the AVX-512 BF16 decode kernel")


def test_round_trip_is_exact():
    x = torch.randn(3, 2, 5, 16, 3, 64).to(torch.bfloat16)
    k, v = rows_to_pairs(x[:, 0], x[:, 1])
    assert not torch.equal(k, x[:, 0]) and not torch.equal(v, x[:, 1])
    back = pairs_to_rows(k, v)
    assert torch.equal(back[0], x[:, 0]) and torch.equal(back[1], x[:, 1])


def test_where_the_values_go():
    """K: dims (2i, 2i+1) of 16 positions side by side; V: 16 dims of two positions interleaved."""
    bs, hkv, d = 16, 2, 64
    rows = torch.arange(bs * hkv * d, dtype=torch.float32).view(1, bs, hkv, d)  # value = its row-major index
    k, v = rows_to_pairs(rows, rows)
    kf, vf = k.reshape(-1), v.reshape(-1)
    pos, head, dim = 5, 1, 9
    want = rows[0, pos, head, dim]
    assert kf[head * bs * d + (dim // 2) * bs * 2 + pos * 2 + dim % 2] == want
    assert vf[head * bs * d + (pos // 2) * d * 2 + dim * 2 + pos % 2] == want


@needs_pairs
@pytest.mark.parametrize("block_size", [16, 32])
def test_the_c_write_is_rows_to_pairs(block_size):
    torch.manual_seed(0)
    n, hkv, d = 6, 3, 64
    t = n * block_size - 5  # some slots stay unwritten; padding rows (-1) are skipped
    k, v = (torch.randn(t + 2, hkv, d).to(torch.bfloat16) for _ in range(2))
    slots = torch.cat([torch.randperm(n * block_size)[:t], torch.tensor([-1, -1])])
    cache = torch.zeros(2, n, block_size, hkv, d, dtype=torch.bfloat16)
    write_kv(cache, k, v, slots, use_kernel=True, pairs=True)
    rows = torch.zeros(2, n * block_size, hkv, d, dtype=torch.bfloat16)
    rows[0, slots[:t]], rows[1, slots[:t]] = k[:t], v[:t]
    want = rows_to_pairs(*(x.view(n, block_size, hkv, d) for x in rows))
    assert torch.equal(cache[0], want[0]) and torch.equal(cache[1], want[1])


def _decode(cache, tables, lens, q, pairs, window=0, softcap=0.0):
    return cpu_kernels.decode_attention(q, cache[0], cache[1], tables, lens, q.shape[-1] ** -0.5, 2,
                                        window=window, softcap=softcap, pairs=pairs).float()


@needs_pairs
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (64, 8, 8), (128, 8, 2), (64, 16, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (37, 0.0), (0, 20.0)])
def test_decode_over_pairs_agrees_with_rows(head_dim, heads, kv_heads, block_size, window, softcap):
    """Lengths from 1 to past two 512-position slices; odd ones end mid-pair. The pair pool's
    unwritten slots hold infinities: the kernel must never multiply one by a zero probability."""
    torch.manual_seed(1)
    lens = [1, 2, 15, 16, 17, 33, 100, 511, 1100]
    nb = [-(-n // block_size) for n in lens]
    total = sum(nb) + 3
    tables = torch.zeros(len(lens), max(nb), dtype=torch.int32)
    perm = torch.randperm(total)
    for b, (start, count) in enumerate(zip([sum(nb[:i]) for i in range(len(nb))], nb)):
        tables[b, :count] = perm[start:start + count].to(torch.int32)
    rows = torch.randn(2, total, block_size, kv_heads, head_dim).to(torch.bfloat16)
    pairs = torch.full_like(rows, float("inf"))
    k, v = rows.view(2, -1, kv_heads, head_dim)
    slots = torch.cat([tables[b, p // block_size].long() * block_size + p % block_size
                       for b, n in enumerate(lens) for p in torch.arange(n)[None]])
    write_kv(pairs, k[slots], v[slots], slots, use_kernel=True, pairs=True)
    q = torch.randn(len(lens), heads, head_dim).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = _decode(rows, tables, seq_lens, q, False, window, softcap)
    got = _decode(pairs, tables, seq_lens, q, True, window, softcap)
    assert got.isfinite().all()
    # the same products and P.V sums; Q.K sums in another order, which may move an output by a bf16 ulp
    torch.testing.assert_close(got, want, atol=1e-3, rtol=8e-3)


@needs_pairs
def test_shapes_without_a_pair_kernel_are_refused_not_read_as_rows():
    q = torch.randn(1, 4, 32).to(torch.bfloat16)
    cache = torch.zeros(2, 2, 16, 2, 32, dtype=torch.bfloat16)
    assert not cpu_kernels.pairs_supported(32, 16, 4) and not cpu_kernels.pairs_supported(64, 8, 4)
    with pytest.raises(ValueError, match="unsupported shape"):
        _decode(cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), q, True)
