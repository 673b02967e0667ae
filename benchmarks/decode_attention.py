"""Decode attention against the memory it reads: GB/s of a git revision's kernel and the working tree's,
and of a plain read of the same bytes, alternated in one process.

    python benchmarks/decode_attention.py [--base HEAD] [--kv pairs,int8] [--decode 32x640] [--repeats 9]

One decode step's attention over SmolLM2-135M's 30 layers (attention_ab.py's shapes and pools: every
sequence its own blocks in random order, on huge pages where Linux gives them). The bytes are the K
and V of every position the step reads (bf16: 30 x 3 kv heads x 64 x 2 x 2 bytes a position); the
plain read is a max over the same pool, a streaming read the hardware prefetcher follows, so the
ratio says how far the kernel's scattered reads are from what memory gives here. Min of the repeats;
the machine may be shared: compare the columns of one run, never figures across runs.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from attention_ab import BLOCK, HEAD_DIM, HEADS, KV_HEADS, LAYERS, build, checkout, pool_copy
from iterserve.model import cpu_kernels
from iterserve.model.attention import rows_to_pairs
from iterserve.model.kv_quant import quantize_kv


def fastest(calls, repeats: int, clock,
         cached: bool = False) -> list[float]:
    """Min seconds of each call, the calls taking turns."""
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            t = clock()
            call()
            best[i] = min(best[i], clock() - t)
    return best


def case(kernels: list[dict], kv: str, batch: int, context: int, repeats: int, clock,
         cached: bool = False) -> tuple[float, list[float], float]:
    """(bytes read, [read, base, tree] seconds, largest difference between the kernels' outputs)."""
    blocks = -(-(context + 1) // BLOCK)
    x = torch.randn(LAYERS, 2, batch * blocks, BLOCK, KV_HEADS, HEAD_DIM) * 0.3
    if kv == "int8":
        pool = pool_copy(quantize_kv(x))
    else:
        x = x.to(torch.bfloat16)
        pool = pool_copy(torch.stack(rows_to_pairs(x[:, 0], x[:, 1]), dim=1) if kv == "pairs" else x)
    del x
    tables = torch.randperm(batch * blocks).to(torch.int32).view(batch, blocks).contiguous()
    if cached:  # every sequence reads the first one's blocks: the K/V stay in cache, the arithmetic alone
        tables = tables[:1].repeat(batch, 1)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(torch.bfloat16)
    lens = torch.full((batch,), context + 1, dtype=torch.int32)
    threads = torch.get_num_threads()
    outs = [None, None]

    def run(i: int):
        for layer in pool:
            outs[i] = cpu_kernels.decode_attention(q, layer[0], layer[1], tables, lens, HEAD_DIM ** -0.5, threads,
                                                   kernel=kernels[i]["int8" if kv == "int8" else "bf16"],
                                                   pairs=kv == "pairs")
    read = pool.view(-1).view(torch.int64)
    position_bytes = pool[0, :, 0, 0].numel() * pool.element_size() * LAYERS
    seconds = fastest([read.amax, lambda: run(0), lambda: run(1)], repeats, clock)
    return position_bytes * batch * (context + 1), seconds, (outs[0].float() - outs[1].float()).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree against")
    ap.add_argument("--kv", default="pairs,int8", help="caches: pairs (bf16 in the pair layout), bf16 (rows), int8")
    ap.add_argument("--decode", default="32x640", help="BxCONTEXT cases")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--cached", action="store_true", help="every sequence on one sequence's blocks (in cache)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="cpu: the process's CPU seconds, not the time the scheduler gave other processes "
                         "(a shared machine; with --threads 1, as spinning threads' waits count)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print("command: python", " ".join(sys.argv))
    with tempfile.TemporaryDirectory(prefix="iterserve-ab-") as tmp:
        kernels = [build(checkout(args.base, Path(tmp))), build(Path(cpu_kernels.SOURCE))]
        print(f"{'case':<32} {'read':>12} {args.base[:9]:>18} {'tree':>18}   tree/base  max|diff|")
        with torch.inference_mode():
            for shape in args.decode.split(","):
                batch, context = (int(n) for n in shape.split("x"))
                for kv in args.kv.split(","):
                    size, (read, base, tree), diff = case(kernels, kv, batch, context, args.repeats, clock, args.cached)
                    cols = " ".join(f"{size / t / 1e9:5.1f} GB/s {1e3 * t:5.1f} ms" for t in (base, tree))
                    print(f"{kv + f' B={batch} context {context}':<32} {size / read / 1e9:7.1f} GB/s {cols} "
                          f"  {base / tree:7.2f}x  {diff:.4f}", flush=True)


if __name__ == "__main__":
    main()
