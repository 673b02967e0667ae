"""`iterserve diagnose BENCH.json`: the server's capacity diagnostics, offline, over a bench or simulate
report (`--json`): each engine target's steps and requests go through the same checks, and an SLO
missed is replayed through the simulator for a setting that meets it.

    iterserve diagnose bench.json --slo-tpot 50ms
    iterserve diagnose sim.json --target continuous --hardware a100-80gb
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from iterserve.engine.diagnostics import (
    Capacity, Diagnostics, FinishedRequest, Slo, StartedRequest, StepSample, Thresholds,
)
from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.entrypoints.args import HelpFormatter, add_config_args, config_from_args, fail
from iterserve.sim.hardware import HardwareSpec
from iterserve.sim.model_spec import with_kv_cache_dtype
from iterserve.sim.tune import parse_seconds
from iterserve.sim.whatif import SimulatorWhatIf

DEFAULT_BLOCK_SIZE, DEFAULT_BUDGET = 16, 2048


def diagnostics_of(target: dict, engine: dict, slo: Slo, whatif=None, bytes_per_block: int | None = None) -> Diagnostics:
    """A Diagnostics fed with one report target (summarize's dict with its series and requests)."""
    extra, series = target.get("extra", {}), target.get("series", {})
    if not extra.get("num_kv_blocks") or "requests" not in target:
        raise ValueError(f"target {target.get('name')!r} has no engine settings or per-request figures "
                         "(only engine targets of a bench or simulate --json report can be diagnosed)")
    capacity = Capacity(extra["num_kv_blocks"], extra.get("block_size") or engine.get("block_size") or DEFAULT_BLOCK_SIZE,
                        extra.get("max_num_seqs") or engine.get("max_num_seqs") or 64,
                        extra.get("max_num_batched_tokens") or engine.get("max_num_batched_tokens") or DEFAULT_BUDGET,
                        bytes_per_block, prefix_caching=engine.get("enable_prefix_caching", True),
                        preemption_mode=engine.get("preemption_mode") or "recompute")
    thresholds = Thresholds(window_s=float("inf"))  # the whole run is the window
    diag = Diagnostics(capacity, slo, thresholds, whatif)
    for t, b, tokens, waiting, kv in zip(series.get("step_end_s", []), series.get("batch_size", []),
                                         series.get("num_batched_tokens", []), series.get("num_waiting", []),
                                         series.get("kv_usage", [])):
        diag.observe_step(StepSample(t, b, waiting, 0, kv, tokens, 0))
    for r in target["requests"]:
        diag.observe_started(StartedRequest(r["id"], r["arrival_s"], r["prompt_len"]))
        if r.get("e2e_s") is not None:
            diag.observe_finished(FinishedRequest(r["id"], r["arrival_s"] + r["e2e_s"], r["arrival_s"], r["prompt_len"],
                                                  r["output_len"], r.get("ttft_s"), r.get("tpot_s"),
                                                  r.get("preemptions", 0)))
    return diag


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="iterserve diagnose", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("report", help="a report written by `iterserve bench --json` or `iterserve simulate --json`, "
                   "or a trace (`--save-trace`), which is first simulated with the engine flags below")
    p.add_argument("--target", default=None, help="diagnose only this target (default: every engine target)")
    p.add_argument("--slo-ttft", type=parse_seconds, default=None, help="TTFT SLO, e.g. 500ms (default: the report's)")
    p.add_argument("--slo-tpot", type=parse_seconds, default=None, help="TPOT SLO, e.g. 50ms (default: the report's)")
    p.add_argument("--model", default=None, help="simulator model preset or path for the what-if "
                   "(default: the report's model; smollm2-135m for a CPU run)")
    p.add_argument("--hardware", default=None, help="simulator hardware preset for the what-if (default: the "
                   "report's simulated hardware, else cpu-local)")
    p.add_argument("--json", default=None, help="also write the diagnostics to this path")
    add_config_args(p, CacheConfig, "KV cache")  # for a trace: the settings it is simulated at
    add_config_args(p, SchedulerConfig, "scheduler", exclude=("scheduling", "static_padding"))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.getLogger("iterserve.diagnostics").setLevel(logging.ERROR)  # printed below instead
    path = Path(args.report)
    if not path.is_file():
        fail(f"cannot read {path}: no such file")
    engine_flags = [a.dest for g in parser._action_groups if g.title in ("KV cache", "scheduler")
                    for a in g._group_actions if getattr(args, a.dest) != a.default]
    if _is_trace(path):
        report = _simulate(path, args)
    elif engine_flags:
        fail(f"{', '.join('--' + f.replace('_', '-') for f in engine_flags)}: engine flags apply to a trace, "
             "not to a report (it was run with its own settings)")
    else:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            fail(f"cannot read {path}: {exc}")
    if not isinstance(report, dict) or "targets" not in report:
        fail(f"{path} is not a bench or simulate report (no 'targets') nor a trace")
    diagnose_report(report, args)
    return 0


def diagnose_report(report: dict, args: argparse.Namespace) -> None:
    config, engine = report.get("config", {}), report.get("config", {}).get("engine", {})
    targets = [t for t in report["targets"] if args.target in (None, t["name"]) and t.get("extra", {}).get("num_kv_blocks")]
    if not targets:
        fail(f"no engine target{' named ' + repr(args.target) if args.target else ''} in {args.report}")
    saved = (targets[0].get("slo") or {})
    slo = Slo(args.slo_ttft if args.slo_ttft is not None else saved.get("ttft_s"),
              args.slo_tpot if args.slo_tpot is not None else saved.get("tpot_s"))
    model, hw = _simulated_system(args, config, engine)
    out = {}
    for target in targets:
        base = {k: v for k, v in engine.items() if k not in ("model", "max_num_seqs", "max_num_batched_tokens")}
        whatif = SimulatorWhatIf(model, hw, {**base, "model": model.name})
        kv = with_kv_cache_dtype(model, engine.get("kv_cache_dtype") or "auto")  # the report's own pool
        bpb = kv.kv_bytes_per_token * (engine.get("block_size") or DEFAULT_BLOCK_SIZE)
        diag = diagnostics_of(target, engine, slo, whatif, bpb)
        found = diag.evaluate(max(target.get("duration_s") or 0.0, 0.0))
        print(f"{target['name']}: {len(found)} diagnostic{'s' if len(found) != 1 else ''} "
              f"(what-if on {model.name} / {hw.name})")
        for d in found.values():
            print(f"  [{d.kind}] {d.message}")
        out[target["name"]] = diag.report()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")


def _is_trace(path: Path) -> bool:
    with open(path) as f:
        first = f.readline()
    try:
        head = json.loads(first)
    except ValueError:  # a report's first line is "{" alone
        return False
    return isinstance(head, dict) and "trace" in head


def _simulate(path: Path, args: argparse.Namespace) -> dict:
    """A trace through the simulator at the given engine settings: the report `simulate --json` would write."""
    from iterserve.bench.metrics import Slo as BenchSlo
    from iterserve.bench.metrics import summarize
    from iterserve.bench.workload import Trace
    from iterserve.sim.cli import simulate_trace
    model, hw = _simulated_system(args, {}, {})
    config = config_from_args(args, model=model.name)
    engine = {k: v for k, v in config.flat().items() if v is not None}
    result = simulate_trace(Trace.load(path), config, model, hw, name="continuous")
    target = summarize(result, BenchSlo(args.slo_ttft, args.slo_tpot))
    return {"config": {"engine": engine, "simulator": {"model": model.name, "hardware": hw.to_json()}},
            "targets": [target]}


def _simulated_system(args: argparse.Namespace, config: dict, engine: dict):
    """The model and hardware the what-if replays on: the report's simulator, else this CPU."""
    from iterserve.sim.hardware import get_hardware
    from iterserve.sim.model_spec import get_model_spec
    sim = config.get("simulator") or {}
    if args.hardware:
        hw = get_hardware(args.hardware)
    elif sim.get("hardware"):
        hw = HardwareSpec.from_json(sim["hardware"])
    else:
        hw = get_hardware("cpu-local")
    name = args.model or sim.get("model") or engine.get("model") or "smollm2-135m"
    return get_model_spec(name), hw
