"""Paged attention and K/V cache writes as Triton kernels: the GPU path.

Same contract as the torch path (see attention_metadata.py): a flat, unpadded batch of T new
tokens from B requests with ragged query lengths, each reading its context through its block table.

paged_attention: one program per (request, block of BLOCK_Q query tokens, kv head). The query heads
that share the kv head (GQA) and the BLOCK_Q tokens are stacked as the rows of one [M, D] tile, so
every K/V tile read from memory serves all of them through a matrix product. The program walks the
request's context BLOCK_N positions at a time (each position's cache block found through the block
table, so BLOCK_N need not equal the cache block size) with an online softmax in fp32
(flash-attention), masking by absolute position: query position >= key position, and, in a
windowed layer, query position - key position < WINDOW (the walk starts at the first tile that
reaches into the window). SOFTCAP > 0 caps the scores as Gemma 2 does: SOFTCAP * tanh(s / SOFTCAP).
Both are compile-time constants, so a layer without them runs the same code as before.

Everything that changes from step to step (query_start_loc, seq_lens, block tables, slots) is read
from device tensors inside the kernels, never passed as a Python int, so one compiled kernel serves
every decode step and can be replayed inside a CUDA graph.

triton is optional: this module imports without it and the kernels are JIT-wrapped on first use.
TRITON_INTERPRET=1 must be set before triton is imported (its own library functions are wrapped
at import) to run them in Triton's CPU interpreter, as the tests do in a child process.
"""
from __future__ import annotations  # also keeps the kernels' tl.constexpr annotations unevaluated without triton

import functools
import os

import torch

from iterserve.model.attention_metadata import AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch attention path needs no triton
    triton = tl = None

BLOCK_N = 64  # context positions per inner-loop step


def has_triton() -> bool:
    return triton is not None


def _write_kv_kernel(key, value, k_cache, v_cache, slot_mapping,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per new token: copy its [KVH, D] key and value into its cache slot."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot < 0:  # padding row (CUDA-graph bucket filler): writes nothing
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = blk.to(tl.int64) * stride_cb + off * stride_cs + h * stride_ch + d
    k = tl.load(key + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache + dst, k, mask=mask)
    tl.store(v_cache + dst, v, mask=mask)


def _paged_attention_kernel(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale_log2,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_cb, stride_cs, stride_ch, stride_bt,
                            GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                            WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    qblk = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc + b)
    q_len = tl.load(query_start_loc + b + 1) - q_start
    if qblk * BLOCK_Q >= q_len:  # grid is sized by the longest query; shorter ones stop here
        return
    seq_len = tl.load(seq_lens + b)
    ctx_len = seq_len - q_len  # tokens already in the cache before this step's

    # Row r of the tile is query token qblk*BLOCK_Q + r // GROUP_P, head kvh*GROUP + r % GROUP_P.
    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    tok = qblk * BLOCK_Q + rows // GROUP_P
    head = kvh * GROUP + rows % GROUP_P
    row_ok = (tok < q_len) & (rows % GROUP_P < GROUP)
    q_pos = ctx_len + tok  # absolute position of each row's token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok_row = (q_start + tok).to(tl.int64)
    q_tile = tl.load(q + tok_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # Triton's CPU interpreter multiplies bf16 tiles as raw uint16 bits: do its dots in fp32
        q_tile = q_tile.to(tl.float32)

    # -1e30, not -inf, so a row that sees no key in a tile never computes (-inf) - (-inf).
    m_i = tl.full([BLOCK_Q * GROUP_P], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], dtype=tl.float32)
    # Causal: no row of this query block sees past its last token's position.
    kv_end = tl.minimum(seq_len, ctx_len + (qblk + 1) * BLOCK_Q)
    kv_start = 0
    if WINDOW > 0:  # no row of this query block sees behind its first token's window
        kv_start = tl.maximum(ctx_len + qblk * BLOCK_Q - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_start, kv_end, BLOCK_N):
        kv_pos = start + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < kv_end
        blk = tl.load(block_tables + b.to(tl.int64) * stride_bt + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0)
        kv_off = blk.to(tl.int64) * stride_cb + (kv_pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k_tile = tl.load(k_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v_tile = tl.load(v_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k_tile = k_tile.to(tl.float32)
            v_tile = v_tile.to(tl.float32)

        s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP > 0:  # on the natural-log scale: cap * tanh(x / cap), tanh(y) = 1 - 2 / (e^(2y) + 1)
            y = s * (0.6931471805599453 / SOFTCAP)
            s = SOFTCAP * 1.4426950408889634 * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
        visible = (q_pos[:, None] >= kv_pos[None, :]) & kv_ok[None, :]
        if WINDOW > 0:
            visible = visible & (q_pos[:, None] - kv_pos[None, :] < WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
        m_i = m_new

    # A row with no keys at all (seq_len 0: a padding row) has l_i == 0 and acc == 0: write zeros.
    acc = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out + tok_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             acc.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@functools.cache
def _kernels():
    """JIT the kernels on first use, so this module imports (and the CPU path runs) without triton."""
    if triton is None:
        raise RuntimeError("the Triton attention path needs the `triton` package (pip install triton)")
    return triton.jit(_write_kv_kernel), triton.jit(_paged_attention_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache_layer: torch.Tensor,
                    v_cache_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, KVH, D] -> cache [num_blocks, block_size, KVH, D] at slot_mapping[T]; -1 skips."""
    write_kernel, _ = _kernels()
    t, kvh, dim = key.shape
    assert key.stride(-1) == value.stride(-1) == 1 and k_cache_layer.stride() == v_cache_layer.stride()
    assert k_cache_layer.stride(-1) == 1 and k_cache_layer.shape[2:] == (kvh, dim)
    if t == 0:
        return
    write_kernel[(t,)](key, value, k_cache_layer, v_cache_layer, slot_mapping,
                       key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                       k_cache_layer.stride(0), k_cache_layer.stride(1), k_cache_layer.stride(2),
                       NUM_KV_HEADS=kvh, HEAD_DIM=dim, BLOCK_SIZE=k_cache_layer.shape[1],
                       BLOCK_H=_next_pow2(kvh), BLOCK_D=_next_pow2(dim))


def paged_attention_triton(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                           meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [T, H, D] (this step's K/V already written) -> out [T, H, D], causal over each request's context;
    window > 0: each query sees its last `window` positions only; softcap > 0: Gemma 2's score capping."""
    _, attn_kernel = _kernels()
    t, num_heads, dim = q.shape
    num_kv_heads = k_cache_layer.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads (GQA)"
    assert q.stride(-1) == 1 and k_cache_layer.stride(-1) == 1 and k_cache_layer.stride() == v_cache_layer.stride()
    out = torch.empty_like(q)
    if t == 0:
        return out
    group = num_heads // num_kv_heads
    group_p = _next_pow2(group)
    # tl.dot needs at least 16 rows: pad a decode tile with extra (masked) token rows rather than
    # launch a non-MMA path; longer queries take up to 64 rows per program.
    block_q = max(1, 16 // group_p, min(_next_pow2(meta.max_query_len), 64 // group_p))
    grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)
    # fp32 inputs get exact fp32 products (tf32 would cost ~1e-3 relative error); bf16/fp16 ignore it.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    attn_kernel[grid](q, k_cache_layer, v_cache_layer, out, meta.query_start_loc, meta.seq_lens,
                      meta.block_tables, scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
                      q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                      k_cache_layer.stride(0), k_cache_layer.stride(1), k_cache_layer.stride(2),
                      meta.block_tables.stride(0),
                      GROUP=group, GROUP_P=group_p, HEAD_DIM=dim, BLOCK_D=_next_pow2(dim),
                      BLOCK_Q=block_q, BLOCK_N=BLOCK_N, BLOCK_SIZE=k_cache_layer.shape[1],
                      DOT_PRECISION=precision, UPCAST=_interpreting() and q.dtype == torch.bfloat16,
                      WINDOW=window, SOFTCAP=float(softcap))
    return out
