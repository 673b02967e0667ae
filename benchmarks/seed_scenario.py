"""The seed's scenario at a real size (issue 41): continuous against static batching through ONE loaded
engine, the decode step-time curve that explains their ratio, and the simulator's prediction of both.

    python benchmarks/seed_scenario.py --json seed.json                   # model_shapes.py's 8b Q4_K_M
    python benchmarks/seed_scenario.py --model PATH --num-requests 16     # any GGUF file or HF directory

1. The trace: --num-requests requests of --prompt-len -> --output-len tokens, all arriving at once, greedy
   and ignore_eos, through the `continuous` and `static` targets of `iterserve bench` (its runner, one
   model load shared by both) with --max-num-seqs seats and a KV pool that seats them all whole.
2. The decode step-time curve of the same loaded model at --batches, every row at --context tokens
   (default: prompt + output / 2, a decode's mean context in the trace); step_time.py's plans and timer.
3. The simulator on the same trace and pool: a model spec of the same shape (read from the model's
   header) on this CPU's calibration (`iterserve calibrate`'s cpu-local profile, or --hardware-profile),
   and its decode step-time curve beside the measured one.
4. Why the ratio is what it is: each target's output tokens per step and seconds per step (their
   quotient is its throughput), its mean decode batch and decode step time against the curve there.
Every figure goes to --json.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))  # step_time.py and model_shapes.py beside this file
from model_shapes import DEFAULT_CACHE, paths  # noqa: E402
from step_time import decode_plan, linear_weights, timed  # noqa: E402

from iterserve.bench.cli import write_report  # noqa: E402
from iterserve.bench.metrics import TargetResult, summarize  # noqa: E402
from iterserve.bench.runner import build_report, run_targets, shared_model_engines  # noqa: E402
from iterserve.bench.workload import LengthDist, Trace, make_trace  # noqa: E402
from iterserve.config import EngineConfig  # noqa: E402
from iterserve.kv.kv_cache_manager import cdiv  # noqa: E402
from iterserve.sim.cli import resolve_cpu_profile, simulate_trace, step_time_table  # noqa: E402
from iterserve.sim.cost_model import CostModel  # noqa: E402
from iterserve.sim.hardware import SHIPPED_CPU_PROFILE, default_cpu_profile_path  # noqa: E402

TARGETS = ("continuous", "static")
FIGURES = (("out tok/s", "output_tokens_per_s"), ("TTFT mean s", "ttft_s"), ("TPOT mean s", "tpot_s"))


def figure(summary: dict, key: str) -> float:
    value = summary[key]
    return value["mean"] if isinstance(value, dict) else value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: model_shapes.py's 8b "
                   "Q4_K_M in --cache-dir if it is there, else the engine's default model)")
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="model_shapes.py's --cache-dir")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256, help="every output's length, or their mean")
    p.add_argument("--output-dist", choices=("fixed", "uniform"), default="fixed",
                   help="uniform: 1 .. 2 x --output-len - 1 (the same mean). With fixed lengths and every request "
                   "arriving at once, continuous batching has nothing to refill: it equals static by construction")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool (default: --max-num-seqs whole requests, and the curve's largest batch)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="the step-time curve's batch sizes")
    p.add_argument("--context", type=int, default=None, help="the curve's context (default: prompt + output / 2)")
    p.add_argument("--repeats", type=int, default=5, help="timings per curve point (the median is kept)")
    p.add_argument("--hardware-profile", default=None, help="a profile from `iterserve calibrate` "
                   "(default: cpu-local's, as `iterserve simulate --hardware cpu-local` reads it)")
    p.add_argument("--sim-dtype-bytes", type=int, default=None,
                   help="the model spec's bytes per weight (default: the profile's, as `iterserve simulate`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every figure to this path")
    return p.parse_args(argv)


def default_model(cache_dir: str) -> str | None:
    q4 = paths("8b", cache_dir).q4_k_m
    if q4.exists():
        return str(q4)
    print(f"{q4} is not there (make it: python benchmarks/model_shapes.py --shapes 8b --formats q4_k_m); "
          "running the engine's default model", flush=True)
    return None


def seed_trace(args: argparse.Namespace) -> Trace:
    output = (LengthDist("fixed", args.output_len) if args.output_dist == "fixed"
              else LengthDist("uniform", args.output_len, low=1, high=2 * args.output_len - 1))
    return make_trace(args.num_requests, LengthDist("fixed", args.prompt_len), output, seed=args.seed)


def engine_kwargs(args: argparse.Namespace, model: str | None, batches: list[int]) -> dict:
    """One pool for both targets and the curve: every seat a whole request, and the curve's largest batch."""
    block_size = EngineConfig().cache_config.block_size
    curve = max(batches) * curve_blocks_per_seq(args.context, block_size)
    if args.num_kv_blocks and args.num_kv_blocks < curve:  # found before the targets run, not after
        raise ValueError(f"the curve's batch {max(batches)} at context {args.context} needs {curve} KV blocks: "
                         f"--num-kv-blocks {args.num_kv_blocks} is fewer")
    longest = args.output_len if args.output_dist == "fixed" else 2 * args.output_len - 1
    blocks = args.num_kv_blocks or max(args.max_num_seqs * cdiv(args.prompt_len + longest, block_size), curve)
    return {"model": model, "max_num_seqs": args.max_num_seqs, "num_kv_blocks": blocks,
            "num_threads": args.num_threads, "seed": args.seed}


def curve_blocks_per_seq(context: int, block_size: int) -> int:
    return cdiv(context + 2, block_size)  # the context and the decoded token, as step_time.py sizes it


def keep_runner(factory):
    """The bench's engine factory, remembering the executor it loaded so the curve reuses the same model."""
    kept = []

    def make(scheduling: str, kw: dict):
        engine = factory(scheduling, kw)
        kept.append(engine.executor)
        return engine
    make.loads_model = factory.loads_model
    return make, kept


def step_curve(runner, batches: list[int], context: int, repeats: int) -> list[float]:
    """Median seconds of one decode step per batch size, every row at `context` tokens."""
    bps = curve_blocks_per_seq(context, runner.block_size)
    assert max(batches) * bps <= runner.kv_cache_spec.num_device_blocks, "engine_kwargs sizes the pool for the curve"
    with torch.inference_mode():
        return [timed(lambda: runner.execute(decode_plan(b, context, bps)), repeats) for b in batches]


def decode_steps(result: TargetResult) -> tuple[float, float]:
    """Mean batch and mean seconds of the steps that only decoded."""
    rows = [(len(s.decode_ids), s.end - s.start) for s in result.steps if not s.prefill_ids]
    return float(np.mean([b for b, _ in rows])), float(np.mean([t for _, t in rows]))


def explain(result: TargetResult, summary: dict, batches: list[int], curve: list[float]) -> dict:
    """Throughput = output tokens per step / seconds per step, and the decode steps against the curve."""
    steps = summary["num_steps"]
    batch, step_s = decode_steps(result)
    return {"name": summary["name"], "num_steps": steps, "tokens_per_step": summary["output_tokens"] / steps,
            "seconds_per_step": summary["duration_s"] / steps, "output_tokens_per_s": summary["output_tokens_per_s"],
            "decode_batch_mean": batch, "decode_step_s": step_s,
            "curve_step_s": float(np.interp(batch, batches, curve))}


def cpu_profile(given: str | None) -> Path:
    """The calibration the simulator reads: given, or cpu-local's (the shipped one where this CPU has none)."""
    if given:
        return Path(given)
    local = default_cpu_profile_path()
    if local.is_file():
        return local
    print(f"no calibration of this CPU at {local} (run `iterserve calibrate`): simulating on the shipped profile",
          flush=True)
    return SHIPPED_CPU_PROFILE


def simulate(trace: Trace, kw: dict, model: str | None, profile: Path, dtype_bytes: int | None):
    """Both targets on the profile, with the same trace (its prompt ids included) and pool."""
    from iterserve.model.loader import default_model_path
    spec, hw = resolve_cpu_profile(str(profile), model or default_model_path())
    spec = replace(spec, dtype_bytes=dtype_bytes) if dtype_bytes else spec
    results = [simulate_trace(trace, EngineConfig(**{**kw, "scheduling": t}), spec, hw, t) for t in TARGETS]
    return [summarize(r, per_request=False) for r in results], spec, hw


def ratios(why: list[dict], sim: list[dict]) -> dict:
    """continuous / static, and its two factors (their quotient is the measured ratio)."""
    c, s = why
    return {"measured": c["output_tokens_per_s"] / s["output_tokens_per_s"],
            "tokens_per_step": c["tokens_per_step"] / s["tokens_per_step"],
            "seconds_per_step": c["seconds_per_step"] / s["seconds_per_step"],
            "simulated": sim[0]["output_tokens_per_s"] / sim[1]["output_tokens_per_s"]}


def run(args: argparse.Namespace) -> dict:
    """Every figure: the targets (one model load), the curve on that model, the simulator's predictions."""
    model = args.model or default_model(args.cache_dir)
    batches = [int(b) for b in args.batches.split(",")]
    trace, kw = seed_trace(args), engine_kwargs(args, model, batches)
    factory, kept = keep_runner(shared_model_engines())
    results = run_targets(trace, list(TARGETS), kw, progress=True, engine_factory=factory)
    runner = kept[0]
    assert all(r is runner for r in kept), "the targets must share one loaded model"
    curve = step_curve(runner, batches, args.context, args.repeats)
    profile = cpu_profile(args.hardware_profile)
    sim, spec, hw = simulate(trace, kw, model, profile, args.sim_dtype_bytes)
    modelled = step_time_table(CostModel(spec, hw), batches, args.context)
    real = build_report({}, results)["targets"]
    why = [explain(r, s, batches, curve) for r, s in zip(results, real)]
    return {"argv": vars(args), "engine": kw, "profile": str(profile), "hardware": hw.to_json(),
            "model": {"path": model, "layers": runner.arch.num_layers, "hidden": runner.arch.hidden_size,
                      "served_as": str(runner.quantization or runner.storage_dtype).removeprefix("torch."),
                      "served_weight_bytes": sum(w.nbytes for w in linear_weights(runner)),
                      "spec_dtype_bytes": spec.dtype_bytes,
                      "modelled_weight_bytes": CostModel(spec, hw).weight_bytes_per_step},
            "real": real, "simulated": sim, "why": why, "ratio": ratios(why, sim),
            "step_curve": [{"batch": b, "context": args.context, "measured_ms": t * 1e3, "modelled_ms": m["step_ms"]}
                           for b, t, m in zip(batches, curve, modelled)]}


def print_report(report: dict) -> None:
    m, real, sim = report["model"], report["real"], report["simulated"]
    print(f"model {m['path'] or 'default'}: {m['layers']} layers, hidden {m['hidden']}; weights a step streams: "
          f"{m['served_weight_bytes'] / 1e9:.2f} GB served ({m['served_as']}), {m['modelled_weight_bytes'] / 1e9:.2f} "
          f"GB modelled ({m['spec_dtype_bytes']} bytes a weight); {report['engine']['num_kv_blocks']} KV blocks; "
          f"simulated on {report['profile']}")
    print(f"\n{'target':<11}" + "".join(f"{name + ' real':>17}{'sim':>9}{'err':>7}" for name, _ in FIGURES))
    for r, s in zip(real, sim):
        line = f"{r['name']:<11}"
        for _, key in FIGURES:
            line += f"{figure(r, key):>17.3f}{figure(s, key):>9.3f}{figure(s, key) / figure(r, key) - 1:>+7.0%}"
        print(line)
    ratio = report["ratio"]
    print(f"continuous / static: {ratio['measured']:.2f}x measured, {ratio['simulated']:.2f}x simulated")
    curve = report["step_curve"]
    print(f"\ndecode step time at context {curve[0]['context']}, ms: measured on this model, modelled")
    print(f"{'B':>4}{'measured':>10}{'modelled':>10}{'err':>7}{'tok/s':>8}")
    for c in curve:
        print(f"{c['batch']:>4}{c['measured_ms']:>10.1f}{c['modelled_ms']:>10.1f}"
              f"{c['modelled_ms'] / c['measured_ms'] - 1:>+7.0%}{c['batch'] / c['measured_ms'] * 1e3:>8.1f}")
    print("\nwhy: out tok/s = output tokens per step / seconds per step (wall over the whole run); then the steps "
          "that only decoded: their mean batch and seconds, and the curve's seconds at that batch")
    print(f"{'target':<11}{'steps':>7}{'tok/step':>10}{'s/step':>9}{'tok/s':>8}{'decode B':>10}{'decode s':>10}"
          f"{'curve s':>9}")
    for w in report["why"]:
        print(f"{w['name']:<11}{w['num_steps']:>7}{w['tokens_per_step']:>10.2f}{w['seconds_per_step']:>9.3f}"
              f"{w['output_tokens_per_s']:>8.1f}{w['decode_batch_mean']:>10.1f}{w['decode_step_s']:>10.3f}"
              f"{w['curve_step_s']:>9.3f}")
    print(f"ratio {ratio['measured']:.2f} = tokens per step {ratio['tokens_per_step']:.2f}x "
          f"/ seconds per step {ratio['seconds_per_step']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"$ python benchmarks/seed_scenario.py {shlex.join(sys.argv[1:] if argv is None else argv)}", flush=True)
    args.context = args.context or args.prompt_len + args.output_len // 2
    try:
        report = run(args)
    except ValueError as exc:  # a setting that cannot work: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_report(report)
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
