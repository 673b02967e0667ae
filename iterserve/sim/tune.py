"""`iterserve tune`: search max-num-seqs x max-num-batched-tokens with the simulator for the
highest goodput (requests/s meeting every SLO) at a given request rate.

    iterserve tune --model llama-2-7b --hardware a100-80gb --slo-ttft 1s --slo-tpot 100ms --rate 8

Every setting runs the same seeded trace through a fresh simulated engine (continuous batching);
the table lists them best first and marks the frontier: the settings no other beats on both
goodput and p99 end-to-end latency.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from iterserve.bench.metrics import Slo, summarize
from iterserve.config import EngineConfig
from iterserve.entrypoints.args import HelpFormatter, add_engine_args, fail
from iterserve.sim.cli import add_model_args, resolve, simulate_trace

_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0}


def parse_seconds(text: str | float) -> float:
    """'1s' -> 1.0, '100ms' -> 0.1, '0.5' -> 0.5."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e-?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _SECONDS:
        raise argparse.ArgumentTypeError(f"cannot read a duration from {text!r} (examples: 1s, 100ms, 0.25)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:g}s"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@dataclass(slots=True)
class TunePoint:
    max_num_seqs: int
    max_num_batched_tokens: int
    goodput_rps: float
    throughput_tps: float
    ttft_p99: float | None
    tpot_p99: float | None
    e2e_p99: float | None
    preemptions: int
    frontier: bool = False
    met_share: float = 0.0  # share of the trace's requests that met every SLO


def search(trace, model, hw, slo: Slo, seqs: list[int], budgets: list[int],
           base: dict | None = None) -> list[TunePoint]:
    """Every (max_num_seqs, max_num_batched_tokens) pair on the same trace, best goodput first."""
    points = []
    for s in seqs:
        for b in budgets:
            config = EngineConfig(**{**(base or {}), "max_num_seqs": s, "max_num_batched_tokens": b})
            res = summarize(simulate_trace(trace, config, model, hw), slo, per_request=False)
            points.append(TunePoint(s, b, res["goodput_rps"], res["output_tokens_per_s"], res["ttft_s"]["p99"],
                                    res["tpot_s"]["p99"], res["e2e_s"]["p99"], res["preemptions"],
                                    met_share=res["goodput_rps"] * res["duration_s"] / max(1, len(trace))))
    mark_frontier(points)
    return sorted(points, key=lambda p: (-p.goodput_rps, p.e2e_p99 or 0.0))


def mark_frontier(points: list[TunePoint]) -> None:
    """Pareto frontier of (goodput higher, p99 e2e lower)."""
    inf = float("inf")
    for p in points:
        pe = p.e2e_p99 if p.e2e_p99 is not None else inf
        p.frontier = not any(q.goodput_rps >= p.goodput_rps and (q.e2e_p99 if q.e2e_p99 is not None else inf) <= pe
                             and (q.goodput_rps > p.goodput_rps or (q.e2e_p99 or inf) < pe) for q in points)


def format_points(points: list[TunePoint]) -> str:
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    head = (f"{'':2}{'max-num-seqs':>13}{'batched-tok':>12}{'goodput':>9}{'out tok/s':>11}{'TTFT p99':>10}"
            f"{'TPOT p99':>10}{'e2e p99':>9}{'preempt':>9}")
    rows = [head, "-" * len(head)]
    for p in points:
        rows.append(f"{'*' if p.frontier else '':2}{p.max_num_seqs:>13}{p.max_num_batched_tokens:>12}"
                    f"{f(p.goodput_rps, 2):>9}{f(p.throughput_tps, 1):>11}{f(p.ttft_p99):>10}"
                    f"{f(p.tpot_p99, 4):>10}{f(p.e2e_p99, 2):>9}{p.preemptions:>9}")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    from iterserve.bench.cli import add_slo_args, add_workload_args
    p = argparse.ArgumentParser(prog="iterserve tune", description=__doc__, formatter_class=HelpFormatter)
    add_workload_args(p)
    add_engine_args(p, exclude={"seed", "scheduling", "max_num_seqs", "max_num_batched_tokens"})
    add_slo_args(p, seconds=parse_seconds)
    add_model_args(p)
    g = p.add_argument_group("search")
    g.add_argument("--rate", dest="request_rate", type=float, help="requests/s (same as --request-rate)")
    g.add_argument("--search-max-num-seqs", type=_ints, default="8,16,32,64,128,256",
                   help="max-num-seqs values to try")
    g.add_argument("--search-max-num-batched-tokens", type=_ints, default="512,1024,2048,4096,8192",
                   help="max-num-batched-tokens values to try")
    g.add_argument("--json", default=None, help="write every point to this path")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.slo_ttft is None and args.slo_tpot is None and args.slo_e2e is None:
        fail("give at least one SLO (--slo-ttft, --slo-tpot, --slo-e2e)")
    if not args.request_rate and not args.concurrency and not args.trace:
        fail("give a load (--rate R, --concurrency C or --trace)")
    from iterserve.bench.cli import engine_kwargs_from_args, trace_from_args
    try:
        model, hw = resolve(args)
        trace = trace_from_args(args)
        slo = Slo(args.slo_ttft, args.slo_tpot, args.slo_e2e)
        base = {**engine_kwargs_from_args(args), "model": model.name}
        print(f"$ iterserve tune {shlex.join(argv)}")
        print(f"simulated: {model.name} on {args.tensor_parallel_size} x {hw.name}; {len(trace)} requests at "
              f"{args.request_rate or '-'} req/s; SLO TTFT {_s(args.slo_ttft)}, TPOT {_s(args.slo_tpot)}, "
              f"e2e {_s(args.slo_e2e)}")
        points = search(trace, model, hw, slo, args.search_max_num_seqs, args.search_max_num_batched_tokens, base)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    print(format_points(points))
    best = points[0]
    print(f"best: --max-num-seqs {best.max_num_seqs} --max-num-batched-tokens {best.max_num_batched_tokens} "
          f"({best.goodput_rps:.2f} req/s within the SLOs; * = frontier of goodput vs p99 e2e)")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": argv, "points": [asdict(p) for p in points]}, indent=1))
        print(f"wrote {args.json}")
    return 0
