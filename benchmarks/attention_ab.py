"""The C++ attention kernels of a git revision against the working tree's, alternated in one process.

    python benchmarks/attention_ab.py [--base HEAD] [--kv bf16,int8,pairs] [--layout scattered]
                                      [--decode 32x640,64x256] [--prompt 512,2048] [--repeats 9]
                                      [--q-dtype bfloat16]

Builds cpu_attention.cpp (with its headers) as it is at --base and as it is in the working tree, then
times each kernel on the same inputs, the two builds one call after the other, and prints medians
(ms) and the largest difference between their outputs. Decode: B sequences of `context` positions
over the model's 30 layers (SmolLM2-135M's shapes: 9 query heads, 3 kv heads, head_dim 64, blocks
of 16), K/V random; --layout scattered gives every sequence its own blocks in random order (as a
running server's cache), cached lets every sequence share one sequence's blocks (they stay in
cache: the kernel's arithmetic alone). --kv pairs: the base's bf16 kernel over rows against the
working tree's over the same cache in the pair layout (model/attention.py). The caches are allocated
as the engine's pool is (lazy_zeros: huge pages where Linux gives them). Prompt: one layer's causal
attention over T tokens. --q-dtype float32: the queries (and a prompt's K/V) in float32, as the engine
runs where the CPU has no bf16 arithmetic (bf16 storage: float32 queries over a bf16 cache; the float32
prompt kernel of AVX2 builds). The machine may be shared: compare the two columns of one run, never
figures across runs.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from iterserve.executor.kv_pool import lazy_zeros
from iterserve.model import cpu_kernels
from iterserve.model.attention import rows_to_pairs
from iterserve.model.kv_quant import quantize_kv

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
# the working tree's kernel sources: cpu_attention.cpp and the headers beside it (it includes some)
SOURCES = ("cpu_attention.cpp", *sorted(p.name for p in Path(cpu_kernels.SOURCE).parent.glob("*.h")))


def build(source: Path) -> dict:
    functions = cpu_kernels.attention_functions(source)
    if functions is None:
        raise SystemExit(f"could not build {source}")
    return functions


def checkout(rev: str, into: Path) -> Path:
    """The kernel sources at `rev`, written into `into`; the path of its cpu_attention.cpp."""
    root = Path(__file__).resolve().parent.parent
    listed = subprocess.run(["git", "ls-tree", "--name-only", rev, "iterserve/model/"], cwd=root,
                            capture_output=True, text=True, check=True).stdout.split()
    names = ["cpu_attention.cpp", *(Path(p).name for p in listed if p.endswith(".h"))]  # and its headers
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:iterserve/model/{name}"], cwd=root, capture_output=True,
                              text=True, check=True).stdout
        (into / name).write_text(text)
    return into / names[0]


def alternate(calls, repeats: int) -> list[float]:
    """Median seconds of each call, the calls taking turns."""
    times = [[] for _ in calls]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            t = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def pool_copy(cache: torch.Tensor) -> torch.Tensor:
    """The cache in memory allocated as the engine allocates its pool (on huge pages where it can)."""
    pool = lazy_zeros(tuple(cache.shape), cache.dtype, huge_pages=True)
    pool.copy_(cache)
    return pool


def decode_case(kernels: list[dict], kv: str, batch: int, context: int, layout: str, repeats: int,
                q_dtype: torch.dtype) -> tuple[float, float, float]:
    """(base seconds, tree seconds, largest output difference) of one decode step's attention."""
    blocks = -(-(context + 1) // BLOCK)
    total = batch * blocks if layout == "scattered" else blocks
    x = torch.randn(LAYERS, 2, total, BLOCK, KV_HEADS, HEAD_DIM) * 0.3
    cache = quantize_kv(x) if kv == "int8" else x.to(torch.bfloat16)
    pool = pool_copy(cache)
    caches = [pool, pool_copy(torch.stack(rows_to_pairs(cache[:, 0], cache[:, 1]), dim=1)) if kv == "pairs" else pool]
    if layout == "scattered":
        tables = torch.randperm(total).to(torch.int32).view(batch, blocks).contiguous()
    else:
        tables = torch.arange(blocks, dtype=torch.int32).repeat(batch, 1).contiguous()
    q = torch.randn(batch, HEADS, HEAD_DIM).to(q_dtype)
    lens = torch.full((batch,), context + 1, dtype=torch.int32)
    threads = torch.get_num_threads()
    outs = [None] * len(kernels)

    def run(i: int):
        pairs = kv == "pairs" and i == 1
        for layer in caches[i]:
            outs[i] = cpu_kernels.decode_attention(q, layer[0], layer[1], tables, lens, HEAD_DIM ** -0.5, threads,
                                                   kernel=kernels[i]["int8" if kv == "int8" else "bf16"], pairs=pairs)
    base, ours = alternate([lambda: run(0), lambda: run(1)], repeats)
    return base, ours, (outs[0].float() - outs[1].float()).abs().max().item()


def prompt_case(kernels: list[dict], tokens: int, repeats: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """The same for one layer's causal attention over a prompt of `tokens`."""
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(tokens, width).to(dtype)
    q = qkv[:, : HEADS * HEAD_DIM]
    k = qkv[:, HEADS * HEAD_DIM: (HEADS + KV_HEADS) * HEAD_DIM]
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:]
    outs = [torch.empty(tokens, HEADS, HEAD_DIM, dtype=dtype) for _ in kernels]
    threads = torch.get_num_threads()

    def run(i: int):
        rc = kernels[i]["prompt"](cpu_kernels.DTYPES[dtype], q.data_ptr(), width, k.data_ptr(), width, v.data_ptr(),
                                  width, outs[i].data_ptr(),
                                  tokens, tokens, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, threads, 0)
        if rc != 0:
            raise SystemExit(f"prompt attention in {dtype} is not built here (bf16: AVX-512 BF16; float32: AVX2 "
                             "without AVX-512)")
    base, ours = alternate([lambda: run(0), lambda: run(1)], repeats)
    return base, ours, (outs[0].float() - outs[1].float()).abs().max().item()


def row(case: str, base: float, ours: float, diff: float) -> str:
    return f"{case:<40} {1e3 * base:9.3f} {1e3 * ours:9.3f} {base / ours:7.2f}x  max|diff| {diff:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree against")
    ap.add_argument("--kv", default="bf16,int8",
                    help="decode caches: bf16, int8, pairs (bf16 rows at --base, pairs here)")
    ap.add_argument("--layout", default="scattered", choices=["scattered", "cached"])
    ap.add_argument("--decode", default="32x640,64x256", help="BxCONTEXT cases; empty: none")
    ap.add_argument("--prompt", default="512,2048", help="prompt lengths; empty: none")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--q-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    q_dtype = getattr(torch, args.q_dtype)
    print("command: python", " ".join(sys.argv))
    with tempfile.TemporaryDirectory(prefix="iterserve-ab-") as tmp:
        kernels = [build(checkout(args.base, Path(tmp))), build(Path(cpu_kernels.SOURCE))]
        print(f"{'case':<40} {args.base[:9]:>9} {'tree':>9}   ratio (ms)")
        with torch.inference_mode():
            for case in filter(None, args.decode.split(",")):
                batch, context = (int(n) for n in case.split("x"))
                for kv in args.kv.split(","):
                    print(row(f"decode {kv} B={batch} context {context}",
                              *decode_case(kernels, kv, batch, context, args.layout, args.repeats, q_dtype)),
                          flush=True)
            for tokens in filter(None, args.prompt.split(",")):
                print(row(f"prompt one layer, {tokens} tokens",
                          *prompt_case(kernels, int(tokens), args.repeats, q_dtype)),
                      flush=True)


if __name__ == "__main__":
    main()
