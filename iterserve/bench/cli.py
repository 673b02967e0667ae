"""`iterserve bench`: one seeded trace through several targets, a table of ratios to the first,
optional JSON (every figure) and PNG plots; `--sweep` repeats it over one knob."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from iterserve.bench.metrics import Slo
from iterserve.bench.runner import build_report, check_targets, format_table, run_targets, shared_model_engines
from iterserve.entrypoints.args import HelpFormatter, add_engine_args, config_from_args, fail
from iterserve.bench.workload import (OUTPUT_DISTS, PROMPT_DISTS, SHAREGPT_OUTPUT_MEAN, SHAREGPT_PROMPT_MEAN,
                                      LengthDist, Trace, make_trace)

SWEEPABLE = ("max-num-seqs", "request-rate", "concurrency")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="iterserve bench", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--targets", default="continuous,static",
                   help="comma list of continuous, static, hf-static, http:URL (ratios are to the first); an "
                   "engine target takes engine flags after '+', e.g. continuous+no-prefix-caching, "
                   "continuous+preemption-mode=swap+num-kv-blocks=64")
    add_workload_args(p)
    add_engine_args(p, exclude={"seed", "scheduling"})  # --seed seeds both; the target picks the scheduling
    add_slo_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, help="write every figure to this path")
    o.add_argument("--plot", default=None, help="write PNG plots to this directory (needs iterserve[bench])")
    o.add_argument("--sweep", default=None, help=f"NAME=v1,v2,... with NAME in {', '.join(SWEEPABLE)}")
    o.add_argument("--http-model", default=None, help="model name for http targets (default: first of /v1/models)")
    o.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer key for http targets (default: env OPENAI_API_KEY)")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def add_workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=128, help="requests in the trace")
    w.add_argument("--prompt-len", type=int, default=None, help="prompt length, or its mean (default 128; "
                   f"{SHAREGPT_PROMPT_MEAN} for lognormal)")
    w.add_argument("--prompt-dist", choices=PROMPT_DISTS, default="fixed", help="prompt length distribution")
    w.add_argument("--prompt-min", type=int, default=1, help="shortest prompt")
    w.add_argument("--prompt-max", type=int, default=None, help="longest prompt (default: none)")
    w.add_argument("--output-dist", choices=OUTPUT_DISTS, default="exponential", help="output length distribution")
    w.add_argument("--output-mean", type=float, default=None,
                   help=f"mean output length (default 128; {SHAREGPT_OUTPUT_MEAN} for lognormal and mix chat)")
    w.add_argument("--output-min", type=int, default=1, help="shortest output")
    w.add_argument("--output-max", type=int, default=512, help="cap (exponential, lognormal, mix); upper bound (uniform)")
    w.add_argument("--sigma", type=float, default=None, help="lognormal shape (default: ShareGPT-like 0.9)")
    w.add_argument("--mix-fraction", type=float, default=0.5, help="mix: share of 1-8 token classification requests")
    w.add_argument("--request-rate", type=float, default=None, help="requests/s (Poisson; Gamma with --burstiness); "
                   "default: all at once")
    w.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape: < 1 burstier than Poisson")
    w.add_argument("--concurrency", type=int, default=None, help="closed loop: keep C requests in flight")
    w.add_argument("--shared-prefix-len", type=int, default=0,
                   help="every prompt starts with the same N tokens (a system prompt; prefix caching)")
    w.add_argument("--seed", type=int, default=0, help="seeds the trace and the engine")
    w.add_argument("--trace", default=None, help="replay this JSONL trace instead of generating one")
    w.add_argument("--save-trace", default=None, help="write the trace (with its prompt token ids) to JSONL")


def add_slo_args(p: argparse.ArgumentParser, seconds=float) -> None:
    o = p.add_argument_group("SLOs (goodput counts the requests that meet all given)")
    o.add_argument("--slo-ttft", type=seconds, default=None, help="on TTFT, seconds")
    o.add_argument("--slo-tpot", type=seconds, default=None, help="on TPOT, seconds")
    o.add_argument("--slo-e2e", type=seconds, default=None, help="on end-to-end latency, seconds")


def trace_from_args(args: argparse.Namespace) -> Trace:
    if args.trace:
        return Trace.load(args.trace)
    lognormal = ("lognormal", "mix")
    prompt = LengthDist(args.prompt_dist, args.prompt_len or (SHAREGPT_PROMPT_MEAN if args.prompt_dist in lognormal
                                                               else 128),
                        args.prompt_min, args.prompt_max, **_sigma(args))
    output = LengthDist(args.output_dist, args.output_mean or (SHAREGPT_OUTPUT_MEAN if args.output_dist in lognormal
                                                               else 128),
                        args.output_min, args.output_max, mix=args.mix_fraction, **_sigma(args))
    if args.concurrency:
        arrivals = "closed"
    elif args.request_rate:
        arrivals = "poisson" if args.burstiness == 1.0 else "gamma"
    else:
        arrivals = "offline"
    return make_trace(args.num_requests, prompt, output, arrivals=arrivals, request_rate=args.request_rate,
                      burstiness=args.burstiness, concurrency=args.concurrency, seed=args.seed,
                      shared_prefix_len=args.shared_prefix_len)


def _sigma(args: argparse.Namespace) -> dict:
    return {} if args.sigma is None else {"sigma": args.sigma}


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """Every engine setting the flags give (validated now: a bad value is one line, not a traceback)."""
    return config_from_args(args, seed=args.seed).flat()


def parse_sweep(text: str) -> tuple[str, list[float]]:
    name, _, values = text.partition("=")
    if name not in SWEEPABLE or not values:
        raise ValueError(f"--sweep wants NAME=v1,v2,... with NAME in {SWEEPABLE}, got {text!r}")
    return name, [float(v) for v in values.split(",")]


def format_sweep(name: str, points: list[tuple[float, dict]]) -> str:
    head = (f"{name:>14}{'target':>14}{'out tok/s':>11}{'req/s':>8}{'TTFT mean':>11}{'TTFT p99':>10}"
            f"{'TPOT mean':>11}{'e2e p99':>9}{'goodput':>9}")
    rows = [head, "-" * len(head)]
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    for value, report in points:
        for t in report["targets"]:
            rows.append(f"{value:>14g}{t['name'][:13]:>14}{f(t['output_tokens_per_s'], 1):>11}"
                        f"{f(t['requests_per_s'], 2):>8}{f(t['ttft_s']['mean']):>11}{f(t['ttft_s']['p99']):>10}"
                        f"{f(t['tpot_s']['mean'], 4):>11}{f(t['e2e_s']['p99'], 2):>9}{f(t['goodput_rps'], 2):>9}")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args, argv)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    check_targets(targets)
    slo = Slo(args.slo_ttft, args.slo_tpot, args.slo_e2e)
    progress = not args.no_progress
    print(f"$ iterserve bench {shlex.join(argv)}")
    if args.sweep:
        return _sweep(args, targets, slo, progress)
    trace = trace_from_args(args)
    kw = engine_kwargs_from_args(args)
    results = run_targets(trace, targets, kw, progress, http_model=args.http_model, api_key=args.api_key)
    if args.save_trace:
        trace.save(args.save_trace)
    report = build_report(report_config(args, trace, kw), results, slo)
    print(trace_line(trace))
    print(format_table(report))
    print(memory_line(results))
    write_report(report, args.json)
    if args.plot:
        plot_all = plots().plot_all
        for path in plot_all(results, args.plot):
            print(f"wrote {path}")
    return 0


def _sweep(args: argparse.Namespace, targets: list[str], slo: Slo, progress: bool) -> int:
    name, values = parse_sweep(args.sweep)
    points, flat = [], []
    factory = shared_model_engines()  # one model load for the whole sweep
    for value in values:
        attr = name.replace("-", "_")
        setattr(args, attr, int(value) if name != "request-rate" else value)
        trace, kw = trace_from_args(args), engine_kwargs_from_args(args)
        results = run_targets(trace, targets, kw, progress, factory, http_model=args.http_model, api_key=args.api_key)
        report = build_report(report_config(args, trace, kw), results, slo)
        points.append((value, report))
        flat += [{**t, "sweep": {name: value}} for t in report["targets"]]
        print(f"{name}={value:g}: " + ", ".join(f"{t['name']} {t['output_tokens_per_s']:.1f} tok/s"
                                                for t in report["targets"]), file=sys.stderr)
    print(format_sweep(name, points))
    report = {"config": {**points[0][1]["config"], "sweep": {"param": name, "values": values}}, "targets": flat}
    write_report(report, args.json)
    if args.plot:
        print(f"wrote {plots().plot_sweep(name, points, args.plot)}")
    return 0


def plots():
    """The plotting module, whose matplotlib comes with the `bench` extra."""
    try:
        from iterserve.bench import plots as module
    except ImportError as exc:
        raise ValueError(f"--plot needs matplotlib ({exc}): pip install 'iterserve[bench]'") from None
    return module


def memory_line(results) -> str:
    """Resident memory of this process around each engine target (the model, KV pool and run)."""
    gb = lambda b: "-" if b is None else f"{b / 1e9:.2f} GB"  # noqa: E731
    parts = [f"{r.name} {gb(r.extra['rss_start_bytes'])} at start, {gb(r.extra['rss_end_bytes'])} after"
             for r in results if "rss_start_bytes" in r.extra]
    return "resident memory: " + ("; ".join(parts) or "no engine target")


def report_config(args: argparse.Namespace, trace: Trace, kw: dict) -> dict:
    return {"argv": vars(args), "engine": kw, "trace": trace.meta, "concurrency": trace.concurrency,
            "num_requests": len(trace), "total_output_tokens": trace.total_output_tokens}


def trace_line(trace: Trace) -> str:
    p = [r.prompt_len for r in trace.requests]
    o = [r.output_len for r in trace.requests]
    return (f"trace: {len(trace)} requests, prompt mean {sum(p) / len(p):.1f}, output mean {sum(o) / len(o):.1f} "
            f"(max {max(o)}), {trace.total_output_tokens} output tokens, arrivals "
            f"{trace.meta.get('arrivals', 'from file')}")


def write_report(report: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1))
        print(f"wrote {path}")
