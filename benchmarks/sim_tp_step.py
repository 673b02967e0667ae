"""The simulator's step times under tensor parallelism: TP=1/2/4/8 for an 8B and a 70B model.

    python benchmarks/sim_tp_step.py [--hardware h100-sxm] [--models llama-3-8b,llama-3-70b]
                                     [--batches 1,32,128] [--context 1024] [--prefill 2048]

The cost model (iterserve/sim/cost_model.py), not a measurement: per GPU, weights, heads and K/V
divide by tp; each layer adds two all-reduces of the step's activations (a fixed latency plus
2 (tp-1)/tp x hidden bytes per token over the interconnect). Prints ms per step and the all-reduce
share, and whether the weights fit the GPUs at all.
"""
from __future__ import annotations

import argparse
import sys

from iterserve.sim.cost_model import CostModel
from iterserve.sim.hardware import get_hardware
from iterserve.sim.model_spec import get_model_spec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hardware", default="h100-sxm")
    p.add_argument("--models", default="llama-3-8b,llama-3-70b")
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill", type=int, default=2048)
    args = p.parse_args()
    hw = get_hardware(args.hardware)
    batches = [int(b) for b in args.batches.split(",")]
    print("$ python " + " ".join(sys.argv))
    print(f"{hw.name}; decode: B requests x {args.context} tokens of context; prefill: one {args.prefill}-token prompt")
    cols = "".join(f"{'decode B=' + str(b):>16}" for b in batches)
    print(f"{'model':<12} {'tp':>3} {'fits':>5}{cols}{'prefill':>16}")
    for name in args.models.split(","):
        model = get_model_spec(name)
        for tp in (int(s) for s in args.sizes.split(",")):
            cost = CostModel(model, hw, tp)
            try:
                cost.num_kv_blocks()
                fits = "yes"
            except ValueError:
                fits = "no"
            cells = [cost.breakdown([1] * b, [args.context] * b) for b in batches]
            cells.append(cost.breakdown([args.prefill], [args.prefill]))
            row = "".join(f"{1e3 * c.total_s:>9.2f} ({c.allreduce_s / c.total_s:>3.0%})" for c in cells)
            print(f"{name:<12} {tp:>3} {fits:>5}{row}")
    print("ms per step (all-reduce share)")


if __name__ == "__main__":
    main()
