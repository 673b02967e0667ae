"""Start-up time and memory of `iterserve serve`: spawn to the first 200 from /health, cold and warm.

    python benchmarks/startup.py                          # 2 cold + 3 warm starts of the default model
    python benchmarks/startup.py --cold 1 --warm 1 --requests 4     # a smoke run
    python benchmarks/startup.py --phases                 # where one start goes, phase by phase, in-process

Each start is a fresh `python -m iterserve.cli serve` on a free 127.0.0.1 port. Cold: an empty cache
directory (ITERSERVE_WEIGHT_CACHE and XDG_CACHE_HOME point into a new temporary folder), so the GGUF is
dequantized, the tokenizer converted and the C++ kernels compiled; warm: the folder the first cold start
filled. The GGUF file itself sits in the OS page cache either way (dropping it needs root). For each start:
seconds to ready, RSS at ready, the process's peak RSS by then (VmHWM: the load's high-water mark), and
RSS after --requests chat completions of --max-tokens tokens each, --concurrency at a time (the KV pool's
pages are committed as its blocks are first used, so this grows with the traffic).

--phases runs the steps a ModelRunner takes in one child process per kind and prints the seconds, the
RSS and the peak RSS so far after each: torch's import alone (the floor), the other imports, the
tokenizer (named by its class: ServingTokenizer where the cache entry lets a start skip transformers),
arch + weights (GGUF or cache), model build (packing), releasing the load buffers, the KV pool, the
first step (kernel build/load, oneDNN's first calls). The phases run one after another here; the
server loads the tokenizer on a second thread while it reads and packs the weights, and imports its
HTTP stack on the main thread meanwhile, so its time to ready is less than their sum.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

MiB = 1 << 20


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--cold", type=int, default=2, help="starts from an empty cache directory")
    p.add_argument("--warm", type=int, default=3, help="starts from the cache the first cold start filled")
    p.add_argument("--requests", type=int, default=16, help="chat completions sent after ready (0: none)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take before it counts as failed")
    p.add_argument("--phases", action="store_true", help="the in-process phase breakdown instead")
    p.add_argument("--serve-args", default="", help="more `iterserve serve` flags, one shell-quoted string")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--phase-child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM in bytes, from /proc/PID/status."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def cache_env(cache: str) -> dict[str, str]:
    return {**os.environ, "ITERSERVE_WEIGHT_CACHE": os.path.join(cache, "iterserve", "weights"),
            "XDG_CACHE_HOME": cache}


# ---------------------------------------------------------------- one server start

def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--port", str(port)]
    return cmd + (["--model", args.model] if args.model else []) + shlex.split(args.serve_args)


def wait_ready(proc: subprocess.Popen, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.02)
    raise RuntimeError(f"not ready within {timeout:.0f} s")


def chat(port: int, i: int, max_tokens: int) -> None:
    body = {"messages": [{"role": "user", "content": f"Write a short note about the number {i}."}],
            "max_tokens": max_tokens, "temperature": 0.0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        json.load(r)


def one_start(args: argparse.Namespace, kind: str, cache: str) -> dict:
    port = free_port()
    log = tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen(serve_command(args, port), env=cache_env(cache), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, port, args.timeout)
        row = {"kind": kind, "ready_s": time.perf_counter() - start}
        status = proc_status(proc.pid)
        row |= {"rss_ready": status["VmRSS"], "peak_at_ready": status["VmHWM"]}
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda i: chat(port, i, args.max_tokens), range(args.requests)))
        status = proc_status(proc.pid)
        return row | {"rss_after": status["VmRSS"], "peak_after": status["VmHWM"]}
    except Exception:
        log.seek(0)
        sys.stderr.write(log.read().decode(errors="replace")[-4000:])
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def run_starts(args: argparse.Namespace) -> list[dict]:
    rows, warm_cache = [], None
    tmp = tempfile.mkdtemp(prefix="iterserve-startup-")
    try:
        for i in range(args.cold):
            cache = os.path.join(tmp, f"cold{i}")
            os.makedirs(cache)
            rows.append(one_start(args, "cold", cache))
            warm_cache = warm_cache or cache
        if args.warm and warm_cache is None:  # no cold start asked: fill a cache first, untimed
            warm_cache = os.path.join(tmp, "warm")
            os.makedirs(warm_cache)
            one_start(argparse.Namespace(**{**vars(args), "requests": 0}), "fill", warm_cache)
        rows += [one_start(args, "warm", warm_cache) for _ in range(args.warm)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def print_starts(argv: list[str], args: argparse.Namespace, rows: list[dict]) -> None:
    print(f"$ python benchmarks/startup.py {shlex.join(argv)}")
    print(f"server: {shlex.join(serve_command(args, 0)[1:]).replace('--port 0', '--port PORT')}; then "
          f"{args.requests} chat completions x {args.max_tokens} tokens, {args.concurrency} at a time")
    head = f"{'kind':<6}{'ready s':>9}{'RSS ready MiB':>15}{'peak MiB':>10}{'RSS after MiB':>15}{'peak after MiB':>16}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['kind']:<6}{r['ready_s']:>9.2f}{r['rss_ready'] / MiB:>15.0f}{r['peak_at_ready'] / MiB:>10.0f}"
              f"{r['rss_after'] / MiB:>15.0f}{r['peak_after'] / MiB:>16.0f}")


# ---------------------------------------------------------------- phases, in one process

def phase_child(args: argparse.Namespace) -> None:
    """What ModelRunner(config) does, a phase at a time, then a first prompt and decode step; JSON on stdout."""
    rows, t0 = [], time.perf_counter()

    def mark(name: str, start: float) -> float:
        now, status = time.perf_counter(), proc_status(os.getpid())
        rows.append({"phase": name, "s": now - start, "rss": status["VmRSS"], "peak": status["VmHWM"]})
        return now

    import torch  # noqa: F401 - alone first: the floor of a start, which nothing in iterserve removes
    t = mark("import torch", t0)

    from iterserve.config import EngineConfig
    from iterserve.executor.dtypes import pick_device, storage_dtype
    from iterserve.executor.model_runner import ModelRunner
    from iterserve.model import weight_cache
    from iterserve.model.loader import default_model_path
    from iterserve.sampling_params import SamplingParams
    from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput
    from iterserve.server import app, async_engine, cli  # noqa: F401
    t = mark("imports (iterserve, fastapi)", t)
    path = args.model or default_model_path()
    config = EngineConfig(model=path)
    tokenizer = weight_cache.load_tokenizer(path)
    t = mark(f"tokenizer ({type(tokenizer).__name__})", t)
    arch, weights = weight_cache.load_arch_and_weights(path, storage_dtype("auto", pick_device("auto")))
    loaded = {"weights": weights}
    del weights
    t = mark("arch + weights (GGUF dequantize, or cache read)", t)
    runner = ModelRunner(config, arch, loaded.pop("weights"), tokenizer)  # no reference left here to keep them
    t = mark("model build (packing), buffers released, KV pool", t)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    prompt = ScheduledRequest("p", list(range(100, 132)), 0, [0, 1], True, greedy)
    runner.execute(SchedulerOutput(block_size=16, scheduled=[prompt]))
    t = mark("first step: a 32-token prompt", t)
    decode = ScheduledRequest("p", [200], 32, [0, 1, 2], True, greedy, output_len=1)
    runner.execute(SchedulerOutput(block_size=16, scheduled=[decode]))
    mark("first decode step", t)
    print(json.dumps(rows))


def run_phases(args: argparse.Namespace) -> dict[str, list[dict]]:
    out, tmp = {}, tempfile.mkdtemp(prefix="iterserve-startup-")
    cmd = [sys.executable, os.path.abspath(__file__), "--phase-child"] + (["--model", args.model] if args.model else [])
    try:
        for kind in ("cold", "warm"):  # warm: the cache the cold run filled
            done = subprocess.run(cmd, env=cache_env(tmp), capture_output=True, text=True, timeout=args.timeout)
            if done.returncode != 0:
                raise RuntimeError(f"the {kind} phase run failed:\n{done.stderr[-4000:]}")
            out[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def print_phases(argv: list[str], phases: dict[str, list[dict]]) -> None:
    print(f"$ python benchmarks/startup.py {shlex.join(argv)}")
    head = f"{'phase':<52}" + "".join(f"{k + ' s':>10}{k + ' RSS MiB':>16}{'peak MiB':>10}" for k in phases)
    print(head + "\n" + "-" * len(head))
    for i, row in enumerate(next(iter(phases.values()))):
        print(f"{row['phase']:<52}" + "".join(f"{p[i]['s']:>10.2f}{p[i]['rss'] / MiB:>16.0f}{p[i]['peak'] / MiB:>10.0f}"
                                             for p in phases.values()))
    print(f"{'total':<52}" + "".join(f"{sum(r['s'] for r in p):>10.2f}{'':>26}" for p in phases.values()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.phase_child:
        phase_child(args)
        return 0
    if args.phases:
        result = run_phases(args)
        print_phases(argv, result)
    else:
        result = run_starts(args)
        print_starts(argv, args, result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"argv": argv, "result": result}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
