"""Decode step time with the KV cache in the model dtype vs int8 (--kv-cache-dtype), side by side.

    python benchmarks/kv_cache_dtype.py [--batches 64] [--contexts 256,1024] [--dtype auto] [--repeats 5]
                                        [--threads N] [--kv-cache-memory 1GiB]

For each batch size B and context length, every sequence has `context` tokens already in the cache
and decodes one token. Per row: the whole decode step (ModelRunner.execute) with each cache, and the
decode attention kernel alone over all layers (cpu_kernels.decode_attention, the C++ kernel reading
the paged blocks in place: float rows vs int8 rows with their scales), with the K/V bytes one step
reads. Also prints how many blocks --kv-cache-memory holds for each. The cache is filled with random
values (quantized for int8): the cost does not depend on them. The machine may be shared: compare
columns of one run.
"""
from __future__ import annotations

import argparse
import sys

import torch

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.kv.spec import KVCacheSpec, num_blocks_for
from iterserve.model import cpu_kernels
from iterserve.model.kv_quant import head_dim_of, quantize_kv
from step_time import decode_plan, timed  # benchmarks/ is on sys.path


def fill_cache(kv: torch.Tensor) -> None:
    """Random K/V of scale 0.1 in every layer (quantized for an int8 pool); one layer at a time."""
    for layer in kv:
        x = torch.randn(*layer.shape[:-1], head_dim_of(kv)) * 0.1
        layer.copy_(quantize_kv(x) if kv.dtype == torch.int8 else x)


def attention_time(runner: ModelRunner, batch: int, context: int, blocks_per_seq: int, repeats: int) -> float:
    """Seconds of the decode attention kernel over every layer of one step (no other op)."""
    cfg, kv = runner.arch, runner.kv_cache
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=runner.dtype)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32)
    threads = torch.get_num_threads()

    def step():
        for layer in kv:
            cpu_kernels.decode_attention(q, layer[0], layer[1], tables, seq_lens, cfg.head_dim ** -0.5, threads)
    return timed(step, repeats)


def runner_for(kv_cache_dtype: str, args, num_blocks: int) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=args.model, dtype=args.dtype, num_kv_blocks=num_blocks,
                                      num_threads=args.threads, kv_cache_dtype=kv_cache_dtype))
    fill_cache(runner.kv_cache)
    return runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--batches", default="64")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-cache-memory", default="1GiB", help="the budget whose block counts are printed")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    print("command: python", " ".join(sys.argv))
    bps = -(-(max(contexts) + 2) // 16)
    runners = {d: runner_for(d, args, max(batches) * bps) for d in ("auto", "int8")}
    specs: dict[str, KVCacheSpec] = {d: r.kv_cache_spec for d, r in runners.items()}
    memory = EngineConfig(kv_cache_memory=args.kv_cache_memory).cache_config.kv_cache_memory
    print(f"model dtype {runners['auto'].dtype}, threads {torch.get_num_threads()}; blocks in {args.kv_cache_memory}: "
          + ", ".join(f"{s.dtype} {num_blocks_for(memory, s.bytes_per_block):,} ({s.bytes_per_block:,} B/block)"
                      for s in specs.values()))
    names = [s.dtype for s in specs.values()]
    print(f"{'B':>4} {'context':>8} " + "".join(f"{'step ' + n:>14}" for n in names) + f"{'ratio':>7} "
          + "".join(f"{'attn ' + n:>14}" for n in names) + f"{'ratio':>7} " + "".join(f"{'KV MB ' + n:>14}" for n in names)
          + "   (ms; attn: the decode kernel over every layer)")
    with torch.inference_mode():
        for b in batches:
            for c in contexts:
                n = -(-(c + 2) // 16)
                step = [timed(lambda r=r: r.execute(decode_plan(b, c, n)), args.repeats) for r in runners.values()]
                attn = [attention_time(r, b, c, n, args.repeats) for r in runners.values()]
                kv_mb = [b * (c + 1) * s.bytes_per_block / s.block_size / 1e6 for s in specs.values()]
                print(f"{b:>4} {c:>8} " + "".join(f"{t * 1e3:>14.2f}" for t in step) + f"{step[1] / step[0]:>7.2f} "
                      + "".join(f"{t * 1e3:>14.2f}" for t in attn) + f"{attn[1] / attn[0]:>7.2f} "
                      + "".join(f"{m:>14.1f}" for m in kv_mb), flush=True)


if __name__ == "__main__":
    main()
