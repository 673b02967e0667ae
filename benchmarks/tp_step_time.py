"""Decode step time under tensor parallelism: TP=2 (2 ranks x T/2 threads) against TP=1 (1 process x T threads).

    python benchmarks/tp_step_time.py [--model HF_DIR] [--threads 2] [--batches 1,8,32] [--context 256]
                                      [--dtype bfloat16] [--quantization int8|int4] [--repeats 10]
                                      [--layers 30 --hidden 512 --heads 8 --kv-heads 4 --intermediate 1536]

Without --model it writes a random-weight Llama of the given shape (default: the default model's
size, 135M-class, with 8/4 heads, since its own 9/3 do not split in two) and its tokenizer to a
temporary directory. For each batch size B, every sequence has `context` tokens in the KV cache and
decodes one token. Per-step medians (ms):
  tp1        ModelRunner.execute in this process, --threads threads
  tp2 rank   the same step on rank 0 of 2 (each rank --threads/2 threads), timed inside the rank
  collect.   of that, time inside all_reduce / all_gather (includes waiting for the slower rank)
  tp2 exec   TPExecutor.execute seen from the engine process: the rank step + pickling the plan to
             both ranks and the result back
The machine must be quiet: on 2 cores, any other process lands on a rank's core.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.executor.tp_executor import TPExecutor, build_rank
from step_time import decode_plan, timed


class TimedCollectives:
    """Wraps a rank's TensorParallel, adding up the seconds spent in its collectives."""

    def __init__(self, tp) -> None:
        self.tp, self.seconds = tp, 0.0

    def all_reduce(self, x):
        t = time.perf_counter()
        y = self.tp.all_reduce(x)
        self.seconds += time.perf_counter() - t
        return y

    def gather_logits(self, logits):
        t = time.perf_counter()
        y = self.tp.gather_logits(logits)
        self.seconds += time.perf_counter() - t
        return y


def random_checkpoint(args, path: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from iterserve.model.loader import default_model_path, load_tokenizer
    tok = load_tokenizer(default_model_path())
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=len(tok),
                      max_position_embeddings=max(2048, args.context + 16), tie_word_embeddings=True)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def rank_main(rank: int, config: EngineConfig, port: int, batches: list[int], context: int, bps: int,
              repeats: int, results) -> None:
    runner = build_rank(rank, 2, config, port)
    runner.kv_cache.normal_(0, 0.1)
    runner.model.tp = timer = TimedCollectives(runner.model.tp)
    for b in batches:
        plan = decode_plan(b, context, bps)
        runner.execute(plan)  # warm up
        steps, shares = [], []
        for _ in range(repeats):
            timer.seconds = 0.0
            t = time.perf_counter()
            runner.execute(plan)
            steps.append(time.perf_counter() - t)
            shares.append(timer.seconds)
        if rank == 0:
            results.put((b, statistics.median(steps), statistics.median(shares)))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF directory (heads divisible by 2); default: random weights")
    p.add_argument("--threads", type=int, default=2, help="TP=1 threads; each of the 2 ranks gets half")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"])
    p.add_argument("--repeats", type=int, default=10)
    for name, default in (("layers", 30), ("hidden", 512), ("heads", 8), ("kv-heads", 4), ("intermediate", 1536)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    bps = -(-(args.context + 1) // 16)
    tmp = tempfile.TemporaryDirectory()
    model = args.model or random_checkpoint(args, tmp.name)
    common = dict(model=model, dtype=args.dtype, quantization=args.quantization,
                  num_kv_blocks=max(batches) * bps, use_cuda_graphs=False)

    runner = ModelRunner(EngineConfig(**common, num_threads=args.threads))
    runner.kv_cache.normal_(0, 0.1)  # a "pre-filled" cache: unwritten pages all read as one zero page
    tp1 = {b: timed(lambda: runner.execute(decode_plan(b, args.context, bps)), args.repeats) for b in batches}
    del runner

    rank_config = EngineConfig(**common, num_threads=max(1, args.threads // 2), tensor_parallel_size=2)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, rank_config, store.port, batches, args.context, bps,
                                                 args.repeats, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    ranks = {b: (step, share) for b, step, share in (results.get(timeout=1800) for _ in batches)}
    for proc in procs:
        proc.join(60)

    executor = TPExecutor(rank_config)
    try:
        tp2_exec = {b: timed(lambda: executor.execute(decode_plan(b, args.context, bps)), args.repeats)
                    for b in batches}
    finally:
        executor.shutdown()

    print("$ python " + " ".join(sys.argv))
    shape = f"random, layers {args.layers}, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, " \
            f"intermediate {args.intermediate}"
    print(f"decode step, context {args.context}, {args.threads} threads in all, dtype {args.dtype}, "
          f"quantization {args.quantization}; model: {args.model or shape}")
    print(f"{'B':>4} {'tp1 ms':>9} {'tp2 rank ms':>12} {'collect. ms':>12} {'share':>6} {'tp2 exec ms':>12} {'speedup':>8}")
    for b in batches:
        step, share = ranks[b]
        print(f"{b:>4} {1e3 * tp1[b]:>9.2f} {1e3 * step:>12.2f} {1e3 * share:>12.2f} {share / step:>6.0%} "
              f"{1e3 * tp2_exec[b]:>12.2f} {tp1[b] / tp2_exec[b]:>7.2f}x")


if __name__ == "__main__":
    main()
