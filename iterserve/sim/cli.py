"""`iterserve simulate`: the bench's workload and report, on a modelled GPU with a virtual clock.

    iterserve simulate --model llama-2-7b --hardware a100-80gb --num-requests 1000 --request-rate 8
    iterserve simulate --step-time --model llama-2-7b --hardware a100-80gb --batch-sizes 1,8,32 --context-len 256
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from iterserve.bench.metrics import TargetResult
from iterserve.bench.runner import run_trace
from iterserve.bench.workload import Trace, materialize_prompts
from iterserve.config import EngineConfig
from iterserve.sim.cost_model import CostModel
from iterserve.sim.executor import SimulatedExecutor, VirtualClock, host_blocks_for
from iterserve.sim.hardware import PRESETS, get_hardware
from iterserve.sim.model_spec import PRESET_CONFIGS, get_model_spec

SIM_TARGETS = ("continuous", "static")


def add_model_args(p: argparse.ArgumentParser, with_model: bool = True) -> None:
    """The flags that pick what is modelled; shared by simulate and tune. The bench parser
    already has --model and --num-kv-blocks, so they are added only for parsers without them."""
    g = p.add_argument_group("modelled system")
    if with_model:
        g.add_argument("--model", default=None)
        g.add_argument("--num-kv-blocks", type=int, default=None, help="override the derived KV pool size")
    g.add_argument("--hardware", default="a100-80gb", help=f"preset ({', '.join([*PRESETS, 'cpu-local'])})")
    g.add_argument("--hardware-profile", default=None, help="a JSON profile written by `iterserve calibrate`")
    g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="GPUs the model is split over (weights and K/V split, all-reduce per layer)")
    g.add_argument("--dtype-bytes", type=int, default=None, help="override the model's bytes per parameter")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e = p.add_argument_group("more engine settings (simulate and tune)")
    e.add_argument("--preemption-mode", choices=("recompute", "swap", "auto"), default=None)
    e.add_argument("--swap-space", default=None, help="host KV pool for swap preemption, e.g. 4GiB")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None)


def extra_engine_kwargs(args: argparse.Namespace) -> dict:
    names = ("preemption_mode", "swap_space", "max_model_len", "scheduling_policy")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def resolve(args: argparse.Namespace):
    """(model spec, hardware spec); a cpu-local profile may carry the model dtype it measured."""
    hw = get_hardware(args.hardware, args.hardware_profile)
    local = args.hardware == "cpu-local" or bool(args.hardware_profile)
    dtype_bytes = args.dtype_bytes
    if dtype_bytes is None and local:
        dtype_bytes = _profile_dtype_bytes(args)
    # the default model is the one the real engine runs: SmolLM2 on this CPU, Llama-2-7B on a GPU
    name = args.model or ("smollm2-135m" if local else "llama-2-7b")
    return get_model_spec(name, dtype_bytes), hw


def _profile_dtype_bytes(args: argparse.Namespace) -> int | None:
    from iterserve.sim.hardware import default_cpu_profile_path
    path = args.hardware_profile or default_cpu_profile_path()
    try:
        return json.loads(open(path).read()).get("model", {}).get("dtype_bytes")
    except (OSError, ValueError):
        return None


def make_executor(config: EngineConfig, model, hw, tp: int = 1, gpu_memory_utilization: float = 0.9,
                  clock: VirtualClock | None = None) -> SimulatedExecutor:
    """The executor for one engine config: the KV pool sized like a GPU engine sizes it, unless
    the config pins num_kv_blocks."""
    num_host = host_blocks_for(config.swap_space, model, config.block_size, tp)
    return SimulatedExecutor(model, hw, tp, num_kv_blocks=config.num_kv_blocks, block_size=config.block_size,
                             gpu_memory_utilization=gpu_memory_utilization,
                             max_num_batched_tokens=config.max_num_batched_tokens,
                             max_num_seqs=config.max_num_seqs, num_host_blocks=num_host,
                             max_model_len=config.max_model_len, clock=clock,
                             kv_cache_memory=config.kv_cache_memory or (1 << 30))


def make_engine(config: EngineConfig, model, hw, tp: int = 1, gpu_memory_utilization: float = 0.9):
    from iterserve.engine.engine import Engine
    executor = make_executor(config, model, hw, tp, gpu_memory_utilization)
    return Engine(config, executor=executor, clock=executor.clock)


# ---------------------------------------------------------------- --step-time

def step_time_table(cost: CostModel, batch_sizes: list[int], context_len: int) -> list[dict]:
    rows = []
    for b in batch_sizes:
        d = cost.breakdown([1] * b, [context_len] * b)
        rows.append({"batch_size": b, "context_len": context_len, "step_ms": d.total_s * 1e3,
                     "tokens_per_s": b / d.total_s, "linear_ms": d.linear_s * 1e3,
                     "attention_ms": d.attention_s * 1e3, "overhead_ms": d.overhead_s * 1e3,
                     "allreduce_ms": d.allreduce_s * 1e3})
    return rows


def run_step_time(args: argparse.Namespace) -> int:
    model, hw = resolve(args)
    cost = CostModel(model, hw, args.tp)
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    rows = step_time_table(cost, sizes, args.context_len)
    print(f"decode step time: {model.name} on {args.tp} x {hw.name} "
          f"(weights {model.weight_bytes / 1e9:.2f} GB, K/V {model.kv_bytes_per_token / 1024:.0f} KiB/token)")
    print(f"{'batch':>6} {'context':>8} {'step ms':>9} {'tok/s':>9} {'linear':>8} {'attn':>8} {'overhd':>8}")
    for r in rows:
        print(f"{r['batch_size']:>6} {r['context_len']:>8} {r['step_ms']:>9.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['linear_ms']:>8.2f} {r['attention_ms']:>8.2f} {r['overhead_ms']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model.name, "hardware": hw.to_json(), "tp": args.tp, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


# ---------------------------------------------------------------- the workload through the engine

def engine_factory(model, hw, tp: int = 1, gpu_memory_utilization: float = 0.9):
    """What the bench runner calls to build each target's engine: same workload path, same report."""
    def factory(scheduling: str, engine_kwargs: dict):
        return make_engine(EngineConfig(**{**engine_kwargs, "scheduling": scheduling}), model, hw, tp,
                           gpu_memory_utilization)
    return factory


def simulate_trace(trace: Trace, config: EngineConfig, model, hw, tp: int = 1,
                   gpu_memory_utilization: float = 0.9, name: str | None = None) -> TargetResult:
    """One target through the bench's own trace driver on a fresh simulated engine."""
    if any(r.prompt_token_ids is None for r in trace.requests):
        materialize_prompts(trace, None)
    engine = make_engine(config, model, hw, tp, gpu_memory_utilization)
    result = run_trace(engine, trace, name or config.scheduling)
    result.extra = sim_extra(engine, config, model, hw, tp)
    return result


def sim_extra(engine, config: EngineConfig, model, hw, tp: int) -> dict:
    ex = engine.executor
    return {"simulated": True, "model": model.name, "hardware": hw.name, "tp": tp,
            "num_kv_blocks": ex.num_kv_blocks, "block_size": config.block_size,
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "busy_s": ex.busy_time}


# ---------------------------------------------------------------- the bench, simulated

def run_simulation(args: argparse.Namespace) -> int:
    """The bench's own workload, runner, report, JSON and plots, with simulated engines."""
    from iterserve.bench import cli as bench_cli
    from iterserve.bench.metrics import Slo
    from iterserve.bench.runner import build_report, format_table, run_targets
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in targets if t not in SIM_TARGETS]
    if bad:
        raise ValueError(f"simulate runs the targets {', '.join(SIM_TARGETS)}; not {', '.join(bad)}")
    if args.sweep:
        raise ValueError("--sweep is a bench option; for a search over engine settings use `iterserve tune`")
    model, hw = resolve(args)
    trace = bench_cli.trace_from_args(args)
    kw = {**bench_cli.engine_kwargs_from_args(args), **extra_engine_kwargs(args)}
    kw["model"] = model.name
    built: list = []

    def factory(scheduling: str, engine_kwargs: dict):
        built.append(make_engine(EngineConfig(**{**engine_kwargs, "scheduling": scheduling}), model, hw, args.tp,
                                 args.gpu_memory_utilization))
        return built[-1]

    print(f"$ iterserve simulate {shlex.join(args.argv)}")
    results = run_targets(trace, targets, kw, progress=False, engine_factory=factory)
    for result, engine in zip(results, built):
        result.extra.update(sim_extra(engine, engine.config, model, hw, args.tp))
    if args.save_trace:
        trace.save(args.save_trace)
    config = bench_cli._config(args, trace, kw)
    config["simulator"] = {"model": model.name, "hardware": hw.to_json(), "tp": args.tp,
                           "num_kv_blocks": built[0].executor.num_kv_blocks if built else None}
    report = build_report(config, results, Slo(args.slo_ttft, args.slo_tpot, args.slo_e2e))
    print(f"simulated: {model.name} on {args.tp} x {hw.name}, {config['simulator']['num_kv_blocks']} KV blocks; "
          f"modelled seconds, not wall time")
    print(bench_cli._trace_line(trace))
    print(format_table(report))
    bench_cli._write(report, args.json)
    if args.plot:
        from iterserve.bench.plots import plot_all
        for path in plot_all(results, args.plot):
            print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------- main
# ---------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    """The bench's parser (workload, engine, SLO and output flags) plus the modelled system."""
    from iterserve.bench.cli import build_parser as bench_parser
    p = bench_parser()
    p.prog, p.description = "iterserve simulate", __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.set_defaults(no_progress=True)
    for action in p._actions:
        if action.dest == "model":
            action.help = (f"preset ({', '.join(PRESET_CONFIGS)}), HF dir / config.json or .gguf "
                           "(default: llama-2-7b; smollm2-135m on cpu-local)")
    add_model_args(p, with_model=False)
    p.add_argument("--step-time", action="store_true", help="print the modelled decode step time per batch size")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--context-len", type=int, default=256)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        if args.step_time:
            return run_step_time(args)
        return run_simulation(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"iterserve simulate: error: {exc}", file=sys.stderr)
        return 2
