"""The Triton kernels against a plain torch reference, run in Triton's CPU interpreter.

TRITON_INTERPRET=1 only takes effect if it is set before triton is first imported (triton wraps its
own library functions at import), and in a full pytest run something may have imported triton
already. So the cases run in one child process started with that variable set (run this file as a
script to do so by hand); pytest gets one test per case from the child's JSON report.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import traceback
from typing import Callable

import pytest
import torch

from iterserve.model.attention_metadata import AttentionMetadata
from iterserve.model.triton_attention import paged_attention_triton, write_kv_triton

BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
CASES: dict[str, Callable[[], None]] = {}


def case(fn: Callable[[], None]) -> Callable[[], None]:
    CASES[fn.__name__] = fn
    return fn


def make_batch(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, seed: int = 0):
    """Random q and cache; each request gets distinct blocks in a shuffled (non-contiguous) order."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few unused blocks, so stray reads would show
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    slots = []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for p in range(seq_len - q_len, seq_len):
            slots.append(int(block_tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_list=list(q_lens), seq_lens_list=list(seq_lens))
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, meta


def reference_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
                        softcap: float = 0.0) -> torch.Tensor:
    """fp32, one request at a time, context gathered position by position, explicit causal mask
    (and window: keys `window` or more behind a query masked; softcap: Gemma 2's score capping)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    group = q.shape[1] // k_cache.shape[2]
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        start = int(meta.query_start_loc[b])
        pos = torch.arange(seq_len)
        blocks = meta.block_tables[b, pos // BLOCK_SIZE].long()
        k = k_cache[blocks, pos % BLOCK_SIZE].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[blocks, pos % BLOCK_SIZE].float().repeat_interleave(group, dim=1)
        qb = q[start:start + q_len].float()  # [q, H, D]
        scores = torch.einsum("qhd,lhd->hql", qb, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len)
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if window:
            hidden |= q_pos[None, :, None] - pos[None, None, :] >= window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:start + q_len] = torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)
    return out


def check(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0, window=0, softcap=0.0):
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed)
    scale = head_dim ** -0.5
    out = paged_attention_triton(q, k_cache, v_cache, meta, scale, window, softcap)
    ref = reference_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.float() - ref).abs().max().item()
    assert err < TOLERANCE[dtype], f"max abs error {err}"


@case
def pure_decode_gqa():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        check([1] * 5, [1, 17, 40, 64, 100], num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype)


@case
def mixed_prefill_and_decode():
    # a fresh prompt, a decode, a later chunk of a prompt (cached context + new tokens), a decode
    for dtype in (torch.float32, torch.bfloat16):
        check([23, 1, 9, 1], [23, 70, 41, 16], num_heads=4, num_kv_heads=2, head_dim=128, dtype=dtype, seed=1)


@case
def long_prompt_spans_query_blocks():
    # 70 query tokens over several query blocks, the last one partial
    check([70, 3], [90, 3], num_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float32, seed=2)


@case
def head_groupings():
    # plain MHA, a non-power-of-two group (3), MQA
    for heads, kv_heads in ((4, 4), (6, 2), (8, 1)):
        check([1, 5, 1], [33, 12, 7], heads, kv_heads, head_dim=64, dtype=torch.float32, seed=3)


@case
def head_dim_not_power_of_two():
    check([1, 4], [20, 9], num_heads=2, num_kv_heads=1, head_dim=80, dtype=torch.float32, seed=4)


@case
def sliding_window_and_softcap():
    # windows shorter than a tile (BLOCK_N 64) and spanning several: a fresh prompt, decodes, a later chunk
    for window, softcap in ((5, 0.0), (70, 0.0), (24, 2.0), (0, 1.5)):
        for dtype in (torch.float32, torch.bfloat16):
            check([40, 1, 9, 1, 1], [40, 150, 80, 3, 200], num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype,
                  seed=9, window=window, softcap=softcap)


@case
def padding_row_with_empty_context_gives_zeros():
    q, k_cache, v_cache, meta = make_batch([1, 1], [30, 1], 4, 2, 64, torch.float32, seed=5)
    meta.seq_lens[1] = 0  # what a CUDA-graph bucket's filler row looks like
    out = paged_attention_triton(q, k_cache, v_cache, meta, 0.125)
    assert torch.isfinite(out).all()
    assert out[1].abs().max().item() == 0.0


@case
def write_kv_writes_slots_and_skips_padding():
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(6)
        num_blocks, kv_heads, dim = 6, 2, 64
        k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
        v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
        slots = torch.tensor([5, 77, -1, 16, 95, -1], dtype=torch.int64)
        key = torch.randn(len(slots), kv_heads, dim, generator=gen).to(dtype)
        value = torch.randn(len(slots), kv_heads, dim, generator=gen).to(dtype)
        want_k, want_v = k_cache.clone().flatten(0, 1), v_cache.clone().flatten(0, 1)
        real = slots >= 0
        want_k[slots[real]] = key[real]
        want_v[slots[real]] = value[real]
        write_kv_triton(key, value, k_cache, v_cache, slots)
        assert torch.equal(k_cache.flatten(0, 1), want_k)
        assert torch.equal(v_cache.flatten(0, 1), want_v)


@case
def write_then_attend_matches_full_sequence_reference():
    """The per-layer order a model runs: write this step's K/V, then attend over the whole context."""
    q, k_cache, v_cache, meta = make_batch([6, 1, 1], [6, 19, 33], 4, 2, 64, torch.float32, seed=7)
    gen = torch.Generator().manual_seed(8)
    key = torch.randn(q.shape[0], 2, 64, generator=gen)
    value = torch.randn(q.shape[0], 2, 64, generator=gen)
    write_kv_triton(key, value, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping], key)
    out = paged_attention_triton(q, k_cache, v_cache, meta, 0.125)
    ref = reference_attention(q, k_cache, v_cache, meta, 0.125)
    assert (out - ref).abs().max().item() < 1e-4


def run_cases() -> dict[str, str | None]:
    """In the child: each case's traceback, or None if it passed."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for name, fn in CASES.items():
        try:
            fn()
            results[name] = None
        except Exception:  # report every case, not just the first failure
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    pytest.importorskip("triton", reason="triton is not installed: the GPU attention kernels are untested")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"interpreter child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_kernel_case(name: str, interpreter_results: dict[str, str | None]) -> None:
    assert interpreter_results[name] is None, interpreter_results[name]


if __name__ == "__main__":
    print(json.dumps(run_cases()))
