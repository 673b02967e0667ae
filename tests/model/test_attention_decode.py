"""The CPU decode paths: head-major gather through scattered block tables into a reused workspace,
and the C++ kernel that reads the paged cache in place."""
from __future__ import annotations

import pytest
import torch

from iterserve.model import cpu_kernels
from iterserve.model.attention import Workspace, _decode, _kv_rows, build_plan, paged_attention
from iterserve.model.attention_metadata import AttentionMetadata

BS, H, HKV, D = 4, 6, 2, 8


def reference(q, k, v, scale, window=0, softcap=0.0):
    """One query at the end of k/v [L, Hkv, D]; window: it sees only the last `window` positions;
    softcap: scores = softcap * tanh(scores / softcap)."""
    if window:
        k, v = k[-window:], v[-window:]
    g = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("hd,lhd->hl", q.float(), k.float()) * scale
    p = (torch.tanh(s / softcap) * softcap if softcap else s).softmax(-1)
    return torch.einsum("hl,lhd->hd", p, v.float())


def decode_step(cache, seq_lens, tables, dtype, workspace=None, prompt_len=0, use_kernel=False):
    """Every sequence decodes one token (K/V of the earlier ones already cached), and optionally a
    fresh prompt rides along in the same batch. Returns (ours, want) for the decode rows."""
    q_lens = [1] * len(seq_lens) + ([prompt_len] if prompt_len else [])
    lens = seq_lens + ([prompt_len] if prompt_len else [])
    tabs = tables + ([[len(cache[0]) - 1 - i for i in range(-(-prompt_len // BS))]] if prompt_len else [])
    hkv, d = cache.shape[-2:]
    rnd = lambda s: torch.randn(s, hkv, d, dtype=dtype).to(cache.dtype).to(dtype)  # noqa: E731  # what the cache holds
    full = [(rnd(s), rnd(s)) for s in lens]
    slots, starts = [], [0]
    for (k, v), s, q, t in zip(full, lens, q_lens, tabs):
        for p in range(s - q):
            cache[0, t[p // BS], p % BS], cache[1, t[p // BS], p % BS] = k[p], v[p]
        slots += [t[p // BS] * BS + p % BS for p in range(s - q, s)]
        starts.append(starts[-1] + q)
    width = max(map(len, tabs))
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tabs], dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(lens), query_lens_list=q_lens, seq_lens_list=lens)
    qs = torch.randn(sum(q_lens), H, d, dtype=dtype)
    new = lambda i: torch.cat([x[i][s - q:] for x, s, q in zip(full, lens, q_lens)])  # noqa: E731
    out = paged_attention(qs, new(0), new(1), cache, build_plan(md, BS, dtype, workspace, use_kernel), 0.35)
    want = torch.stack([reference(qs[b], k, v, 0.35) for b, (k, v) in enumerate(full[: len(seq_lens)])])
    return out[: len(seq_lens)], want


def test_kv_rows_address_head_major_context():
    cache = torch.arange(10 * BS * HKV).view(10, BS, HKV)  # each (block, offset, head) holds its row number
    blocks = torch.tensor([[7, 2], [0, 9]])
    got = cache.view(-1)[_kv_rows(blocks, BS, HKV)].view(2, HKV, 2 * BS)
    want = cache[blocks].view(2, 2 * BS, HKV).transpose(1, 2)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_through_scattered_blocks(dtype, tol):
    torch.manual_seed(0)
    cache = torch.zeros(2, 32, BS, HKV, D, dtype=dtype)
    perm = torch.randperm(32).tolist()
    seq_lens = [1, 5, 13, 8]  # 1: a first decode with nothing but itself cached; 13: a partial last block
    tables = [perm[0:1], perm[1:3], perm[3:7], perm[7:9]]
    out, want = decode_step(cache, seq_lens, tables, dtype)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_workspace_is_reused_and_regrown_across_steps():
    torch.manual_seed(1)
    ws, cache = Workspace(), torch.zeros(2, 40, BS, HKV, D)
    perm = torch.randperm(39).tolist()  # block 39 is left for the prompt
    bufs = []
    for seq_lens, prompt_len in (([9, 3], 0), ([2], 0), ([16, 15, 7], 6), ([4, 4], 0)):
        tables, used = [], 0
        for s in seq_lens:
            n = -(-s // BS)
            tables.append(perm[used: used + n])
            used += n
        out, want = decode_step(cache, seq_lens, tables, torch.float32, ws, prompt_len)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        bufs.append(ws.buf)
    assert bufs[1] is bufs[0] and bufs[3] is bufs[2]  # a step that fits reuses the buffer
    assert bufs[2].numel() >= 2 * 3 * HKV * 16 * D  # grown for the largest step


needs_kernel = pytest.mark.skipif(cpu_kernels.decode_attention_kernel() is None, reason="no C++ compiler here")


@needs_kernel
@pytest.mark.parametrize("head_dim", [8, 64, 128])  # 8: the portable loop; 64, 128: the AVX-512 one where built
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("prompt_len", [0, 6])
def test_kernel_reads_scattered_blocks_in_place(head_dim, dtype, tol, prompt_len):
    torch.manual_seed(2)
    cache = torch.zeros(2, 64, BS, HKV, head_dim, dtype=dtype)
    perm = torch.randperm(60).tolist()  # the last blocks are left for the prompt
    seq_lens = [1, 5, 13, 16, 17, 40]  # lengths around block and 16-lane boundaries
    tables, used = [], 0
    for n in seq_lens:
        tables.append(perm[used: used + -(-n // BS)])
        used += len(tables[-1])
    out, want = decode_step(cache, seq_lens, tables, dtype, prompt_len=prompt_len, use_kernel=True)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("prompt_len", [0, 6])
def test_bfloat16_cache_under_float32_queries(use_kernel, head_dim, prompt_len):
    """bf16-storage: float32 queries over a bf16 cache, this step's K/V rounded as written, read widened."""
    if use_kernel and cpu_kernels.decode_attention_kernel() is None:
        pytest.skip("no C++ compiler here")
    torch.manual_seed(4)
    cache = torch.zeros(2, 64, BS, HKV, head_dim, dtype=torch.bfloat16)
    perm = torch.randperm(60).tolist()
    seq_lens = [1, 5, 13, 16, 17, 40]
    tables, used = [], 0
    for n in seq_lens:
        tables.append(perm[used: used + -(-n // BS)])
        used += len(tables[-1])
    out, want = decode_step(cache, seq_lens, tables, torch.float32, prompt_len=prompt_len, use_kernel=use_kernel)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (16, 2), (4, 4), (8, 1)])  # the P.V pass tiles query heads
def test_kernel_handles_every_query_head_grouping(head_dim, heads, kv_heads):
    torch.manual_seed(4)
    bs = 16
    q = torch.randn(3, heads, head_dim, dtype=torch.bfloat16)
    cache = torch.randn(2, 12, bs, kv_heads, head_dim, dtype=torch.bfloat16)
    tables = torch.randperm(12).to(torch.int32).view(3, 4).contiguous()
    seq_lens = torch.tensor([3, 33, 64], dtype=torch.int32)
    got = cpu_kernels.decode_attention(q, cache[0], cache[1], tables, seq_lens, 0.125, 2)
    for b in range(3):
        rows = [tables[b, p // bs].item() * bs + p % bs for p in range(seq_lens[b])]
        k, v = (cache[i].view(-1, kv_heads, head_dim)[rows] for i in (0, 1))
        torch.testing.assert_close(got[b].float(), reference(q[b], k, v, 0.125), atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 5])  # 5: slices of whole blocks that are not 16-aligned
@pytest.mark.parametrize("threads", [2, 3, 8])
def test_kernel_slices_long_contexts_the_same_whatever_the_batch(dtype, tol, block_size, threads):
    """A long context is cut into slices attended apart and merged (the flash-decoding reduction), a
    short one stays whole: against the reference. Where it is cut depends on its length alone, so each
    row's output is bit for bit the same alone, in a batch and on any number of threads (what keeps
    greedy tokens equal with speculation on and off)."""
    torch.manual_seed(5)
    heads, kv_heads, head_dim = 9, 3, 64
    lens = [2000, 37, 700]  # 2000: four slices; 37: whole; 700: two
    blocks = [-(-n // block_size) for n in lens]
    cache = torch.randn(2, sum(blocks) + 3, block_size, kv_heads, head_dim, dtype=dtype)
    cache[0, :, :, :, :] *= 2  # sharper softmax: slices with very different maxima
    order = torch.randperm(sum(blocks) + 3)[: sum(blocks)].to(torch.int32)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for b, first in enumerate([0, blocks[0], blocks[0] + blocks[1]]):
        tables[b, : blocks[b]] = order[first:first + blocks[b]]
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = cpu_kernels.decode_attention(q, cache[0], cache[1], tables, seq_lens, 0.125, threads)
    one_thread = cpu_kernels.decode_attention(q, cache[0], cache[1], tables, seq_lens, 0.125, 1)
    assert torch.equal(got, one_thread)
    for b, n in enumerate(lens):
        alone = cpu_kernels.decode_attention(q[b:b + 1], cache[0], cache[1], tables[b:b + 1], seq_lens[b:b + 1],
                                             0.125, threads)
        assert torch.equal(alone[0], got[b])
        rows = [tables[b, p // block_size].item() * block_size + p % block_size for p in range(n)]
        k, v = (cache[i].view(-1, kv_heads, head_dim)[rows] for i in (0, 1))
        torch.testing.assert_close(got[b].float(), reference(q[b], k, v, 0.125), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_queries_in_place_from_wider_rows(dtype):
    """q as the model passes it: a view of the fused qkv rows (row stride (H + 2 Hkv) * D), not copied."""
    torch.manual_seed(6)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    qkv = torch.randn(4, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(4, heads, head_dim)
    assert not q.is_contiguous()
    cache = torch.randn(2, 16, bs, kv_heads, head_dim, dtype=dtype)
    tables = torch.randperm(16).to(torch.int32).view(4, 4).contiguous()
    seq_lens = torch.tensor([1, 20, 64, 47], dtype=torch.int32)
    got = cpu_kernels.decode_attention(q, cache[0], cache[1], tables, seq_lens, 0.125, 2)
    want = cpu_kernels.decode_attention(q.contiguous(), cache[0], cache[1], tables, seq_lens, 0.125, 2)
    assert got.is_contiguous() and torch.equal(got, want)


@needs_kernel
def test_kernel_rejects_shapes_it_does_not_handle():
    q = torch.zeros(1, 40, 8)  # 40 query heads on 2 kv heads: a group of 20 is past its limit
    cache = torch.zeros(4, BS, 2, 8)
    with pytest.raises(ValueError, match="unsupported shape"):
        cpu_kernels.decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                     torch.ones(1, dtype=torch.int32), 1.0, 1)


@needs_kernel
# the paths other CPUs take: AVX-512 without bf16 dot products, AVX2, neither (the portable loops)
@pytest.mark.parametrize("flags", [("-mno-avx512bf16",), ("-mno-avx512f",), ("-mno-avx2", "-mno-avx512f")])
@pytest.mark.parametrize("dtype,cache_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                   (torch.bfloat16, torch.bfloat16, 2e-2),
                                                   (torch.float32, torch.bfloat16, 1e-5)])
def test_kernel_builds_without_avx512_bf16_or_avx512_and_agrees(flags, dtype, cache_dtype, tol):
    kernel = cpu_kernels.decode_attention_kernel(flags)
    assert kernel is not None
    torch.manual_seed(3)
    q = torch.randn(5, H, 64, dtype=dtype)
    cache = torch.randn(2, 40, BS, HKV, 64, dtype=cache_dtype)
    tables = torch.randperm(40).to(torch.int32).view(5, 8).contiguous()
    seq_lens = torch.tensor([1, 7, 16, 17, 32], dtype=torch.int32)
    got = cpu_kernels.decode_attention(q, cache[0], cache[1], tables, seq_lens, 0.35, 2, kernel=kernel)
    for b in range(5):
        rows = [tables[b, p // BS].item() * BS + p % BS for p in range(seq_lens[b])]
        k, v = (cache[i].view(-1, HKV, 64)[rows] for i in (0, 1))
        torch.testing.assert_close(got[b].float(), reference(q[b], k, v, 0.35), atol=tol, rtol=tol)


def test_a_kernel_that_cannot_be_built_or_loaded_means_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_kernels.decode_attention_kernel.cache_clear()
    try:
        assert cpu_kernels.decode_attention_kernel() is None  # a compiler that is not there
        cpu_kernels.decode_attention_kernel.cache_clear()
        monkeypatch.setenv("CXX", "false")  # a compiler that fails
        assert cpu_kernels.decode_attention_kernel() is None
        cpu_kernels.decode_attention_kernel.cache_clear()
        monkeypatch.delenv("CXX")
        monkeypatch.setenv("ITERSERVE_CPU_KERNELS", "0")
        assert cpu_kernels.decode_attention_kernel() is None
    finally:
        cpu_kernels.decode_attention_kernel.cache_clear()


@pytest.mark.parametrize("path", ["torch", "kernel", "avx2", "portable"])  # gather + matmuls; the C++ kernel as built
@pytest.mark.parametrize("head_dim", [8, 64])  # D=8 runs the portable loops in every build
@pytest.mark.parametrize("window,softcap", [(3, 0.0), (6, 0.0), (13, 0.0), (700, 0.0), (6, 2.0), (0, 2.0)])
def test_window_and_softcap_in_every_decode_path(path, head_dim, window, softcap):
    """A windowed layer sees only the last `window` positions (block-aligned or not, shorter and
    longer than the context; 700 of 2000 is split into slices that start at the window's block),
    and Gemma 2's soft-capping, on every decode path."""
    if path != "torch" and cpu_kernels.decode_attention_kernel() is None:
        pytest.skip("no C++ compiler here")
    torch.manual_seed(7)
    lens = [1, 5, 13, 40, 2000]
    blocks = [-(-n // BS) for n in lens]
    cache = torch.randn(2, sum(blocks), BS, HKV, head_dim)
    order = torch.randperm(sum(blocks)).to(torch.int32)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for b, n in enumerate(blocks):
        tables[b, :n] = order[sum(blocks[:b]): sum(blocks[:b]) + n]
    q = torch.randn(len(lens), H, head_dim)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if path == "torch":
        md = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
                               query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32), seq_lens=seq_lens,
                               block_tables=tables, max_query_len=1, max_seq_len=max(lens),
                               query_lens_list=[1] * len(lens), seq_lens_list=lens)
        got = _decode(q, cache, build_plan(md, BS, torch.float32), 0.35, window, softcap)
    else:
        flags = {"kernel": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx2", "-mno-avx512f")}[path]
        kernel = cpu_kernels.decode_attention_kernel(flags)
        got = cpu_kernels.decode_attention(q, cache[0], cache[1], tables, seq_lens, 0.35, 8, kernel=kernel,
                                           window=window, softcap=softcap)
    for b, n in enumerate(lens):
        rows = [tables[b, p // BS].item() * BS + p % BS for p in range(n)]
        k, v = (cache[i].view(-1, HKV, head_dim)[rows] for i in (0, 1))
        torch.testing.assert_close(got[b], reference(q[b], k, v, 0.35, window, softcap), atol=1e-5, rtol=1e-5)
