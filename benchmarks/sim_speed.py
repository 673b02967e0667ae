"""How fast the simulator runs: N requests through the real engine + scheduler on a virtual clock.

    .venv/bin/python benchmarks/sim_speed.py [--num-requests 10000] [--model llama-2-7b --hardware a100-80gb]
    .venv/bin/python benchmarks/sim_speed.py --replicas 64 [--sim-workers 2 --load-report-interval 0.5]

Acceptance on the development machine (2 cores): one engine, 10,000 requests in under 10 s of wall
time; with --replicas (the multi-replica mode: `iterserve simulate --replicas N --router ...`, run
through that command's own code), 64 replicas x 100,000 requests in under 60 s.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

from iterserve.bench.metrics import summarize
from iterserve.bench.workload import LengthDist, make_trace, materialize_prompts
from iterserve.config import EngineConfig
from iterserve.sim.cli import simulate_trace
from iterserve.sim.hardware import get_hardware
from iterserve.sim.model_spec import get_model_spec

# Defaults per mode: one engine (the `make bench` shape) or a cluster (short chats sharing a system prompt).
SINGLE = {"num_requests": 10_000, "rate": 20.0, "output_mean": 128, "max_num_seqs": 256, "shared_prefix_len": 0,
          "limit_s": 10.0}
CLUSTER = {"num_requests": 100_000, "rate": 2000.0, "output_mean": 32, "max_num_seqs": 64, "shared_prefix_len": 64,
           "limit_s": 60.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=None, help="default 10,000 (100,000 with --replicas)")
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--hardware", default="a100-80gb")
    p.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals, requests/s (0: offline); default 20 (2000 with --replicas)")
    p.add_argument("--output-mean", type=int, default=None, help="exponential outputs' mean; default 128 (32)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default 256 (64 with --replicas)")
    p.add_argument("--shared-prefix-len", type=int, default=None, help="default 0 (64 with --replicas)")
    p.add_argument("--scheduling", default="continuous")
    p.add_argument("--replicas", type=int, default=1, help="> 1: the multi-replica mode (default case 64)")
    p.add_argument("--router", default="prefix-affinity")
    p.add_argument("--sim-workers", type=int, default=1)
    p.add_argument("--load-report-interval", type=float, default=0.0,
                   help="--replicas: how often the router reads loads (0: every arrival)")
    args = p.parse_args()
    preset = CLUSTER if args.replicas > 1 else SINGLE
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    print(f"$ python benchmarks/sim_speed.py {shlex.join(sys.argv[1:])}")
    return run_cluster_case(args) if args.replicas > 1 else run_single(args)


def run_single(args: argparse.Namespace) -> int:
    # the `make bench` workload (prompt 128, outputs exponential mean 128 capped at 512), Poisson arrivals
    trace = make_trace(args.num_requests, LengthDist("fixed", 128),
                       LengthDist("exponential", args.output_mean, high=512),
                       arrivals="poisson" if args.rate else "offline", request_rate=args.rate or None, seed=0,
                       shared_prefix_len=args.shared_prefix_len)
    cpu0 = time.process_time()
    t = time.perf_counter()
    materialize_prompts(trace, None)
    t_prompts = time.perf_counter() - t
    config = EngineConfig(max_num_seqs=args.max_num_seqs, scheduling=args.scheduling)
    t = time.perf_counter()
    result = simulate_trace(trace, config, get_model_spec(args.model), get_hardware(args.hardware))
    t_sim = time.perf_counter() - t
    t = time.perf_counter()
    s = summarize(result, per_request=False)
    t_sum = time.perf_counter() - t
    total = t_prompts + t_sim + t_sum
    cpu = time.process_time() - cpu0  # what the run costs with the cores to itself; wall includes other jobs
    print(f"{args.num_requests} requests, {trace.total_output_tokens} output tokens, {s['num_steps']} steps, "
          f"{s['duration_s']:.0f} simulated s ({s['output_tokens_per_s']:.0f} tok/s, mean batch {s['mean_batch_size']:.1f})")
    print(f"wall: {total:.2f} s = prompts {t_prompts:.2f} + simulation {t_sim:.2f} + metrics {t_sum:.2f} "
          f"({t_sim / max(1, s['num_steps']) * 1e6:.0f} us/step); CPU time {cpu:.2f} s "
          f"-> {verdict(total, args.limit_s)}")
    return 0


def run_cluster_case(args: argparse.Namespace) -> int:
    """The whole `iterserve simulate --replicas` command (trace, prompts, simulation, report), timed."""
    from iterserve.sim.cli import build_parser, run_simulation
    argv = ["--num-requests", str(args.num_requests), "--targets", args.scheduling, "--replicas", str(args.replicas),
            "--router", args.router, "--output-mean", str(args.output_mean),
            "--shared-prefix-len", str(args.shared_prefix_len), "--max-num-seqs", str(args.max_num_seqs),
            "--model", args.model, "--hardware", args.hardware, "--sim-workers", str(args.sim_workers),
            "--load-report-interval", str(args.load_report_interval)]
    if args.rate:
        argv += ["--request-rate", str(args.rate)]
    sim_args = build_parser().parse_args(argv)
    sim_args.argv = argv
    cpu0 = time.process_time()
    t = time.perf_counter()
    run_simulation(sim_args)
    total = time.perf_counter() - t
    cpu = time.process_time() - cpu0  # this process only: worker processes' CPU is not in it
    print(f"wall: {total:.2f} s for the whole command (the 'simulated in' figure above is the event loop "
          f"alone); CPU time {cpu:.2f} s -> {verdict(total, args.limit_s)}")
    return 0


def verdict(wall_s: float, limit_s: float) -> str:
    return f"{'PASS' if wall_s < limit_s else 'FAIL'} (< {limit_s:.0f} s wall)"


if __name__ == "__main__":
    sys.exit(main())
