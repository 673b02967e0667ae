"""Soak test: a bounded flood of mixed requests against a server on loopback, then a leak check.

The server runs in this process (uvicorn in a thread, the engine in its own thread) so the leak
check can read what it holds: KV blocks, scheduler requests, engine text states, open streams,
asyncio tasks on its event loop, threads, and the process RSS. Clients run on this thread's own
event loop. Requests mix prompt and output lengths, streamed and whole answers, n = 1 and 2, and
a fraction of clients disconnect at a random point. Reports errors, leaks and latency percentiles;
exits 1 if any acceptance check fails (0 unexpected errors, KV back to 0, no task or thread growth,
RSS growth under 10% after warm-up).

    python benchmarks/soak.py                          # real SmolLM2-135M, small lengths
    python benchmarks/soak.py --fake                   # instant fake model (tests/fake_executor.py)
    python benchmarks/soak.py --num-requests 2000 --concurrency 64 --disconnect-rate 0.05
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # --fake imports tests/

WORDS = ("the ocean a small town mathematics bread winter robots lighthouse keeper moon jazz library "
         "mountains train bees computer garden volcano river forest").split()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--disconnect-rate", type=float, default=0.05)
    p.add_argument("--stream-rate", type=float, default=0.5)
    p.add_argument("--max-prompt-words", type=int, default=120)
    p.add_argument("--max-output", type=int, default=24, help="output lengths are drawn from 1..this")
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of requests before the RSS baseline")
    p.add_argument("--fake", action="store_true", help="the fake model: measures the server, not the model")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_engine(args):
    from iterserve.config import EngineConfig
    from iterserve.engine import Engine
    config = EngineConfig(max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks, max_model_len=1024)
    if not args.fake:
        return Engine(config)
    from iterserve.model.loader import default_model_path, load_tokenizer
    from tests.server.conftest import TextFakeExecutor
    executor = TextFakeExecutor(load_tokenizer(default_model_path()), num_kv_blocks=args.num_kv_blocks,
                                max_model_len=1024)
    return Engine(config, executor)


def start_server(engine):
    import uvicorn

    from iterserve.server.app import build_app
    from iterserve.server.async_engine import AsyncEngine
    async_engine = AsyncEngine(engine, log_interval=1e9)
    app = build_app(async_engine, "soak")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", async_engine, server, thread


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def held(async_engine) -> dict[str, int]:
    engine = async_engine.engine
    s = engine.scheduler
    return {"kv_blocks_used": s.kv.num_blocks - s.kv.num_free_blocks, "scheduler_requests": len(s.requests),
            "engine_states": len(engine.states), "open_streams": async_engine.num_open_requests}


def server_tasks(async_engine) -> int:
    async def count():
        return len(asyncio.all_tasks())
    return asyncio.run_coroutine_threadsafe(count(), async_engine._loop).result(10)


def percentiles(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return f"p50 {1000 * pick(0.5):.0f} ms, p90 {1000 * pick(0.9):.0f} ms, p99 {1000 * pick(0.99):.0f} ms"


class Stats:
    def __init__(self, disconnect_rate: float) -> None:
        self.disconnect_rate = disconnect_rate
        self.ok = self.disconnected = 0
        self.errors: dict[str, int] = {}
        self.e2e: list[float] = []
        self.ttft: list[float] = []

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def one(i: int, url: str, http: httpx.AsyncClient, rng: random.Random, stats: Stats) -> None:
    chat = rng.random() < 0.5
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    body = {"model": "soak", "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0.0, 0.8]),
            "n": 2 if rng.random() < 0.1 else 1, "stream": rng.random() < 0.5, "ignore_eos": rng.random() < 0.5}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    route = url + ("/v1/chat/completions" if chat else "/v1/completions")
    disconnect = rng.random() < stats.disconnect_rate
    t0 = time.monotonic()
    try:
        if body["stream"]:
            cut = rng.randint(1, 6)
            async with http.stream("POST", route, json=body) as r:
                if r.status_code != 200:
                    return stats.error(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                n = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    n += 1
                    if n == 1 + chat:  # chat's first event is the role, no token yet
                        stats.ttft.append(time.monotonic() - t0)
                    if disconnect and n >= cut:
                        stats.disconnected += 1
                        return  # leaving the block closes the connection mid-stream
                    if line != "data: [DONE]" and "error" in json.loads(line[6:]):
                        return stats.error(f"stream error event: {line[:200]}")
        elif disconnect:
            try:
                await asyncio.wait_for(http.post(route, json=body), rng.uniform(0.001, 0.2))
            except asyncio.TimeoutError:
                stats.disconnected += 1
                return
        else:
            r = await http.post(route, json=body)
            if r.status_code != 200:
                return stats.error(f"HTTP {r.status_code}: {r.text[:200]}")
            if len(r.json()["choices"]) != body["n"]:
                return stats.error("wrong number of choices")
        stats.ok += 1
        stats.e2e.append(time.monotonic() - t0)
    except httpx.HTTPError as e:
        stats.error(f"{type(e).__name__}: {e}")


async def flood(url: str, args, stats: Stats, on_warm) -> None:
    rng = random.Random(args.seed)
    todo = iter(range(args.num_requests))
    warm_at = int(args.warmup * args.num_requests)
    done = 0

    async def worker(http):
        nonlocal done
        for i in todo:
            await one(i, url, http, rng, stats)
            done += 1
            if done == warm_at:
                on_warm()
            if done % max(1, args.num_requests // 10) == 0:
                print(f"  {done}/{args.num_requests} requests", flush=True)

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))


def wait_idle(async_engine, timeout: float = 30) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while any(held(async_engine).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held(async_engine)


def main(argv=None) -> int:
    args = parse_args(argv)
    print("command: python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    url, async_engine, server, thread = start_server(build_engine(args))
    model = "fake model" if args.fake else "SmolLM2-135M-Instruct (real weights)"
    print(f"server {url}, {model}; {args.num_requests} requests at concurrency {args.concurrency}, "
          f"{100 * args.disconnect_rate:.0f}% disconnects")
    # Baselines after one request of each kind, so lazily created threads and tasks are counted.
    asyncio.run(flood(url, argparse.Namespace(**{**vars(args), "num_requests": 8, "concurrency": 8, "warmup": 2}),
                      Stats(0.0), lambda: None))
    wait_idle(async_engine)
    threads0, tasks0 = threading.active_count(), server_tasks(async_engine)
    rss = {"start": rss_bytes()}
    stats = Stats(args.disconnect_rate)
    t0 = time.monotonic()
    asyncio.run(flood(url, args, stats, lambda: rss.__setitem__("warm", rss_bytes())))
    elapsed = time.monotonic() - t0
    leftover = wait_idle(async_engine)
    deadline = time.monotonic() + 10
    while (threading.active_count() > threads0 or server_tasks(async_engine) > tasks0) and time.monotonic() < deadline:
        time.sleep(0.1)
    threads1, tasks1, rss["end"] = threading.active_count(), server_tasks(async_engine), rss_bytes()
    growth = rss["end"] / rss.get("warm", rss["start"]) - 1
    server.should_exit = True
    thread.join(10)
    async_engine.shutdown()

    print(f"\n{args.num_requests} requests in {elapsed:.1f}s ({args.num_requests / elapsed:.1f} req/s): "
          f"{stats.ok} ok, {stats.disconnected} disconnected on purpose, {sum(stats.errors.values())} unexpected errors")
    for what, count in sorted(stats.errors.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {count} x {what}")
    print(f"latency (completed requests): e2e {percentiles(stats.e2e)}; TTFT (streamed) {percentiles(stats.ttft)}")
    print(f"held after the flood: {leftover}")
    print(f"threads {threads0} -> {threads1}, server asyncio tasks {tasks0} -> {tasks1}")
    print(f"RSS start {rss['start'] / 2**20:.0f} MiB, after warm-up {rss.get('warm', 0) / 2**20:.0f} MiB, "
          f"end {rss['end'] / 2**20:.0f} MiB: growth after warm-up {100 * growth:+.1f}%")
    checks = {"0 unexpected errors": not stats.errors, "nothing held (KV blocks back to 0)": not any(leftover.values()),
              "no thread growth": threads1 <= threads0, "no task growth": tasks1 <= tasks0,
              "RSS growth < 10% after warm-up": growth < 0.10}
    for name, ok in checks.items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
