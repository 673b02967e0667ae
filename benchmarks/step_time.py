"""Decode step time: iterserve's ModelRunner vs transformers' own model, against the roofline.

    python benchmarks/step_time.py [--batches 1,8,32,64] [--context 256] [--dtype bfloat16] [--repeats 5]
                                   [--quantization int8|int4|w8a8] [--threads 1] [--no-hf] [--parts]

For each batch size B, every sequence has `context` tokens already in the KV cache and decodes one
token. Prints per-step medians (ms) for: iterserve, transformers (DynamicCache prefilled to the same
length), a bare pass through all linear layers + LM head with the model's weights (packed
or quantized), the same pass through F.linear on plain weights, and the roofline (weight bytes / measured
copy bandwidth, FLOPs / measured matmul peak). The machine is shared: treat +-20% as noise.

--parts: then, per B, where the step's time goes: the decoder layers' parts summed over layers
(cpu_decode.cpp's own timers: norms, the four linears, rotary, the K/V write, attention, silu-and-mul),
the LM head (timed bare at the step's shape) and the rest (embedding, final norm, sampling, Python).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.model.quant import Weight, linear
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput


def timed(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bandwidth() -> float:
    src = torch.empty(64 * 2**20, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return 2 * src.nbytes / timed(lambda: dst.copy_(src), 5)


def matmul_peak(dtype: torch.dtype) -> float:
    """Multiply-adds x 2 a second of a 2048^3 matmul; int8: torch._int_mm (oneDNN's VNNI kernel, int32 sums)."""
    if dtype == torch.int8:
        a, b = (torch.randint(-127, 128, (2048, 2048), dtype=torch.int8) for _ in range(2))
        return 2 * 2048**3 / timed(lambda: torch._int_mm(a, b), 3)
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    return 2 * 2048**3 / timed(lambda: a @ b, 3)


def decode_plan(batch: int, context: int, blocks_per_seq: int) -> SchedulerOutput:
    greedy = SamplingParams(temperature=0.0)
    return SchedulerOutput(scheduled=[
        ScheduledRequest(f"r{i}", [100 + i], context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                         True, greedy, output_len=1) for i in range(batch)])


def linear_weights(runner: ModelRunner) -> list[Weight]:
    m = runner.model
    return [w for layer in m.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [m.lm_head]


def bare_linear(weights: list[Weight], x: torch.Tensor, lm_x: torch.Tensor) -> None:
    for w in weights[:-1]:  # the same [B, in] -> [B, out] shapes as a step (inputs sized per weight)
        linear(x[:, : w.shape[1]].contiguous(), w)
    linear(lm_x, weights[-1])


def bare_time(weights: list[Weight], batch: int, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of the bare linear pass at a decode step's shapes."""
    x = torch.randn(batch, max(w.shape[1] for w in weights), dtype=dtype)
    return timed(lambda: bare_linear(weights, x, x[:, : weights[-1].shape[1]]), repeats)


def ours_and_bare(runner: ModelRunner, weights: list[Weight], batch: int, context: int, blocks_per_seq: int,
                  repeats: int) -> tuple[float, float]:
    """Median seconds of one decode step at this batch, and of the bare linear pass at its shapes."""
    ours = timed(lambda: runner.execute(decode_plan(batch, context, blocks_per_seq)), repeats)
    return ours, bare_time(weights, batch, runner.dtype, repeats)


def step_parts(runner: ModelRunner, batch: int, context: int, blocks_per_seq: int, repeats: int) -> str:
    """One line: a decode step's milliseconds per part (see --parts)."""
    layers = runner.model.decode_layers
    if layers is None:
        return f"{batch:>4}: no parts (this model's layers run in the Python loop, which has no timers)"
    runner.execute(decode_plan(batch, context, blocks_per_seq))
    layers.time_parts()
    start = time.perf_counter()
    for _ in range(repeats):
        runner.execute(decode_plan(batch, context, blocks_per_seq))
    step = (time.perf_counter() - start) / repeats
    parts = {name: seconds / repeats for name, seconds in layers.parts().items()}
    layers.time_parts(False)
    if not any(parts.values()):
        return f"{batch:>4}: no parts (this step did not run in cpu_decode.cpp)"
    lm_head = runner.model.lm_head
    x = torch.randn(batch, lm_head.shape[1], dtype=runner.dtype)
    parts["lm_head"] = timed(lambda: linear(x, lm_head), repeats)
    parts["rest"] = step - sum(parts.values())
    return f"{batch:>4}: {step * 1e3:.1f} ms = " + ", ".join(f"{k} {v * 1e3:.3g}" for k, v in parts.items())


def hf_model(path: str, dtype: torch.dtype):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from conftest import load_hf_gguf_model  # transformers' own GGUF loader, as the tests use it
    return load_hf_gguf_model(path, dtype)


def hf_step_fn(model, batch: int, context: int, dtype: torch.dtype):
    from transformers import DynamicCache
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache()
    for layer in range(cfg.num_hidden_layers):
        kv = torch.randn(2, batch, cfg.num_key_value_heads, context, head_dim, dtype=dtype) * 0.1
        cache.update(kv[0], kv[1], layer)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1))
    pos = torch.full((batch, 1), context)

    def step():
        model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the token just appended: every step sees the same context
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8"])
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (saves its load time)")
    ap.add_argument("--parts", action="store_true", help="then, per B, where a step's time goes")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print("command: python", " ".join(sys.argv))
    bps = -(-(args.context + 2) // 16)
    runner = ModelRunner(EngineConfig(dtype=args.dtype, num_kv_blocks=max(batches) * bps, num_threads=args.threads,
                                       quantization=args.quantization))
    runner.kv_cache.normal_(0, 0.1)  # a "pre-filled" cache: decode cost does not depend on the values
    dtype = runner.dtype
    weights = linear_weights(runner)
    wbytes = sum(w.nbytes for w in weights)
    bw, peak = bandwidth(), matmul_peak(dtype)
    print(f"dtype {dtype}, quantization {args.quantization}, threads {torch.get_num_threads()}, linear weights {wbytes / 1e6:.0f} MB, "
          f"copy bandwidth {bw / 1e9:.1f} GB/s, matmul peak {peak / 1e9:.0f} GFLOP/s")
    hf = None if args.no_hf else hf_model(runner.config.model_config.model or __import__(
        "iterserve.model.loader", fromlist=["x"]).default_model_path(), dtype)
    # plain float weights of the same shapes through F.linear: the bare pass without packing
    # (or quantization); the matmul's cost does not depend on the values
    plain = [torch.randn(*w.shape, dtype=dtype) * 0.02 for w in weights]
    print(f"{'B':>4} {'iterserve':>10} {'transformers':>13} {'ratio':>6} {'bare linear':>12} {'x bare':>7} "
          f"{'F.linear':>9} {'roof mem':>9} {'roof flop':>10}   (ms per decode step, context {args.context})")
    with torch.inference_mode():
        for b in batches:
            ours, bare = ours_and_bare(runner, weights, b, args.context, bps, args.repeats)
            unpacked = bare_time(plain, b, dtype, args.repeats)
            theirs = timed(hf_step_fn(hf, b, args.context, dtype), args.repeats) if hf is not None else float("nan")
            flops = 2 * b * sum(w.shape[0] * w.shape[1] for w in weights)
            print(f"{b:>4} {ours * 1e3:>10.1f} {theirs * 1e3:>13.1f} {ours / theirs:>6.2f} {bare * 1e3:>12.1f} "
                  f"{ours / bare:>7.2f} {unpacked * 1e3:>9.1f} {wbytes / bw * 1e3:>9.1f} {flops / peak * 1e3:>10.1f}", flush=True)
        if args.parts:
            print(f"where a step goes (ms, the layers' parts summed over {len(runner.model.layers)} layers):")
            for b in batches:
                print(step_parts(runner, b, args.context, bps, args.repeats), flush=True)


if __name__ == "__main__":
    main()
