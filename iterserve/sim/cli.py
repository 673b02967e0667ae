"""`iterserve simulate`: the bench's workload and report, on a modelled GPU with a virtual clock.

    iterserve simulate --model llama-2-7b --hardware a100-80gb --num-requests 1000 --request-rate 8
    iterserve simulate --pd search --pd-devices 4 --slo-ttft 0.2 --slo-tpot 0.1 --request-rate 8   # docs/disaggregation.md
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
from iterserve.config import CPU_KV_CACHE_MEMORY, EngineConfig
from iterserve.sim.cost_model import CostModel
from iterserve.entrypoints.args import fail
from iterserve.sim.executor import SimulatedExecutor, VirtualClock
from iterserve.sim.hardware import PRESETS, get_hardware
from iterserve.sim.model_spec import MODEL_PRESETS, get_model_spec, with_kv_cache_dtype

SIM_TARGETS = ("continuous", "static")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """What is modelled besides the engine's own settings; shared by simulate and tune."""
    g = p.add_argument_group("modelled system")
    g.add_argument("--hardware", default="a100-80gb", help=f"preset ({', '.join([*PRESETS, 'cpu-local'])})")
    g.add_argument("--hardware-profile", default=None, help="a JSON profile written by `iterserve calibrate`")
    g.add_argument("--dtype-bytes", type=int, default=None, help="override the model's bytes per parameter")


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


def resolve_cpu_profile(profile: str | None = None, model: str | None = None):
    """(model spec, hardware spec) of a cpu-local profile (default: calibrate's), for code that is not
    the command line: the benchmarks that check the simulator against real runs, the dashboard."""
    return resolve(argparse.Namespace(hardware="cpu-local", hardware_profile=profile, dtype_bytes=None, model=model))


def _profile_dtype_bytes(args: argparse.Namespace) -> int | None:
    from iterserve.sim.hardware import default_cpu_profile_path
    path = args.hardware_profile or default_cpu_profile_path()
    try:
        return json.loads(open(path).read()).get("model", {}).get("dtype_bytes")
    except (OSError, ValueError):
        return None


def make_executor(config: EngineConfig, model, hw, clock: VirtualClock | None = None) -> SimulatedExecutor:
    """The executor for one engine config: the KV pool sized like a GPU engine sizes it, unless
    the config pins num_kv_blocks."""
    if config.speculative_config.speculative_method is not None:
        raise ValueError("--speculative-method: the simulator does not model draft acceptance "
                         "(its tokens come from the trace); measure speculation on the real engine")
    c, sc = config.cache_config, config.scheduler_config
    model = with_kv_cache_dtype(model, c.kv_cache_dtype)
    return SimulatedExecutor(model, hw, config.parallel_config.tensor_parallel_size, num_kv_blocks=c.num_kv_blocks,
                             block_size=c.block_size, gpu_memory_utilization=c.gpu_memory_utilization,
                             max_num_batched_tokens=sc.max_num_batched_tokens, max_num_seqs=sc.max_num_seqs,
                             swap_space=config.swap_space_bytes, max_model_len=config.model_config.max_model_len,
                             clock=clock, kv_cache_memory=c.kv_cache_memory or CPU_KV_CACHE_MEMORY)


def make_engine(config: EngineConfig, model, hw):
    from iterserve.engine.engine import Engine
    executor = make_executor(config, model, hw)
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
    tp = args.tensor_parallel_size
    cost = CostModel(model, hw, tp)
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    rows = step_time_table(cost, sizes, args.context_len)
    print(f"decode step time: {model.name} on {tp} x {hw.name} "
          f"(weights {model.weight_bytes / 1e9:.2f} GB, K/V {model.kv_bytes_per_token / 1024:.0f} KiB/token)")
    print(f"{'batch':>6} {'context':>8} {'step ms':>9} {'tok/s':>9} {'linear':>8} {'attn':>8} {'overhd':>8}")
    for r in rows:
        print(f"{r['batch_size']:>6} {r['context_len']:>8} {r['step_ms']:>9.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['linear_ms']:>8.2f} {r['attention_ms']:>8.2f} {r['overhead_ms']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model.name, "hardware": hw.to_json(), "tp": tp, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


# ---------------------------------------------------------------- the workload through the engine

def engine_factory(model, hw, built: list | None = None):
    """What the bench runner calls to build each target's engine: same workload path, same report."""
    def factory(scheduling: str, engine_kwargs: dict):
        engine = make_engine(EngineConfig(**{**engine_kwargs, "scheduling": scheduling}), model, hw)
        if built is not None:
            built.append(engine)
        return engine
    return factory


def simulate_trace(trace: Trace, config: EngineConfig, model, hw, name: str | None = None) -> TargetResult:
    """One target through the bench's own trace driver on a fresh simulated engine."""
    if any(r.prompt_token_ids is None for r in trace.requests):
        materialize_prompts(trace, None)
    engine = make_engine(config, model, hw)
    result = run_trace(engine, trace, name or config.scheduler_config.scheduling)
    result.extra = sim_extra(engine, model, hw)
    return result


def sim_extra(engine, model, hw) -> dict:
    c = engine.config
    return {"simulated": True, "model": model.name, "hardware": hw.name,
            "tp": c.parallel_config.tensor_parallel_size, "num_kv_blocks": engine.executor.num_kv_blocks,
            "block_size": c.cache_config.block_size, "max_num_seqs": c.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": c.scheduler_config.max_num_batched_tokens, "busy_s": engine.executor.busy_time}


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
    kw = {**bench_cli.engine_kwargs_from_args(args), "model": model.name}
    built: list = []
    factory = engine_factory(model, hw, built)
    tp = args.tensor_parallel_size

    print(f"$ iterserve simulate {shlex.join(args.argv)}")
    if args.pd:
        from iterserve.bench.metrics import Slo
        from iterserve.sim.disagg import run_pd
        def trace_at(rate: float) -> Trace:
            args.request_rate = rate
            return bench_cli.trace_from_args(args)
        rows = run_pd(args, lambda: make_engine(EngineConfig(**kw), model, hw), trace_at, hw.interconnect_bandwidth,
                      Slo(args.slo_ttft, args.slo_tpot, args.slo_e2e))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"argv": args.argv, "model": model.name, "hardware": hw.to_json(), "rows": rows}, f, indent=2)
        return 0
    replicas = args.data_parallel_size
    if replicas != 1 or args.router:
        from iterserve.sim.cluster import run_cluster_targets
        results = run_cluster_targets(trace, targets, kw, factory, replicas, args.router or "prefix-affinity",
                                      args.seed, args.sim_workers, args.load_report_interval)
        built = built[::len(built) // len(targets)]  # one engine per target describes them all
    else:
        results = run_targets(trace, targets, kw, progress=False, engine_factory=factory)
    for result, engine in zip(results, built):
        result.extra.update(sim_extra(engine, model, hw))
    if args.save_trace:
        trace.save(args.save_trace)
    config = bench_cli.report_config(args, trace, kw)
    config["simulator"] = {"model": model.name, "hardware": hw.to_json(), "tp": tp,
                           "num_kv_blocks": built[0].executor.num_kv_blocks if built else None}
    report = build_report(config, results, Slo(args.slo_ttft, args.slo_tpot, args.slo_e2e))
    print(f"simulated: {model.name} on {tp} x {hw.name}, {config['simulator']['num_kv_blocks']} KV blocks; "
          f"modelled seconds, not wall time")
    print(bench_cli.trace_line(trace))
    print(format_table(report))
    for r in results:
        if "replicas" in r.extra:
            per = r.extra["requests_per_replica"]
            print(f"{r.name}: prefix cache hit rate {r.extra['prefix_hit_rate']:.1%}, "
                  f"requests per replica {min(per)}..{max(per)}; simulated in {r.extra['wall_s']:.1f} s")
    bench_cli.write_report(report, args.json)
    if args.plot:
        for path in bench_cli.plots().plot_all(results, args.plot):
            print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    """The bench's parser (workload, engine, SLO and output flags) plus the modelled system."""
    from iterserve.bench.cli import build_parser as bench_parser
    p = bench_parser()
    p.prog, p.description = "iterserve simulate", __doc__
    p.set_defaults(no_progress=True)
    for action in p._actions:
        if action.dest == "model":
            action.help = (f"preset ({', '.join(MODEL_PRESETS)}), HF dir / config.json or .gguf "
                           "(default: llama-2-7b; smollm2-135m on cpu-local)")
    add_model_args(p)
    from iterserve.router.policy import POLICIES
    c = p.add_argument_group("replicas (data parallel)")
    c.add_argument("--replicas", dest="data_parallel_size", type=int, default=argparse.SUPPRESS,
                   help="the same as --data-parallel-size: engines behind one router, each on its own GPU(s)")
    c.add_argument("--router", choices=POLICIES, default=None, help="routing policy (default: prefix-affinity)")
    c.add_argument("--sim-workers", type=int, default=1,
                   help="processes the replicas are split over (the same figures, less wall time on many cores)")
    c.add_argument("--load-report-interval", type=float, default=0.0, metavar="SECONDS",
                   help="the router reads the replicas' loads this often (Ray Serve polls every 0.5 s); "
                        "0: at every arrival. Longer lets --sim-workers run further apart")
    d = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    d.add_argument("--pd", default=None, help="xPyD (e.g. 1P1D, 2P1D): x prefill and y decode engines against "
                   "colocated x+y replicas; 'search': every split of --pd-devices")
    d.add_argument("--pd-devices", type=int, default=4, help="with --pd search: devices to split")
    d.add_argument("--pd-attainment", type=float, default=0.9,
                   help="goodput is the highest rate per device at which this share meets both SLOs (DistServe: 0.9)")
    g = p.add_argument_group("step time")
    g.add_argument("--step-time", action="store_true", help="print the modelled decode step time per batch size")
    g.add_argument("--batch-sizes", default="1,8,32", help="with --step-time")
    g.add_argument("--context-len", type=int, default=256, help="with --step-time")
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
        fail(str(exc))
