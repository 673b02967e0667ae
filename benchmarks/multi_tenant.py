"""Prefix-affinity vs round-robin routing over real engine replicas, then the simulator on the same trace.

Tenants each with their own long system prompt send interleaved requests to N replicas on a local
Ray Serve (`iterserve serve --data-parallel-size N` as an app). For each routing policy: a fresh app
(cold caches), the trace through the OpenAI endpoint (the bench's http driver), and the prefix-cache
hit rate from the replicas' reports. Then the simulator's multi-replica mode runs the same trace
behind the same policy code, and the table gives its error against the real run.

    python benchmarks/multi_tenant.py                       # 8 tenants x 1,024-token prompts, 256 requests
    python benchmarks/multi_tenant.py --num-requests 16 --system-prompt-len 64 --output-len 4   # a smoke run

The simulator prices steps with a cpu-local profile (`iterserve calibrate`), plus the front end's CPU per
streamed token measured in the real run (row `sim`; `sim-engine` leaves it out). Calibrate it with the
threads each replica gets (--num-threads), or its step times will not be this run's.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from iterserve.bench.metrics import summarize
from iterserve.bench.runner import run_http
from iterserve.bench.workload import multi_tenant_trace
from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.model.loader import default_model_path, load_tokenizer
from iterserve.router.policy import POLICIES, make_router
from iterserve.sim.cli import make_engine, resolve
from iterserve.sim.cluster import run_cluster
from iterserve.sim.hardware import with_overrides

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
    p.add_argument("--json", default=None, help="write every figure here")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"model": args.model, "kv_cache_memory": args.kv_cache_memory, "max_num_seqs": args.max_num_seqs,
            "num_threads": args.num_threads}


def prefix_totals(url: str) -> tuple[int, int]:
    """(prompt tokens looked up, of those found cached), summed over the replicas' latest reports."""
    stats = httpx.get(f"{url}/health", timeout=30).json()["replicas"].values()
    return sum(s["num_prefix_queries"] for s in stats), sum(s["num_prefix_hits"] for s in stats)


def ttft_sums(url: str) -> dict[str, tuple[float, int]]:
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
    stats = httpx.get(f"{url}/health", timeout=30).json()["replicas"].values()
    return {"ingress": (ingress[0], ingress[1]),
            "replica": (sum(s["ttft_sum_s"] for s in stats), sum(s["num_first_tokens"] for s in stats))}


def serving_cpu_seconds() -> float:
    """CPU seconds used so far by everything serving the trace except the engines: this process (the
    load generator) and Ray's own (proxy, ingress, controller, GCS, raylet, agents). On a host whose
    cores the replicas also use, each of those seconds is taken from a replica."""
    tick, total = os.sysconf("SC_CLK_TCK"), sum(os.times()[:2])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            if int(pid) == os.getpid() or "EngineReplica" in cmd or "ray" not in cmd:
                continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return total


def warm_up(url: str, replicas: int) -> None:
    """Short requests, all at once so the router spreads them over every replica: lazy start-up
    work is not billed to the trace. Each prompt is shorter than a block, so nothing is cached."""
    def one(k: int) -> None:
        httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": [100 + k] * 4, "max_tokens": 4,
                                                  "ignore_eos": True}, timeout=300).raise_for_status()
    with ThreadPoolExecutor(2 * replicas) as pool:
        list(pool.map(one, range(2 * replicas)))


def real_run(args: argparse.Namespace, trace, policy: str, port: int) -> dict:
    """A fresh app per policy, so every policy starts from cold caches."""
    from ray import serve

    from iterserve.server.ray_app import build_ray_app, wait_until_ready
    config = EngineConfig(**engine_kwargs(args))
    app = build_ray_app(functools.partial(Engine, config), args.replicas, MODEL_NAME, policy=policy,
                        block_size=config.cache_config.block_size, num_cpus_per_replica=args.num_cpus_per_replica,
                        stats_period_s=args.stats_period)
    serve.run(app, blocking=False)
    try:
        wait_until_ready(600)
        url = f"http://127.0.0.1:{port}"
        warm_up(url, args.replicas)
        time.sleep(3 * args.stats_period)  # the replicas' reports arrive on Ray's stats poll
        queries0, hits0 = prefix_totals(url)
        ttft0 = ttft_sums(url)
        cpu0 = serving_cpu_seconds()
        result = run_http(trace, url, MODEL_NAME)
        frontend_s = serving_cpu_seconds() - cpu0
        expected = queries0 + sum(r.prompt_len for r in trace.requests)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and prefix_totals(url)[0] < expected:
            time.sleep(0.2)
        queries, hits = prefix_totals(url)
        ttft1 = ttft_sums(url)
        hops = {f"ttft_mean_{where}_s": (ttft1[where][0] - ttft0[where][0]) / max(1, ttft1[where][1] - ttft0[where][1])
                for where in ttft1}
        rate = (hits - hits0) / (queries - queries0) if queries > queries0 else 0.0
        tokens = sum(r.output_len for r in trace.requests)
        return {**_figures(summarize(result, per_request=False)), "prefix_hit_rate": rate, **hops,
                "frontend_cpu_s_per_token": frontend_s / tokens}
    finally:
        serve.delete("default")


def simulated_run(args: argparse.Namespace, trace, policy: str, frontend_s_per_token: float = 0.0) -> dict:
    """The simulator's replicas, each step priced by the calibrated profile plus, per request in the
    step, the front end's CPU per streamed token measured in the real run (one core per replica: the
    front end's work for a replica's tokens is taken from that replica's core). Its router reads the
    replicas' loads every --stats-period seconds, as the real one reads their polled reports."""
    model, hw = resolve(argparse.Namespace(hardware="cpu-local", hardware_profile=args.hardware_profile,
                                           dtype_bytes=None, model=args.model))
    hw = with_overrides(hw, seq_overhead_s=hw.seq_overhead_s + frontend_s_per_token)
    config = EngineConfig(**{**engine_kwargs(args), "model": None})
    engines = [make_engine(config, model, hw) for _ in range(args.replicas)]
    result, stats = run_cluster(engines, trace, make_router(policy, args.seed), f"sim {policy}",
                                report_interval=args.stats_period)
    return {**_figures(summarize(result, per_request=False)), "prefix_hit_rate": stats.prefix_hit_rate}


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
            rows[policy] = {"real": real, "sim": simulated_run(args, trace, policy, real["frontend_cpu_s_per_token"]),
                            "sim-engine": simulated_run(args, trace, policy)}
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"$ python benchmarks/multi_tenant.py {shlex.join(argv)}")
    print(f"{args.num_tenants} tenants x {args.system_prompt_len}-token system prompts, {args.num_requests} requests "
          f"({args.user_len} own + {args.output_len} output tokens each), {args.replicas} replicas")
    print("front end (load generator + Ray proxy, ingress, controller) CPU per streamed token: "
          + ", ".join(f"{p} {r['real']['frontend_cpu_s_per_token'] * 1e3:.2f} ms" for p, r in rows.items())
          + "; `sim` adds it to each request's step cost, `sim-engine` prices the engines alone")
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
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"argv": argv, "rows": rows}, fh, indent=2)
    return 0


def _err(sim: float | None, real: float | None) -> str:
    return "-" if not sim or not real else f"{(sim - real) / real:+.1%}"


if __name__ == "__main__":
    sys.exit(main())
