"""Prefix caching, preemption modes and priority, each measured side by side on the real model.

    .venv/bin/python benchmarks/scheduling_features.py [--section prefix,preemption,priority] [--json PATH]

- prefix: 64 requests sharing a 400-token system prompt, with and without prefix caching:
  mean TTFT and prompt tokens computed (target: both drop >= 3x with caching).
- preemption: a mixed workload on a KV pool small enough to force preemption, through
  recompute, swap and auto (target: auto no slower than the better of the two).
- priority: a saturated engine, half the requests high priority: mean TTFT per class under
  fcfs and priority scheduling (target: high-priority TTFT >= 3x lower than low-priority).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

from iterserve.bench.runner import format_table, run_bench, shared_model_engines
from iterserve.bench.workload import LengthDist, make_trace, materialize_prompts
from iterserve.sampling_params import SamplingParams


def prefix(factory, threads):
    trace = make_trace(64, LengthDist("fixed", 480), LengthDist("fixed", 16), seed=0, shared_prefix_len=400)
    report = run_bench(trace, ["continuous", "continuous+no-prefix-caching"],
                       {"max_num_seqs": 32, "num_threads": threads}, engine_factory=factory)
    print(format_table(report))
    on, off = report["targets"]
    ttft = off["ttft_s"]["mean"] / on["ttft_s"]["mean"]
    tokens = off["prefill_tokens_computed"] / on["prefill_tokens_computed"]
    print(f"prefix caching: mean TTFT {off['ttft_s']['mean']:.3f} s -> {on['ttft_s']['mean']:.3f} s ({ttft:.1f}x), "
          f"prompt tokens computed {off['prefill_tokens_computed']} -> {on['prefill_tokens_computed']} ({tokens:.1f}x)")
    return {"ttft_drop": ttft, "prefill_tokens_drop": tokens, "report": _short(report)}


def preemption(factory, threads):
    trace = make_trace(48, LengthDist("uniform", 96, 32, 256), LengthDist("exponential", 96, high=256), seed=1)
    targets = [f"continuous+preemption-mode={m}" for m in ("recompute", "swap", "auto")]
    report = run_bench(trace, targets, {"max_num_seqs": 32, "num_kv_blocks": 256, "num_threads": threads},
                       engine_factory=factory)
    print(format_table(report))
    rec, swap, auto = (t["output_tokens_per_s"] for t in report["targets"])
    print(f"preemption: recompute {rec:.1f}, swap {swap:.1f}, auto {auto:.1f} tok/s; "
          f"auto / best = {auto / max(rec, swap):.2f}")
    return {"recompute": rec, "swap": swap, "auto": auto, "report": _short(report)}


def priority(factory, threads):
    out = {}
    trace = make_trace(48, LengthDist("fixed", 64), LengthDist("fixed", 48), seed=2)
    for policy in ("fcfs", "priority"):
        engine = factory("continuous", {"max_num_seqs": 8, "scheduling_policy": policy, "num_threads": threads})
        if any(r.prompt_token_ids is None for r in trace.requests):
            materialize_prompts(trace, engine.tokenizer)
        t0 = time.monotonic()
        for i, r in enumerate(trace.requests):  # all arrive at once; every other one is urgent
            engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=0,
                                                                  ignore_eos=True),
                               request_id=r.request_id, priority=i % 2, arrival_time=t0)
        ttft = {0: [], 1: []}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    ttft[int(o.request_id[1:]) % 2].append(o.times.ttft)
        high, low = (sum(v) / len(v) for v in (ttft[0], ttft[1]))
        out[policy] = {"high_ttft_s": high, "low_ttft_s": low, "ratio": low / high}
        print(f"priority ({policy}): mean TTFT high {high:.2f} s, low {low:.2f} s, low/high {low / high:.1f}x")
    return out


def _short(report):
    return [{k: t[k] for k in ("name", "output_tokens_per_s", "ttft_s", "tpot_s", "preemptions",
                               "prefill_tokens_computed")} for t in report["targets"]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", default="prefix,preemption,priority")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(f"$ python benchmarks/scheduling_features.py {shlex.join(sys.argv[1:])}")
    factory = shared_model_engines()
    results = {}
    for name in args.section.split(","):
        results[name] = {"prefix": prefix, "preemption": preemption, "priority": priority}[name](factory, args.threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
