"""Decode attention against the memory it reads: GB/s of a git revision's kernel and the working tree's,
and of a plain read of the same pool, alternated in one process.

    python benchmarks/decode_attention.py [--base HEAD] [--kv pairs,int8] [--decode 32x640] [--repeats 9]
                                          [--threads N] [--clock wall|cpu] [--cached]

One decode step's attention over SmolLM2-135M's 30 layers (attention_ab.py's shapes and pools: every
sequence its own blocks in random order, on huge pages where Linux gives them). A kernel's bytes are
the K and V of every position the step reads (bf16: 30 layers x 3 kv heads x 64 x 2 x 2 bytes a
position); the plain read is a max over the whole pool, a streaming read the hardware prefetcher
follows, so the two rates say how far the kernel's scattered reads are from what memory gives here.
--cached: every sequence reads the first one's blocks, which stay in cache: the arithmetic's rate.
Min of the repeats. On a shared machine wall time mostly measures the other processes: --clock cpu
--threads 1 counts this process's CPU seconds only (with more threads, OMP_WAIT_POLICY=passive, or
the threads' spinning counts too). Compare the columns of one run, never figures across runs.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # attention_ab.py beside this file, also when a test loads it
from attention_ab import BLOCK, HEAD_DIM, HEADS, KV_HEADS, LAYERS, build, checkout, pool_copy  # noqa: E402

from iterserve.model import cpu_kernels  # noqa: E402
from iterserve.model.attention import rows_to_pairs  # noqa: E402
from iterserve.model.kv_quant import quantize_kv  # noqa: E402


def fastest(calls, repeats: int, clock) -> list[float]:
    """Min seconds of each call by `clock`, the calls taking turns."""
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            t = clock()
            call()
            best[i] = min(best[i], clock() - t)
    return best


def make_pool(kv: str, batch: int, blocks: int) -> torch.Tensor:
    """[LAYERS, 2, batch * blocks, BLOCK, KV_HEADS, width] random K/V as the cache `kv` holds them."""
    x = torch.randn(LAYERS, 2, batch * blocks, BLOCK, KV_HEADS, HEAD_DIM) * 0.3
    if kv == "int8":
        return pool_copy(quantize_kv(x))
    x = x.to(torch.bfloat16)
    return pool_copy(torch.stack(rows_to_pairs(x[:, 0], x[:, 1]), dim=1) if kv == "pairs" else x)


def case(kernels: list[dict], kv: str, batch: int, context: int, repeats: int, clock=time.perf_counter,
         cached: bool = False) -> dict:
    """One step's attention by each kernel and a plain read of its pool: bytes, seconds and the largest
    difference between the kernels' outputs."""
    blocks = -(-(context + 1) // BLOCK)
    pool = make_pool(kv, batch, blocks)
    tables = torch.randperm(batch * blocks).to(torch.int32).view(batch, blocks)
    tables = (tables[:1].repeat(batch, 1) if cached else tables).contiguous()
    q = torch.randn(batch, HEADS, HEAD_DIM).to(torch.bfloat16)
    lens = torch.full((batch,), context + 1, dtype=torch.int32)
    threads = torch.get_num_threads()
    outs = [None] * len(kernels)

    def run(i: int):
        for layer in pool:
            outs[i] = cpu_kernels.decode_attention(q, layer[0], layer[1], tables, lens, HEAD_DIM ** -0.5, threads,
                                                   kernel=kernels[i]["int8" if kv == "int8" else "bf16"],
                                                   pairs=kv == "pairs")
    read = pool.view(-1).view(torch.int64)  # any bytes are an int64: no NaN or denormal to slow the max
    read_s, *kernel_s = fastest([read.amax, *(lambda i=i: run(i) for i in range(len(kernels)))], repeats, clock)
    position_bytes = pool[0, :, 0, 0].numel() * pool.element_size() * LAYERS
    return {"bytes": position_bytes * batch * (context + 1), "seconds": kernel_s,
            "read_bytes": pool.numel() * pool.element_size(), "read_seconds": read_s,
            "diff": max((outs[0].float() - out.float()).abs().max().item() for out in outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree against")
    ap.add_argument("--kv", default="pairs,int8", help="caches: pairs (bf16 in the pair layout), bf16 (rows), int8")
    ap.add_argument("--decode", default="32x640", help="BxCONTEXT cases")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="cpu: this process's CPU seconds")
    ap.add_argument("--cached", action="store_true", help="every sequence on one sequence's blocks (in cache)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print("command: python", " ".join(sys.argv))
    with tempfile.TemporaryDirectory(prefix="iterserve-ab-") as tmp:
        kernels = [build(checkout(args.base, Path(tmp))), build(Path(cpu_kernels.SOURCE))]
        print(f"{'case':<28} {'plain read':>10} {args.base[:9]:>18} {'tree':>18}   tree/base  max|diff|")
        with torch.inference_mode():
            for shape in args.decode.split(","):
                batch, context = (int(n) for n in shape.split("x"))
                for kv in args.kv.split(","):
                    r = case(kernels, kv, batch, context, args.repeats, clock, args.cached)
                    cols = " ".join(f"{r['bytes'] / t / 1e9:5.1f} GB/s {1e3 * t:6.1f} ms" for t in r["seconds"])
                    base, tree = r["seconds"]
                    read = r["read_bytes"] / r["read_seconds"] / 1e9
                    print(f"{kv + f' B={batch} context {context}':<28} {read:5.1f} GB/s {cols}   {base / tree:7.2f}x"
                          f"  {r['diff']:.4f}", flush=True)


if __name__ == "__main__":
    main()
