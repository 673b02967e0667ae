"""iterserve's decode step and prefill against this machine's roofline.

    python benchmarks/roofline.py [--batches 1,8,32,64] [--context 256] [--prompts 128,512]
                                  [--dtype auto] [--quantization int8|int4|w8a8] [--threads 1] [--repeats 5]

Measures the machine first: copy bandwidth (a 256 MB copy, bytes read + written) and the compute
peak: the faster of a 2048^3 torch matmul in the compute dtype (under w8a8: torch._int_mm's int8 one)
and the model's own linears at 512 rows (their packed weights, the rate a prefill's matmuls reach):
a roof below what the engine's own kernels do would let a step pass 100%. Then, per decode batch size
B (every sequence `context` tokens deep), the roofline of one step is max(bytes / bandwidth, FLOPs / peak) with
bytes = linear weights + LM head + the K/V each sequence reads, FLOPs = 2 x weights x B + attention;
per prompt length N (one fresh prompt, one step), FLOPs = 2 x layer weights x N + 2 x LM head (only
the last row is sampled) + causal attention, and the weights are read once. "reached" is roofline
time / measured time. The "bare linear" column is one pass through the same linear layers (the
model's own packed or quantized weights) at the same shapes and nothing else: the floor this
engine's own step can reach with its matmuls (the acceptance bar is step <= 1.43 x bare at B=64).
The machine may be shared: compare columns of one run, and run with --threads 1 when it is loaded.
"""
from __future__ import annotations

import argparse
import sys

import torch

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput
from step_time import (bandwidth, bare_time, linear_weights, matmul_peak,  # benchmarks/ is on sys.path
                       ours_and_bare, timed)

PEAK_ROWS = 512


def prefill_plan(n: int, block_size: int) -> SchedulerOutput:
    greedy = SamplingParams(temperature=0.0)
    return SchedulerOutput(scheduled=[ScheduledRequest("p", list(range(100, 100 + n)), 0,
                                                       list(range(-(-n // block_size))), True, greedy)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prompts", default="128,512")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("command: python", " ".join(sys.argv))
    batches, prompts = [int(b) for b in args.batches.split(",")], [int(n) for n in args.prompts.split(",")]
    bps = -(-(args.context + 2) // 16)
    blocks = max(max(batches) * bps, max(-(-n // 16) for n in prompts))
    runner = ModelRunner(EngineConfig(dtype=args.dtype, num_kv_blocks=blocks, num_threads=args.threads,
                                      quantization=args.quantization))
    runner.kv_cache.normal_(0, 0.1)  # a "pre-filled" cache: the cost does not depend on the values
    cfg, dtype = runner.arch, runner.dtype
    weights = linear_weights(runner)
    wbytes = sum(w.nbytes for w in weights)
    params = sum(w.shape[0] * w.shape[1] for w in weights)
    head_params = weights[-1].shape[0] * weights[-1].shape[1]  # linear_weights ends with the LM head
    kv_per_token = runner.kv_cache_spec.bytes_per_block // runner.block_size  # all layers, K and V
    attn_flops_per_pair = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # QK^T and PV, per (query, key)
    bw, torch_peak = bandwidth(), matmul_peak(dtype)
    torch_linear_peak = matmul_peak(torch.int8) if args.quantization == "w8a8" else torch_peak
    with torch.inference_mode():
        own_peak = 2 * PEAK_ROWS * params / bare_time(weights, PEAK_ROWS, dtype, 3)
    linear_peak = max(torch_linear_peak, own_peak)
    peak = linear_peak if args.quantization != "w8a8" else torch_peak  # attention's arithmetic is the dtype's
    unit = "GOP/s" if args.quantization == "w8a8" else "GFLOP/s"
    print(f"machine: copy bandwidth {bw / 1e9:.1f} GB/s; linears' peak {linear_peak / 1e9:.0f} {unit} (torch matmul "
          f"{torch_linear_peak / 1e9:.0f}, the model's own linears at {PEAK_ROWS} rows {own_peak / 1e9:.0f})"
          + (f", {dtype} matmul {peak / 1e9:.0f} GFLOP/s" if args.quantization == "w8a8" else "")
          + f"; threads {torch.get_num_threads()}")
    print(f"model: linear weights {wbytes / 1e6:.0f} MB ({args.quantization or dtype}), "
          f"K/V {kv_per_token / 1e3:.1f} kB per token")
    print(f"\ndecode, context {args.context} (ms per step)")
    print(f"{'B':>4} {'iterserve':>10} {'bare linear':>12} {'x bare':>7} {'roof':>7} {'bound':>6} {'reached':>8}")
    with torch.inference_mode():
        for b in batches:
            ours, bare = ours_and_bare(runner, weights, b, args.context, bps, args.repeats)
            mem = (wbytes + b * (args.context + 1) * kv_per_token) / bw
            flop = 2 * b * params / linear_peak + b * (args.context + 1) * attn_flops_per_pair / peak
            roof = max(mem, flop)
            print(f"{b:>4} {ours * 1e3:>10.1f} {bare * 1e3:>12.1f} {ours / bare:>7.2f} {roof * 1e3:>7.1f} "
                  f"{'mem' if mem >= flop else 'flop':>6} {roof / ours:>8.0%}", flush=True)
        print("\nprefill, one fresh prompt per step")
        print(f"{'tokens':>6} {'ms':>8} {'tokens/s':>9} {'roof tok/s':>11} {'reached':>8}")
        for n in prompts:
            ours = timed(lambda: runner.execute(prefill_plan(n, runner.block_size)), args.repeats)
            flop = (2 * n * (params - head_params) + 2 * head_params) / linear_peak + \
                n * (n + 1) / 2 * attn_flops_per_pair / peak
            roof = max(wbytes / bw, flop)
            print(f"{n:>6} {ours * 1e3:>8.1f} {n / ours:>9.0f} {n / roof:>11.0f} {roof / ours:>8.0%}", flush=True)


if __name__ == "__main__":
    main()
