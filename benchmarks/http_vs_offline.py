"""Output tokens/s of one workload offline (LLM.generate, in process) and through `iterserve serve`.

The server runs in a subprocess with the same engine flags, and this process drives it at the given
concurrency with streamed completions: by default over raw httpx reading SSE lines (a lean load
generator, as vLLM's benchmark_serving is), or with `--client openai` through the official client.
Every request generates exactly --max-tokens tokens (ignore_eos), so both paths do the same work.

    python benchmarks/http_vs_offline.py --num-prompts 64 --concurrency 32 --max-tokens 64 [--repeats 3]
    (any engine flag after it is passed to both, e.g. --device cuda --max-num-seqs 32)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

TOPICS = ["the ocean", "a small town", "mathematics", "the history of bread", "winter", "robots",
          "a lighthouse keeper", "the moon", "jazz", "an old library", "mountains", "a train journey",
          "bees", "the first computer", "a quiet garden", "volcanoes"]


def prompts(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i}):" for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_runner(args, engine_argv: list[str]):
    """A function that runs the workload through LLM.generate and returns output tokens/s."""
    from iterserve.entrypoints.args import add_engine_args, config_from_args
    from iterserve.llm import LLM
    from iterserve.sampling_params import SamplingParams

    p = argparse.ArgumentParser()
    add_engine_args(p)
    config = config_from_args(p.parse_args(engine_argv))
    llm = LLM(**config.flat())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts(2), params, use_tqdm=False)  # warm-up

    def run() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts(args.num_prompts), params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        assert tokens == args.num_prompts * args.max_tokens
        return tokens / elapsed
    return run


def openai_streamer(url: str, args):
    """One streamed completion through the official openai client; returns its output token count."""
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600)

    async def one(prompt: str) -> int:
        stream = await client.completions.create(
            model="bench", prompt=prompt, max_tokens=args.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens
    return one, client.close


def httpx_streamer(url: str, args):
    """The same request over raw httpx, reading the SSE lines and decoding only the last event (the
    usage), as vLLM's benchmark_serving does with aiohttp: a lean load generator, which matters when
    it shares the server's two cores (the openai client builds a pydantic object per token)."""
    import httpx
    client = httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=args.concurrency + 8))
    body = {"model": "bench", "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}

    async def one(prompt: str) -> int:
        last = None
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = line
        return json.loads(last[6:])["usage"]["completion_tokens"]
    return one, client.aclose


async def drive_server(url: str, args) -> tuple[float, float, float]:
    """Output tokens/s through the server, the worst /health latency meanwhile, and the client's CPU seconds."""
    import httpx

    request, close = (openai_streamer if args.client == "openai" else httpx_streamer)(url, args)
    sem = asyncio.Semaphore(args.concurrency)

    async def one(prompt: str) -> int:
        async with sem:
            return await request(prompt)

    try:
        await asyncio.gather(*(one(p) for p in prompts(2)))  # warm-up
        # The event loop's responsiveness under load: /health latency while the run is going.
        health: list[float] = []

        async def probe(done: asyncio.Event) -> None:
            async with httpx.AsyncClient() as http:
                while not done.is_set():
                    t = time.perf_counter()
                    await http.get(url + "/health")
                    health.append(time.perf_counter() - t)
                    await asyncio.sleep(0.2)

        done = asyncio.Event()
        prober = asyncio.create_task(probe(done))
        t0, cpu0 = time.perf_counter(), time.process_time()
        counts = await asyncio.gather(*(one(p) for p in prompts(args.num_prompts)))
        elapsed, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
        done.set()
        await prober
    finally:
        await close()
    assert sum(counts) == args.num_prompts * args.max_tokens, counts
    return sum(counts) / elapsed, max(health, default=0.0), client_cpu


def start_server(engine_argv: list[str], verbose: bool) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--port", str(port),
           "--served-model-name", "bench", *engine_argv]
    server = subprocess.Popen(cmd, stdout=None if verbose else subprocess.DEVNULL,
                              stderr=None if verbose else subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.terminate()
            raise RuntimeError("the server did not come up in 600 s")
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3,
                        help="offline and HTTP runs, alternated (this machine is noisy: medians are compared)")
    parser.add_argument("--client", choices=["httpx", "openai"], default="httpx",
                        help="load generator: raw httpx SSE (lean, the default) or the official openai client")
    parser.add_argument("--verbose", action="store_true", help="show the server's log")
    args, engine_argv = parser.parse_known_args()
    if "--max-num-seqs" not in engine_argv:  # the same batch size both ways: apples to apples
        engine_argv += ["--max-num-seqs", str(args.concurrency)]
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]))
    run_offline = offline_runner(args, engine_argv)
    server, url = start_server(engine_argv, args.verbose)
    offline, http, health, client_cpu = [], [], [], []
    try:
        for i in range(args.repeats):  # one at a time: the server is idle while offline runs, and back
            offline.append(run_offline())
            tokens_per_s, worst_health, cpu = asyncio.run(drive_server(url, args))
            http.append(tokens_per_s)
            health.append(worst_health)
            client_cpu.append(cpu)
            print(f"run {i + 1}: offline {offline[-1]:.1f}, HTTP {http[-1]:.1f} output tokens/s", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    med_offline, med_http = statistics.median(offline), statistics.median(http)
    print(f"offline (LLM.generate):        {med_offline:8.1f} output tokens/s (median of {args.repeats})")
    print(f"HTTP (serve, concurrency {args.concurrency:>3}): {med_http:8.1f} output tokens/s (median of {args.repeats})")
    print(f"HTTP / offline: {100 * med_http / med_offline:.1f}%  (target >= 90%); "
          f"worst /health latency under load: {1000 * max(health):.0f} ms; "
          f"load generator ({args.client}) CPU: {statistics.median(client_cpu):.2f} s per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
