"""The linear layers alone, each weight format side by side: what a step's matmuls cost at a batch.

    python benchmarks/linear_kernels.py [--rows 1,32,64,512] [--formats bf16,w8a8,int8,int4] [--repeats 7]

The default model's linears (q/k/v fused, o, gate/up fused, down: 30 layers) with random weights of
their shapes, in the engine's packed formats: bf16 (the CPU panel kernel's layout for this CPU, or
oneDNN's), w8a8 (int8 panels under int8 activations, AVX-512 VNNI), int8 / int4 (weight-only: the panel
kernel's, summed in integers, on AVX2 without AVX-512; PyTorch's kernels elsewhere). Each row count runs
every format in turn, `--repeats` times over, alternated so that a busy minute hits them all; the best
time of each is printed with its ratio to the first format's.
"""
from __future__ import annotations

import argparse
import time

import torch

from iterserve.model import cpu_kernels
from iterserve.model.quant import linear, pack_float, quantize

# SmolLM2-135M: hidden 576, 9 heads and 3 kv heads of 64, intermediate 1536
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def pack(w: torch.Tensor, fmt: str):
    return pack_float(w) if fmt == "bf16" else quantize(w, fmt)


def one_pass(weights: dict, xs: dict) -> float:
    t = time.perf_counter()
    for _ in range(LAYERS):
        for name, w in weights.items():
            linear(xs[name], w)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,32,64,512")
    ap.add_argument("--formats", default="bf16,w8a8,int8")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    formats = args.formats.split(",")
    if "w8a8" in formats and not cpu_kernels.linear_int8_supported():
        raise SystemExit("linear_kernels.py: w8a8 needs an AVX-512 VNNI build of cpu_linear.cpp; drop it from --formats")
    torch.manual_seed(0)
    floats = {name: torch.randn(shape).bfloat16() for name, shape in SHAPES.items()}
    packed = {fmt: {name: pack(w, fmt) for name, w in floats.items()} for fmt in formats}
    print(f"threads {torch.get_num_threads()}; {LAYERS} layers x {', '.join(SHAPES)}; best of {args.repeats} (ms)")
    print(f"{'rows':>5} " + " ".join(f"{f:>9}" for f in formats) + "".join(f"{formats[0] + '/' + f:>11}" for f in formats[1:]))
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {name: torch.randn(rows, shape[1]).bfloat16() for name, shape in SHAPES.items()}
            for weights in packed.values():
                one_pass(weights, xs)  # warm: caches, page faults, thread pool
            best = dict.fromkeys(formats, float("inf"))
            for _ in range(args.repeats):
                for fmt in formats:
                    best[fmt] = min(best[fmt], one_pass(packed[fmt], xs))
            ratios = "".join(f"{best[formats[0]] / best[f]:>11.2f}" for f in formats[1:])
            print(f"{rows:>5} " + " ".join(f"{best[f] * 1e3:>9.2f}" for f in formats) + ratios, flush=True)


if __name__ == "__main__":
    main()
