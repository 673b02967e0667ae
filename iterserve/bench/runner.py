"""Drive one trace through targets: this engine (continuous, static), transformers' generate in
padded static batches (hf-static, hf_static.py), or any OpenAI-compatible server (http:URL,
http_target.py).

`run_trace` is the one driver for engines; the simulator passes an engine whose clock is virtual
and the driver advances that clock instead of sleeping, so metrics, report and plots are shared.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections import deque
from typing import Callable

from iterserve.bench.hf_static import run_hf_static
from iterserve.bench.http_target import parse_http_target, run_http
from iterserve.bench.metrics import RequestMetrics, Slo, TargetResult, request_metrics, summarize
from iterserve.bench.progress import _progress
from iterserve.bench.workload import Trace, TraceRequest, materialize_prompts
from iterserve.sampling_params import SamplingParams

ENGINE_TARGETS = ("continuous", "static")


def trace_params(r: TraceRequest) -> SamplingParams:
    # Greedy and ignore_eos: every target generates exactly output_len tokens, so all do equal work.
    return SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)


def _advance_fn(clock) -> Callable[[float], None] | None:
    """The virtual clock's advance_to, whether the engine holds the clock object or its bound now()."""
    return getattr(clock, "advance_to", None) or getattr(getattr(clock, "__self__", None), "advance_to", None)


# ---------------------------------------------------------------- this engine

def run_trace(engine, trace: Trace, name: str = "engine", progress: bool = False) -> TargetResult:
    """Feed the trace's requests to `engine` at their arrival times (or keep `trace.concurrency`
    in flight for a closed loop) and step it until all finish. When the engine is idle and the
    next arrival lies ahead, sleep on a real clock or advance a virtual one."""
    if any(r.prompt_token_ids is None for r in trace.requests):
        materialize_prompts(trace, engine.tokenizer)
    clock, advance = engine.clock, _advance_fn(engine.clock)
    pending = deque(sorted(trace.requests, key=lambda r: r.arrival_time))  # stable: ties keep trace order
    by_id = {r.request_id: r for r in trace.requests}
    first_preemptions = engine.stats.num_preemptions
    done: dict[str, RequestMetrics] = {}
    in_flight = 0
    bar = _progress(len(trace), name, progress)
    t0 = clock()
    while pending or engine.has_unfinished():
        now = clock()
        while pending and (in_flight < trace.concurrency if trace.concurrency
                           else t0 + pending[0].arrival_time <= now):
            r = pending.popleft()
            # Open loop: the request arrived at its trace time even if a step was running then.
            arrival = now if trace.concurrency else t0 + r.arrival_time
            engine.add_request(list(r.prompt_token_ids), trace_params(r), request_id=r.request_id, arrival_time=arrival)
            in_flight += 1
        if not engine.has_unfinished():
            if not pending:
                break
            wake = t0 + pending[0].arrival_time
            if advance is not None:
                advance(wake)
            else:
                time.sleep(max(0.0, wake - clock()))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            r = by_id[out.request_id]
            m = request_metrics(r.request_id, r.prompt_len, len(out.token_ids), out.times, t0)
            if out.finish_reason in ("error", "abort"):
                m.e2e = None  # counted as failed, not as a fast completion
            done[r.request_id] = m
            in_flight -= 1
            bar.update(1)
    bar.close()
    end = max((m.finished for m in done.values() if m.finished is not None), default=0.0)
    # step_records is a bounded deque: select this run's steps by time, not by index
    steps = [dataclasses.replace(s, start=s.start - t0, end=s.end - t0) for s in engine.step_records if s.start >= t0]
    return TargetResult(name, [done[r.request_id] for r in trace.requests if r.request_id in done], end, steps,
                        engine.stats.num_preemptions - first_preemptions)


def warmup(engine, trace: Trace) -> None:
    """One short request so lazy initialisation is not billed to the first measured request. Its
    prompt is shorter than a block, so it leaves nothing in the prefix cache."""
    prompt = (trace.requests[0].prompt_token_ids or [1])[: max(1, engine_block_size(engine) - 1)]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                             request_id="bench-warmup")
    while engine.has_unfinished():
        engine.step()
    assert rid == "bench-warmup"


def resident_bytes() -> int | None:
    """This process's resident memory (Linux), or None where /proc does not say."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc; 0 where it cannot be read, or
    the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def engine_block_size(engine) -> int:
    return engine.config.cache_config.block_size


def shared_model_engines() -> Callable[[str, dict], object]:
    """An engine factory that loads the model once and hands the same ModelRunner to every
    engine it builds: one load instead of one per mode, and the same weights and the same KV
    pool for continuous and static by construction. Safe because the runner holds no
    per-request state that outlives a request (greedy sampling keeps no generators)."""
    from iterserve.config import EngineConfig
    from iterserve.engine import Engine
    from iterserve.engine.engine import make_executor
    from iterserve.executor.model_runner import ModelRunner
    runners: dict[str, object] = {}

    def make(scheduling: str, engine_kwargs: dict) -> Engine:
        config = EngineConfig(**{**engine_kwargs, "scheduling": scheduling})
        key = ModelRunner.config_key(config)  # a sweep over seats keeps the model
        if key not in runners:
            for old in runners.values():
                old.shutdown()  # tensor-parallel ranks are processes: stop them, not just drop them
            runners.clear()  # free the previous model before loading the next
            gc.collect()
            runners[key] = make_executor(config)  # a ModelRunner, or the ranks of --tensor-parallel-size
        return Engine(config, executor=runners[key])
    make.loads_model = True  # run_targets: prompts need this model's tokenizer
    return make


def run_engine_target(trace: Trace, scheduling: str, engine_kwargs: dict, progress: bool = False,
                      engine_factory: Callable[[str, dict], object] | None = None) -> TargetResult:
    engine = (engine_factory or shared_model_engines())(scheduling, engine_kwargs)
    if _advance_fn(engine.clock) is None:
        warmup(engine, trace)
    rss_start = resident_bytes()
    result = run_trace(engine, trace, scheduling, progress)
    result.extra = {"max_num_seqs": engine.config.scheduler_config.max_num_seqs,
                    "num_kv_blocks": engine.stats.num_kv_blocks,
                    "dtype": engine.executor.kv_cache_spec.dtype,
                    "rss_start_bytes": rss_start, "rss_end_bytes": resident_bytes()}
    del engine
    gc.collect()
    return result


# ---------------------------------------------------------------- several targets, one report

def run_targets(trace: Trace, targets: list[str], engine_kwargs: dict | None = None, progress: bool = False,
                engine_factory: Callable[[str, dict], object] | None = None,
                http_model: str | None = None, api_key: str | None = None) -> list[TargetResult]:
    """Run the same trace through each target in turn. Prompts are materialized once, with the
    model's tokenizer, so every target sees identical token ids."""
    engine_kwargs = dict(engine_kwargs or {})
    check_targets(targets)
    if any(r.prompt_token_ids is None for r in trace.requests):
        tokenizer = None
        if engine_factory is None or getattr(engine_factory, "loads_model", False):
            from iterserve.model.loader import default_model_path, load_tokenizer
            tokenizer = load_tokenizer(engine_kwargs.get("model") or default_model_path())
        materialize_prompts(trace, tokenizer)
    engine_factory = engine_factory or shared_model_engines()
    results = []
    for target in targets:
        base, overrides = parse_engine_target(target)
        if base in ENGINE_TARGETS:
            result = run_engine_target(trace, base, {**engine_kwargs, **overrides}, progress, engine_factory)
            result.name = target
            results.append(result)
        elif target == "hf-static":
            results.append(run_hf_static(trace, engine_kwargs.get("max_num_seqs", 64), engine_kwargs.get("model"),
                                         engine_kwargs.get("dtype", "auto"), progress))
        elif target.startswith(("http:", "https:")):
            results.append(run_http(trace, parse_http_target(target), http_model, progress, api_key=api_key))
        gc.collect()
    return results


def check_targets(targets: list[str]) -> None:
    """Every target understood before anything runs (a typo must not cost a model load)."""
    if not targets:
        raise ValueError("no targets given")
    for target in targets:
        base, _ = parse_engine_target(target)
        if base not in (*ENGINE_TARGETS, "hf-static") and not target.startswith(("http:", "https:")):
            raise ValueError(f"unknown target {target!r}: use continuous, static, hf-static or http:URL")


def parse_engine_target(target: str) -> tuple[str, dict]:
    """'continuous+no-prefix-caching+num-kv-blocks=64' -> ('continuous', {...EngineConfig fields})."""
    if target.startswith(("http:", "https:")) or "+" not in target:
        return target, {}
    from iterserve.config import FIELD_NAMES
    base, *flags = target.split("+")
    overrides = {}
    for flag in flags:
        name, has_value, value = flag.partition("=")
        key = name.replace("-", "_")
        if not has_value and key.startswith("no_"):
            key, parsed = ("enable_prefix_caching" if key == "no_prefix_caching" else key[3:]), False
        elif not has_value:
            parsed = True
        else:
            parsed = _parse_value(value)
        if key not in FIELD_NAMES:
            raise ValueError(f"unknown engine flag {name!r} in target {target!r}")
        overrides[key] = parsed
    return base, overrides


def _parse_value(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def build_report(config: dict, results: list[TargetResult], slo: Slo | None = None) -> dict:
    targets = [summarize(r, slo) for r in results]
    base = targets[0]["output_tokens_per_s"] if targets else 0
    for t in targets:
        t["ratio_to_first"] = t["output_tokens_per_s"] / base if base else None
        if not t["extra"].get("kv_usage_known", True):
            t["mean_kv_usage"] = t["max_kv_usage"] = None
            t["series"]["kv_usage"] = []
    return {"config": config, "targets": targets}


def run_bench(trace: Trace, targets: list[str], engine_kwargs: dict | None = None, slo: Slo | None = None,
              progress: bool = False, engine_factory: Callable[[str, dict], object] | None = None) -> dict:
    """Python API: one trace through several targets -> the report dict that --json writes."""
    results = run_targets(trace, targets, engine_kwargs, progress, engine_factory)
    config = {"targets": targets, "engine": dict(engine_kwargs or {}), "trace": trace.meta,
              "concurrency": trace.concurrency, "num_requests": len(trace)}
    return build_report(config, results, slo)


def format_table(report: dict) -> str:
    """The comparison table: one row per target, ratios to the first."""
    w = max(14, *(len(t["name"]) + 1 for t in report["targets"]))
    head = (f"{'target':<{w}}{'req/s':>8}{'out tok/s':>11}{'ratio':>7}{'TTFT mean':>11}{'TTFT p99':>10}"
            f"{'TPOT mean':>11}{'ITL p99':>9}{'e2e p99':>9}{'goodput':>9}{'batch':>7}{'preempt':>9}")
    rows = [head, "-" * len(head)]
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    for t in report["targets"]:
        rows.append(f"{t['name']:<{w}}{f(t['requests_per_s'], 2):>8}{f(t['output_tokens_per_s'], 1):>11}"
                    f"{f(t['ratio_to_first'], 2):>7}{f(t['ttft_s']['mean']):>11}{f(t['ttft_s']['p99']):>10}"
                    f"{f(t['tpot_s']['mean'], 4):>11}{f(t['itl_s']['p99'], 4):>9}{f(t['e2e_s']['p99'], 2):>9}"
                    f"{f(t['goodput_rps'], 2):>9}{f(t['mean_batch_size'], 1):>7}{t['preemptions']:>9}")
    return "\n".join(rows)
