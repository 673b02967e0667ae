"""How fast the simulator runs: N requests through the real engine + scheduler on a virtual clock.

    .venv/bin/python benchmarks/sim_speed.py [--num-requests 10000] [--model llama-2-7b --hardware a100-80gb]

Acceptance: 10,000 requests in under 10 s of wall time on the development machine (2 cores).
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--hardware", default="a100-80gb")
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals, requests/s (0: offline)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--scheduling", default="continuous")
    args = p.parse_args()
    print(f"$ python benchmarks/sim_speed.py {shlex.join(sys.argv[1:])}")
    # the `make bench` workload (prompt 128, outputs exponential mean 128 capped at 512), Poisson arrivals
    trace = make_trace(args.num_requests, LengthDist("fixed", 128), LengthDist("exponential", 128, high=512),
                       arrivals="poisson" if args.rate else "offline", request_rate=args.rate or None, seed=0)
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
          f"-> {'PASS' if total < 10 else 'FAIL'} (< 10 s wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
