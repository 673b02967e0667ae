"""Prefix-affinity vs round-robin routing over real engine replicas, then the simulator on the same trace.

Tenants each with their own long system prompt send interleaved requests to N replicas on a local
Ray Serve (`iterserve serve --data-parallel-size N` as an app). For each routing policy: a fresh app
(cold caches), the trace through the OpenAI endpoint (the bench's http driver), and the prefix-cache
hit rate from the replicas' reports. Then the simulator's multi-replica mode runs the same trace
behind the same policy code, and the table gives its error against the real run.

    python benchmarks/multi_tenant.py                       # 8 tenants x 1,024-token prompts, 256 requests
    python benchmarks/multi_tenant.py --num-requests 16 --system-prompt-len 64 --output-len 4   # a smoke run

The simulator prices steps with a cpu-local profile (`iterserve calibrate`: calibrate it with the threads
each replica gets, --num-threads, two calibrations side by side as the replicas run). Row `sim` also puts
the replicas on one host of this machine's cores beside the other work the real run measured there (the
load generator and Ray's processes, and the replica processes' own threads besides the engine's, in CPU
seconds per second): that work runs first, and the busy replicas share the cores it leaves
(sim/cluster.py SharedHost). `sim-engine` gives each replica its own core. --check-steps
prices every real step of every replica with that profile (sim/step_check.py), beside the simulator's
own steps: whether a replica's steps ran slower than priced, or its time went between steps.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from iterserve.bench.metrics import summarize
from iterserve.bench.runner import process_cpu_seconds, run_http
from iterserve.bench.workload import multi_tenant_trace
from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.model.loader import default_model_path, load_tokenizer
from iterserve.outputs import StepRecord
from iterserve.router.policy import POLICIES, make_router
from iterserve.sim.cli import make_engine, resolve_cpu_profile
from iterserve.sim.cluster import SharedHost, run_cluster

MODEL_NAME = "multi-tenant"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="prefix-affinity,round-robin")
    p.add_argument("--num-tenants", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--user-len", type=int, default=64, help="each request's own tokens after the system prompt")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals (default: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", default="256MiB", help="per replica; small enough that a replica "
                   "cannot keep every tenant's prompt is where routing shows")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    p.add_argument("--stats-period", type=float, default=0.5, help="seconds between the replicas' load reports "
                   "(Ray Serve's routing-stats poll); the simulator's router reads loads as often")
    p.add_argument("--hardware-profile", default=None, help="cpu-local profile for the simulator "
                   "(default: iterserve calibrate's)")
    p.add_argument("--check-steps", action="store_true", help="price every real step of each replica with the "
                   "profile, beside the simulator's steps")
    p.add_argument("--json", default=None, help="write every figure here")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"model": args.model, "kv_cache_memory": args.kv_cache_memory, "max_num_seqs": args.max_num_seqs,
            "num_threads": args.num_threads}


def replica_reports(url: str) -> dict[str, dict]:
    """Each replica's latest report (EngineReplica.record_routing_stats), by replica id."""
    return httpx.get(f"{url}/health", timeout=30).json()["replicas"]


def prefix_totals(reports: dict[str, dict]) -> tuple[int, int]:
    """(prompt tokens looked up, of those found cached), summed over the replicas' reports."""
    return (sum(s["num_prefix_queries"] for s in reports.values()),
            sum(s["num_prefix_hits"] for s in reports.values()))


def ttft_sums(url: str, reports: dict[str, dict]) -> dict[str, tuple[float, int]]:
    """(sum of TTFTs, requests) so far, as the ingress measured them (its /metrics histogram) and as the
    replicas did (from a call's start there to its first token leaving): what lies between the client's
    TTFT and those two is the hops'."""
    from prometheus_client.parser import text_string_to_metric_families
    ingress = [0.0, 0]
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "iterserve:time_to_first_token_seconds_sum":
                ingress[0] += s.value
            elif s.name == "iterserve:time_to_first_token_seconds_count":
                ingress[1] += int(s.value)
    return {"ingress": (ingress[0], ingress[1]),
            "replica": (sum(s["ttft_sum_s"] for s in reports.values()),
                        sum(s["num_first_tokens"] for s in reports.values()))}


def serving_cpu_seconds() -> tuple[float, dict[int, float]]:
    """CPU seconds used so far by everything serving the trace except the engines: this process (the
    load generator) and Ray's own (proxy, ingress, controller, GCS, raylet, agents); and each engine
    replica's process, by pid. On a host whose cores the replicas also use, each second of the first is
    taken from a replica."""
    total, replicas = sum(os.times()[:2]), {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if pid == os.getpid() or "ray" not in cmd:
            continue
        if "EngineReplica" in cmd:
            replicas[pid] = process_cpu_seconds(pid)
        else:
            total += process_cpu_seconds(pid)
    return total, replicas


def steal_ticks() -> tuple[int, int]:
    """(steal, all) CPU ticks of this host so far (/proc/stat): time a hypervisor ran something else while
    this VM had work, which no profile priced; (0, 0) where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return ticks[7], sum(ticks)


def warm_up(url: str, replicas: int) -> None:
    """Short requests, all at once so the router spreads them over every replica: lazy start-up
    work is not billed to the trace. Each prompt is shorter than a block, so nothing is cached."""
    def one(k: int) -> None:
        httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": [100 + k] * 4, "max_tokens": 4,
                                                  "ignore_eos": True}, timeout=300).raise_for_status()
    with ThreadPoolExecutor(2 * replicas) as pool:
        list(pool.map(one, range(2 * replicas)))


def read_step_logs(step_log_dir: str, since: float) -> tuple[dict[str, list[StepRecord]], dict[str, int]]:
    """Each replica's step records from `since` on (its monotonic clock is this host's), and the prompt
    length of every request any replica took (EngineReplica's step log)."""
    records, prompt_lens = {}, {}
    for name in sorted(os.listdir(step_log_dir)):
        steps = records.setdefault(name.removesuffix(".jsonl"), [])
        with open(os.path.join(step_log_dir, name)) as f:
            for line in map(json.loads, f):
                if "step" in line and line["step"]["start"] >= since:
                    steps.append(StepRecord(**line["step"]))
                elif "prompt_len" in line:
                    prompt_lens[line["request_id"]] = line["prompt_len"]
    return records, prompt_lens


def real_run(args: argparse.Namespace, trace, policy: str, port: int) -> dict:
    """A fresh app per policy, so every policy starts from cold caches. With --check-steps, the replicas'
    step records are under "steps" (by replica) and their requests' prompt lengths under "prompt_lens"."""
    from ray import serve

    from iterserve.server.ray_app import build_ray_app, wait_until_ready
    config = EngineConfig(**engine_kwargs(args))
    step_log_dir = tempfile.mkdtemp(prefix="iterserve-steps-") if args.check_steps else None
    app = build_ray_app(functools.partial(Engine, config), args.replicas, MODEL_NAME, policy=policy,
                        block_size=config.cache_config.block_size, num_cpus_per_replica=args.num_cpus_per_replica,
                        stats_period_s=args.stats_period, step_log_dir=step_log_dir)
    serve.run(app, blocking=False)
    try:
        wait_until_ready(600)
        url = f"http://127.0.0.1:{port}"
        warm_up(url, args.replicas)
        time.sleep(3 * args.stats_period)  # the replicas' reports arrive on Ray's stats poll
        health0 = replica_reports(url)
        queries0, hits0 = prefix_totals(health0)
        ttft0 = ttft_sums(url, health0)
        (frontend0, replica_cpu0), steal0, start = serving_cpu_seconds(), steal_ticks(), time.monotonic()
        result = run_http(trace, url, MODEL_NAME)
        frontend1, replica_cpu1 = serving_cpu_seconds()
        wall_s = time.monotonic() - start
        steal = [b - a for a, b in zip(steal0, steal_ticks())]
        expected = queries0 + sum(r.prompt_len for r in trace.requests)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and prefix_totals(replica_reports(url))[0] < expected:
            time.sleep(0.2)
        health1 = replica_reports(url)
        queries, hits = prefix_totals(health1)
        ttft1 = ttft_sums(url, health1)
        hops = {f"ttft_mean_{where}_s": (ttft1[where][0] - ttft0[where][0]) / max(1, ttft1[where][1] - ttft0[where][1])
                for where in ttft1}
        rate = (hits - hits0) / (queries - queries0) if queries > queries0 else 0.0
        tokens = sum(r.output_len for r in trace.requests)
        # per replica, CPU seconds per wall second: its whole process, and its engine thread (the loop
        # above waited for the replicas' last reports)
        replica_cpu = {rid: (replica_cpu1.get(h["pid"], 0.0) - replica_cpu0.get(h["pid"], 0.0)) / wall_s
                       for rid, h in health1.items()}
        engine_cpu = {rid: (h["engine_cpu_s"] - health0.get(rid, {}).get("engine_cpu_s", 0.0)) / wall_s
                      for rid, h in health1.items()}
        frontend_cores = (frontend1 - frontend0) / wall_s
        out = {**_figures(summarize(result, per_request=False)), "prefix_hit_rate": rate, **hops,
               "frontend_cpu_s_per_token": (frontend1 - frontend0) / tokens, "wall_s": wall_s,
               "steal_share": steal[0] / steal[1] if steal[1] else 0.0, "replica_cpu": replica_cpu,
               "engine_cpu": engine_cpu,
               "background_cores": frontend_cores + sum(replica_cpu[r] - engine_cpu[r] for r in replica_cpu)}
        if step_log_dir is not None:
            out["steps"], out["prompt_lens"] = read_step_logs(step_log_dir, start)
        return out
    finally:
        serve.delete("default")
        if step_log_dir is not None:
            shutil.rmtree(step_log_dir, ignore_errors=True)


def simulated_run(args: argparse.Namespace, trace, policy: str, background_cores: float | None = None) -> dict:
    """The simulator's replicas, each step priced by the calibrated profile; with background_cores, all on
    one host of this machine's cores beside that much other work (SharedHost). Its router reads the
    replicas' loads every --stats-period seconds, as the real one reads their polled reports."""
    model, hw = resolve_cpu_profile(args.hardware_profile, args.model)
    config = EngineConfig(**{**engine_kwargs(args), "model": None})
    engines = [make_engine(config, model, hw) for _ in range(args.replicas)]
    host = None if background_cores is None else SharedHost(len(os.sched_getaffinity(0)), args.num_threads,
                                                            background_cores)
    result, stats = run_cluster(engines, trace, make_router(policy, args.seed), f"sim {policy}",
                                report_interval=args.stats_period, host=host)
    return {**_figures(summarize(result, per_request=False)), "prefix_hit_rate": stats.prefix_hit_rate,
            "steps": {f"replica-{i}": list(e.step_records) for i, e in enumerate(engines)}}


def print_checks(args: argparse.Namespace, trace, rows: dict) -> None:
    """--check-steps: each real replica's steps priced by the profile, then the simulated replicas'
    (sim-engine) priced by the same profile: their in-step time is the price, their gaps are zero."""
    from iterserve.sim.cost_model import CostModel
    from iterserve.sim.step_check import check_steps, format_check, shapes_from_records
    cost = CostModel(*resolve_cpu_profile(args.hardware_profile, args.model))
    sim_prompt_lens = {r.request_id: r.prompt_len for r in trace.requests}
    for policy, r in rows.items():
        real = r["real"]
        print(f"\n== {policy}: {real['wall_s']:.1f} s, {real['steal_share']:.1%} of the host's CPU time stolen by "
              "the hypervisor; per wall second, each replica's steps' wall time / its process's CPU / its engine "
              "thread's: " + ", ".join(
                  f"{rid} {sum(s.end - s.start for s in real['steps'].get(rid, [])) / real['wall_s']:.2f} / "
                  f"{real['replica_cpu'][rid]:.2f} / {real['engine_cpu'][rid]:.2f}" for rid in real["replica_cpu"]))
        for kind, prompt_lens in (("real", real["prompt_lens"]), ("sim-engine", sim_prompt_lens)):
            for replica, records in r[kind]["steps"].items():
                shapes = shapes_from_records(records, prompt_lens)
                print(format_check(f"{policy} {kind} {replica}", check_steps(shapes, cost)))


def _figures(s: dict) -> dict:
    return {"output_tokens_per_s": s["output_tokens_per_s"], "ttft_mean_s": s["ttft_s"]["mean"],
            "completed": s["completed"], "failed": s["failed"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {POLICIES}")
    if args.check_steps and not args.hardware_profile:
        raise SystemExit("--check-steps prices the real steps with --hardware-profile: give it")
    import ray
    from ray import serve

    from iterserve.server.ray_app import start_ray
    os.environ.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tokenizer = load_tokenizer(args.model or default_model_path())
    trace = multi_tenant_trace(args.num_tenants, args.system_prompt_len, args.num_requests, args.user_len,
                               args.output_len, args.request_rate, args.seed, tokenizer)
    port = free_port()
    rows = {}
    start_ray(None)  # a local Ray, its workers at the engines' usual priority
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for policy in policies:
            real = real_run(args, trace, policy, port)
            rows[policy] = {"real": real, "sim": simulated_run(args, trace, policy, real["background_cores"]),
                            "sim-engine": simulated_run(args, trace, policy)}
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"$ python benchmarks/multi_tenant.py {shlex.join(argv)}")
    print(f"{args.num_tenants} tenants x {args.system_prompt_len}-token system prompts, {args.num_requests} requests "
          f"({args.user_len} own + {args.output_len} output tokens each), {args.replicas} replicas")
    print("work beside the engines (load generator, Ray's processes, the replicas' serving threads), CPU seconds "
          "per second: " + ", ".join(f"{p} {r['real']['background_cores']:.2f} (front end "
                                      f"{r['real']['frontend_cpu_s_per_token'] * 1e3:.2f} ms per streamed token)"
                                      for p, r in rows.items())
          + f"; `sim` shares {len(os.sched_getaffinity(0))} cores with it, `sim-engine` gives each replica its own")
    print("real TTFT mean where it was measured (client / ingress / replica): " + ", ".join(
        f"{p} {r['real']['ttft_mean_s']:.3f} / {r['real']['ttft_mean_ingress_s']:.3f} / "
        f"{r['real']['ttft_mean_replica_s']:.3f} s" for p, r in rows.items()))
    head = f"{'policy':<17}{'run':<11}{'hit rate':>9}{'TTFT mean s':>13}{'out tok/s':>11}{'failed':>8}"
    print(head + f"{'sim err tok/s':>15}{'sim err TTFT':>14}")
    print("-" * (len(head) + 29))
    for policy, r in rows.items():
        for kind in ("real", "sim", "sim-engine"):
            f = r[kind]
            line = (f"{policy:<17}{kind:<11}{f['prefix_hit_rate']:>9.1%}{f['ttft_mean_s']:>13.3f}"
                    f"{f['output_tokens_per_s']:>11.1f}{f['failed']:>8}")
            if kind != "real":
                line += (f"{_err(f['output_tokens_per_s'], r['real']['output_tokens_per_s']):>15}"
                         f"{_err(f['ttft_mean_s'], r['real']['ttft_mean_s']):>14}")
            print(line)
    if args.check_steps:
        print_checks(args, trace, rows)
    if args.json:
        with open(args.json, "w") as fh:
            figures = {p: {k: {f: v for f, v in run.items() if f not in ("steps", "prompt_lens")}
                           for k, run in r.items()}
                       for p, r in rows.items()}
            json.dump({"argv": argv, "rows": figures}, fh, indent=2)
    return 0


def _err(sim: float | None, real: float | None) -> str:
    return "-" if not sim or not real else f"{(sim - real) / real:+.1%}"


if __name__ == "__main__":
    sys.exit(main())
