"""Paged attention in plain torch: the CPU path, and the reference for any fused kernel.

Per layer: write this step's K/V into the cache at slot_mapping, then attend. The batch is split
once per step (AttentionPlan) into
  - decode rows (one new token): their K/V are gathered, head-major, into one padded
    [2, B, Hkv, L, D] buffer and attended to in one batched, masked matmul — no Python loop over
    requests per layer. The gather moves rows of D elements picked by one index built per step
    (AttentionPlan.decode_kv_rows): it lands each head's context contiguous, so the matmuls read
    it as is (a token-major gather plus a permute copy measured ~1.6x slower, and matmul on a
    permuted view copies it anyway);
  - prompt rows (a fresh prompt, a chunk, a recompute): one SDPA call per request. A fresh prompt
    attends to its own new K/V (is_causal); a later chunk reads its context from the cache with an
    explicit bottom-right causal mask (is_causal would align top-left, wrong when q_len < kv_len).

A windowed layer (ModelArch.sliding_window) masks the positions a query is `window` or more behind;
the C++ decode kernel does not read the blocks wholly behind it. Gemma 2's score soft-capping
(cap * tanh(s / cap)) goes through the same kernels, or an explicit masked softmax in torch.

A bfloat16 cache under float32 arithmetic (--dtype bf16-storage) is read the same way as an int8 one:
rounded as it is written, widened where it is read.

A bfloat16 cache on a CPU whose decode kernel reads it (cpu_kernels.pairs_supported) is kept in the
pair layout instead of rows: inside the same [block_size, Hkv, D] storage of a block, each kv head's K
is [D/2, block_size, 2] (one vector holds dimensions 2i, 2i+1 of 16 positions) and its V [block_size/2,
D, 2] (one vector holds 16 dimensions of two positions), so the decode kernel's Q.K needs no reduction
and its P.V widens V by a shift and a mask (cpu_attention.cpp, attend_pairs): the row kernel's
results, to a bf16 ulp, at about half its instructions. It is written by the C write only and read
by the decode kernel in place; everything else (prompt chunks, P/D hand-offs) goes through
pairs_to_rows. Swaps and prefix-cache hits move whole blocks and never look inside.

An int8 cache (--kv-cache-dtype int8, layout in kv_quant.py) is quantized as it is written. The C++
decode kernel reads its int8 rows and scales in place; the torch gather dequantizes the gathered
context; prompt rows dequantize their sequence's blocks, their own new K/V included, so that a
prompt, a chunk, a prefix-cache hit and a decode all attend to the same stored values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from iterserve.model import cpu_kernels, cpu_paths
from iterserve.model.attention_metadata import AttentionMetadata
from iterserve.model.kv_quant import dequantize_kv, quantize_kv


@dataclass(slots=True)
class PromptSeq:
    rows: slice  # its rows of the flat batch
    seq_len: int
    fresh: bool  # start_pos == 0: no cached context, attend to the new K/V only
    block_table: torch.Tensor  # [num_blocks] covering seq_len
    mask: torch.Tensor | None  # [q_len, seq_len] bool, for chunks only
    # window -> [q_len, seq_len] bool, causal and within the window: made by the first layer that needs it
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


class Workspace:
    """A scratch buffer kept across layers and steps: a fresh 10+ MB tensor per use costs page faults."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        if self.buf is None or self.buf.numel() < n or self.buf.dtype != dtype or self.buf.device != device:
            self.buf = torch.empty(n, dtype=dtype, device=device)
        return self.buf[:n].view(shape)


@dataclass(slots=True)
class AttentionPlan:
    """The per-step, per-layer-invariant part of attention: built once, used by every layer."""
    block_size: int
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None  # [Bd] rows of the flat batch that are decodes
    decode_all: bool  # every row is a decode, in order: skip the index_select/index_copy
    decode_blocks: torch.Tensor | None  # [Bd, nb]
    decode_bias: torch.Tensor | None  # [Bd, 1, 1, L] 0 / -inf, in the compute dtype
    prompts: list[PromptSeq]
    workspace: Workspace | None
    # the C++ kernel path (cpu_kernels.py), which reads the cache in place; None: gather + matmuls
    decode_tables: torch.Tensor | None = None  # [Bd, nb] int32
    decode_seq_lens: torch.Tensor | None = None  # [Bd] int32
    num_threads: int = 1
    kernels: bool = False  # C++ K/V write, and prompt rows through the causal kernel where it supports them
    pairs: bool = False  # a bfloat16 cache is in the pair layout (see the module's doc); int8 ones never are
    # unwindowed prompt rows through torch's flash kernel in their dtype, not the causal kernel (cpu_paths)
    torch_prompts: bool = False
    # set by the first layer, which sees the cache's shape, and reused by the others:
    decode_kv_rows: torch.Tensor | None = None  # [Bd * Hkv * L] rows of layer_cache[0].view(-1, D), head-major
    decode_ctx: torch.Tensor | None = None  # [2, Bd, Hkv, L, D] the gather target
    decode_window_bias: torch.Tensor | None = None  # decode_bias with the window's far side masked too


def build_plan(md: AttentionMetadata, block_size: int, dtype: torch.dtype,
               workspace: Workspace | None = None, use_kernel: bool = False, pairs: bool = False) -> AttentionPlan:
    """workspace: where the decode context is gathered (a fresh tensor per step without one).
    use_kernel: decode rows go through the C++ kernel, which reads the paged cache in place, and
    prompt rows through its causal kernel where that supports the dtype and head dim. pairs: a
    bfloat16 cache is in the pair layout (needs use_kernel)."""
    assert use_kernel or not pairs
    starts = md.query_start_loc.tolist() if md.max_query_len > 1 else range(md.num_seqs + 1)
    dec = [b for b, q in enumerate(md.query_lens_list) if q == 1]
    decode_rows = decode_blocks = decode_bias = decode_tables = decode_seq_lens = None
    decode_all = False
    if dec:
        dev = md.seq_lens.device
        decode_all = len(dec) == md.num_seqs
        idx = None if decode_all else torch.tensor(dec, device=dev)
        seq_lens = md.seq_lens if decode_all else md.seq_lens[idx]
        max_len = max(md.seq_lens_list[b] for b in dec)
        nb = -(-max_len // block_size)
        tables = (md.block_tables if decode_all else md.block_tables[idx])[:, :nb]
        if use_kernel:
            decode_tables, decode_seq_lens = tables.contiguous(), seq_lens.contiguous()
        else:
            decode_blocks = tables.long()
            pos = torch.arange(nb * block_size, device=dev)
            bias = torch.zeros((len(dec), nb * block_size), dtype=dtype, device=dev)
            bias.masked_fill_(pos[None, :] >= seq_lens[:, None], float("-inf"))
            decode_bias = bias[:, None, None, :]
            decode_seq_lens = seq_lens  # for a windowed layer's bias
        decode_rows = None if decode_all else torch.tensor([starts[b] for b in dec], device=dev)
    prompts = []
    for b, q_len in enumerate(md.query_lens_list):
        if q_len == 1:
            continue
        s, seq_len = starts[b], md.seq_lens_list[b]
        fresh = seq_len == q_len
        mask = None
        if not fresh:  # new token i sits at seq_len - q_len + i and sees positions <= that
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=md.seq_lens.device).tril(seq_len - q_len)
        prompts.append(PromptSeq(slice(s, s + q_len), seq_len, fresh,
                                 md.block_tables[b, : -(-seq_len // block_size)].long(), mask))
    return AttentionPlan(block_size, md.slot_mapping, decode_rows, decode_all, decode_blocks, decode_bias, prompts,
                         workspace, decode_tables, decode_seq_lens, torch.get_num_threads(), use_kernel, pairs,
                         use_kernel and cpu_paths.current().torch_prompt_attention)


def _kv_rows(blocks: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Row of (seq b, head h, position p) in a [blocks * block_size * Hkv, D] view of K (or V):
    ((block_tables[b, p // bs] * bs + p % bs) * Hkv + h), laid out [B, Hkv, L]."""
    b, nb = blocks.shape
    tok = (blocks[:, :, None] * block_size + torch.arange(block_size, device=blocks.device)).view(b, 1, -1)
    return (tok * num_kv_heads + torch.arange(num_kv_heads, device=blocks.device)[None, :, None]).view(-1)


def in_pairs(pairs: bool, cache: torch.Tensor) -> bool:
    """Whether a cache is in the pair layout, where its backend keeps `pairs`: bfloat16 ones are, int8
    ones never."""
    return pairs and cache.dtype == torch.bfloat16


def pairs_to_rows(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [..., block_size, Hkv, D] of a pair-layout cache's K and V -> the same blocks in rows."""
    *lead, bs, hkv, d = k.shape
    k = k.reshape(-1, hkv, d // 2, bs, 2).permute(0, 3, 1, 2, 4)
    v = v.reshape(-1, hkv, bs // 2, d, 2).permute(0, 2, 4, 1, 3)
    return k.reshape(*lead, bs, hkv, d), v.reshape(*lead, bs, hkv, d)


def rows_to_pairs(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pairs_to_rows' inverse."""
    *lead, bs, hkv, d = k.shape
    k = k.reshape(-1, bs, hkv, d // 2, 2).permute(0, 2, 3, 1, 4)
    v = v.reshape(-1, bs // 2, 2, hkv, d).permute(0, 3, 1, 4, 2)
    return k.reshape(*lead, bs, hkv, d), v.reshape(*lead, bs, hkv, d)


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             use_kernel: bool = False, pairs: bool = False) -> None:
    """layer_cache [2, num_blocks, block_size, Hkv, D] (int8: D + 4, quantized on the way in, see
    kv_quant.py); k, v [T, Hkv, D]; in place. pairs: the cache is in the pair layout."""
    quantized = layer_cache.dtype == torch.int8
    if pairs:
        return cpu_kernels.write_kv_pairs(layer_cache[0], layer_cache[1], k, v, slot_mapping)
    if use_kernel and cpu_kernels.elementwise_ops() is not None:  # a memcpy per row: index_copy_ took ~30 us
        write = cpu_kernels.write_kv_int8 if quantized else cpu_kernels.write_kv
        return write(layer_cache[0], layer_cache[1], k, v, slot_mapping)
    if quantized:
        k, v = quantize_kv(k), quantize_kv(v)
    elif k.dtype != layer_cache.dtype:  # bf16-storage: rounded once, here
        k, v = k.to(layer_cache.dtype), v.to(layer_cache.dtype)
    _, nblk, bs, hkv, d = layer_cache.shape
    layer_cache[0].view(nblk * bs, hkv, d).index_copy_(0, slot_mapping, k)
    layer_cache[1].view(nblk * bs, hkv, d).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                    plan: AttentionPlan, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] (this step's, rope applied) -> out [T, H, D]. window: a query sees
    only the last `window` positions (0: all); softcap: scores = softcap * tanh(scores / softcap) (0: off)."""
    write_kv(layer_cache, k, v, plan.slot_mapping, plan.kernels, in_pairs(plan.pairs, layer_cache))
    if plan.decode_all:
        return _decode(q, layer_cache, plan, scale, window, softcap)
    out = torch.empty_like(q)
    if decode_rows_present(plan):
        out.index_copy_(0, plan.decode_rows, _decode(q.index_select(0, plan.decode_rows), layer_cache, plan, scale,
                                                     window, softcap))
    for p in plan.prompts:
        out[p.rows] = _prompt(q[p.rows], k[p.rows], v[p.rows], layer_cache, p, scale, plan, window, softcap)
    return out


def decode_rows_present(plan: AttentionPlan) -> bool:
    return plan.decode_blocks is not None or plan.decode_tables is not None


def _decode(q: torch.Tensor, layer_cache: torch.Tensor, plan: AttentionPlan, scale: float, window: int = 0,
            softcap: float = 0.0) -> torch.Tensor:
    """One query per sequence: q [B, H, D] against the gathered, head-major context [2, B, Hkv, L, D]."""
    if plan.decode_tables is not None:
        return cpu_kernels.decode_attention(q, layer_cache[0], layer_cache[1], plan.decode_tables, plan.decode_seq_lens,
                                            scale, plan.num_threads, window=window, softcap=softcap,
                                            pairs=in_pairs(plan.pairs, layer_cache))
    b, h, d = q.shape
    hkv, width = layer_cache.shape[3:]  # width: d, or d + 4 for an int8 cache's rows with their scales
    g = h // hkv
    if plan.decode_kv_rows is None:
        plan.decode_kv_rows = _kv_rows(plan.decode_blocks, plan.block_size, hkv)
        shape = (2, b, hkv, plan.decode_blocks.shape[1] * plan.block_size, width)
        ws = plan.workspace
        plan.decode_ctx = ws.get(shape, layer_cache.dtype, q.device) if ws is not None else \
            layer_cache.new_empty(shape)
    rows, ctx = plan.decode_kv_rows, plan.decode_ctx
    torch.index_select(layer_cache[0].view(-1, width), 0, rows, out=ctx[0].view(-1, width))
    torch.index_select(layer_cache[1].view(-1, width), 0, rows, out=ctx[1].view(-1, width))
    if layer_cache.dtype == torch.int8:  # the reference path: this step's context only, widened
        ctx = dequantize_kv(ctx, q.dtype)
    elif ctx.dtype != q.dtype:
        ctx = ctx.to(q.dtype)
    qg = q.view(b, hkv, g, d)  # query heads sharing one kv head become rows of one matmul
    scores = torch.matmul(qg, ctx[0].transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, L]
    if softcap:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores.add_(_window_bias(plan, window) if window else plan.decode_bias)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, ctx[1]).view(b, h, d)


def _window_bias(plan: AttentionPlan, window: int) -> torch.Tensor:
    """decode_bias with positions `window` or more behind each sequence's last one masked; one per step."""
    if plan.decode_window_bias is None:
        bias = plan.decode_bias.clone()
        pos = torch.arange(bias.shape[-1], device=bias.device)
        bias[:, 0, 0].masked_fill_(pos[None, :] < (plan.decode_seq_lens - window)[:, None], float("-inf"))
        plan.decode_window_bias = bias
    return plan.decode_window_bias


def _prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
            p: PromptSeq, scale: float, plan: AttentionPlan, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    if not p.fresh or layer_cache.dtype != q.dtype:
        k, v = _cached_context(layer_cache, p, q.dtype, in_pairs(plan.pairs, layer_cache))
    in_torch = plan.torch_prompts and not window
    if plan.kernels and not softcap and not in_torch and cpu_kernels.prompt_attention_supported(q.dtype, q.shape[-1]):
        return cpu_kernels.prompt_attention(q, k, v, scale, plan.num_threads, window)  # causal, bottom-right aligned
    if window or softcap:
        return _masked_prompt(q, k, v, p, scale, window, softcap)
    # 4-D [1, H, T, D]: torch's CPU flash kernel takes only 4-D inputs; 3-D falls back to the math
    # path (~2x slower at 512 tokens, measured). Without AMX its float32 kernel is faster than its bf16
    # one, and more exact: widen, attend, narrow. On AMX its bf16 one runs on the tiles (cpu_paths).
    dtype = q.dtype
    wide = torch.float32 if q.device.type == "cpu" and not in_torch else dtype
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None].to(wide) for x in (q, k, v)),
                                         attn_mask=p.mask, is_causal=p.fresh, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(dtype)


def _cached_context(layer_cache: torch.Tensor, p: PromptSeq, dtype: torch.dtype,
                    pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's K, V [seq_len, Hkv, D] read through its block table (this step's were just
    written). An int8 cache's are dequantized, a fresh prompt's too: every query then sees the values
    its later decodes and any prefix-cache hit will, whatever the batching. So is a bfloat16 cache
    under float32 queries, widened."""
    hkv, width = layer_cache.shape[3:]
    # index_select copies whole blocks (memcpy); advanced indexing goes element by element (~8x slower)
    k, v = (layer_cache[i].index_select(0, p.block_table) for i in (0, 1))
    if pairs:
        k, v = pairs_to_rows(k, v)
    k, v = (x.reshape(-1, hkv, width)[: p.seq_len] for x in (k, v))
    if layer_cache.dtype == torch.int8:
        return dequantize_kv(k, dtype), dequantize_kv(v, dtype)
    return k.to(dtype), v.to(dtype)


def _masked_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: PromptSeq, scale: float, window: int,
                   softcap: float) -> torch.Tensor:
    """A windowed or soft-capped prompt: q [T, H, D] at the end of k/v [S, Hkv, D], in float32 with an
    explicit mask (SDPA has no soft-capping)."""
    t, s = q.shape[0], k.shape[0]
    mask = p.window_masks.get(window)
    if mask is None:
        qpos = torch.arange(s - t, s, device=q.device)[:, None]
        kpos = torch.arange(s, device=q.device)[None, :]
        mask = p.window_masks[window] = (kpos <= qpos) & (qpos - kpos < (window or s))
    g = q.shape[1] // k.shape[1]
    qf, kf, vf = (x.transpose(0, 1).float() for x in (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)))
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [H, T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)
