"""Weight-only int4 linears at an 8B model's shapes: PyTorch's int4pack kernel, iterserve's int4 (and int8)
panels on AMX tiles, and the bf16 pairs panels on AMX tiles, side by side.

    python benchmarks/int4_linear.py [--rows 1,16,32,128,2048] [--shapes q_o,kv,gate_up,down] [--repeats 5]

Llama-3.1-8B's linears (q/o 4096 x 4096, k/v 1024 x 4096, gate/up fused 28672 x 4096, down 4096 x 14336)
with random weights; x bfloat16. Each format is run `--repeats` times in turn, alternated, and the best time
is printed in ms with the weight bytes read per second (GB/s) and the arithmetic (GFLOP/s). The int4 and int8
panels need an AVX-512 BF16 build of cpu_linear.cpp (cpu_paths: weight_only_bf16; AMX tiles where there are some).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from iterserve.model import cpu_kernels, cpu_packing, cpu_paths
from iterserve.model.quant import INT4_GROUP

SHAPES = {"q_o": (4096, 4096), "kv": (1024, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def formats(n: int, k: int) -> dict:
    """name -> (call(x), weight bytes) for one [n, k] weight."""
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale = torch.rand(n, k // INT4_GROUP) * 0.01 + 1e-3
    low = -8 * scale
    zero = low + 8 * scale
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().bfloat16()
    tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    out = {"torch-int4": (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, tiles, INT4_GROUP, scales_zeros),
                          tiles.nbytes + scales_zeros.nbytes)}
    if cpu_paths.current().weight_only_bf16:
        int4 = cpu_packing.pack_int4_weight_panels(q, scale, low)
        int8 = cpu_packing.pack_int8_weight_panels((q - 8).to(torch.int8) * 15, torch.full((n,), 1e-3))
        out["int4-panels"] = (lambda x: cpu_kernels.linear_int4_weights(x, int4, n, k), int4.nbytes)
        out["int8-panels"] = (lambda x: cpu_kernels.linear_int8_weights(x, int8, n, k), int8.nbytes)
    w = (q - 8).bfloat16() * 1e-2
    pairs = cpu_packing.pack_panels(w, pairs=True)
    out["bf16-pairs"] = (lambda x: cpu_kernels.linear(x, pairs, n), pairs.nbytes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,32,128,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("$ python benchmarks/int4_linear.py " + " ".join(sys.argv[1:]))
    print(f"{cpu_paths.current().summary()}\nthreads {torch.get_num_threads()}; best of {args.repeats}")
    torch.manual_seed(0)
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            fmts = formats(n, k)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k).bfloat16()
                best = dict.fromkeys(fmts, float("inf"))
                for call, _ in fmts.values():
                    call(x)  # warm: caches, page faults, thread pool
                for _ in range(args.repeats):
                    for name, (call, _) in fmts.items():
                        t = time.perf_counter()
                        call(x)
                        best[name] = min(best[name], time.perf_counter() - t)
                cells = [f"{name} {best[name] * 1e3:8.2f} ms {nbytes / best[name] / 1e9:6.1f} GB/s "
                         f"{2 * rows * n * k / best[name] / 1e9:7.0f} GFLOP/s" for name, (_, nbytes) in fmts.items()]
                print(f"{shape:>8} {n}x{k} M={rows:<5} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
