"""The http:URL target: any OpenAI-compatible server, driven through streamed /v1/completions."""
from __future__ import annotations

import asyncio
import json
import sys
import time

from iterserve.bench.metrics import RequestMetrics, TargetResult, request_metrics
from iterserve.bench.progress import _progress
from iterserve.bench.workload import Trace, TraceRequest, materialize_prompts
from iterserve.request import RequestTimes


def parse_http_target(target: str) -> str:
    """'http:URL' -> URL; a bare 'http://host:port' or 'https://...' is accepted as it is."""
    if target.startswith(("http://", "https://")):
        return target.rstrip("/")
    if target.startswith("http:"):
        return target[5:].rstrip("/")
    raise ValueError(f"not an http target: {target!r} (use http:URL)")


async def _http_model(client, url: str) -> str:
    resp = await client.get(f"{url}/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def _http_request(client, url: str, model: str, r: TraceRequest, t0: float) -> RequestMetrics:
    payload = {"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    times = RequestTimes(arrival=time.monotonic())
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"].get("completion_tokens")
                if chunk.get("choices"):  # one chunk per token (text may be empty mid-character)
                    times.token_times.append(time.monotonic())
        times.finished = time.monotonic()
    except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
        print(f"http request {r.request_id} failed: {e}", file=sys.stderr)
    times.first_token = times.token_times[0] if times.token_times else None
    n = usage if usage is not None else len(times.token_times)
    m = request_metrics(r.request_id, r.prompt_len, n, times, t0)
    m.queue = None  # the server's queue is not visible from the client
    if times.finished is None or not times.token_times:
        m.e2e = None
    return m


async def _http_run(trace: Trace, url: str, model: str | None, progress: bool, transport=None,
                    api_key: str | None = None) -> TargetResult:
    import httpx
    limit = trace.concurrency
    sem = asyncio.Semaphore(limit) if limit else None
    bar = _progress(len(trace), "http", progress)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), transport=transport, headers=headers,
                                 limits=httpx.Limits(max_connections=limit or len(trace))) as client:
        model = model or await _http_model(client, url)
        t0 = time.monotonic()

        async def one(r: TraceRequest) -> RequestMetrics:
            if not limit:
                await asyncio.sleep(max(0.0, t0 + r.arrival_time - time.monotonic()))
                m = await _http_request(client, url, model, r, t0)
            else:
                async with sem:
                    m = await _http_request(client, url, model, r, t0)
            bar.update(1)
            return m

        metrics = await asyncio.gather(*(one(r) for r in trace.requests))
    bar.close()
    end = max((m.finished for m in metrics if m.finished is not None), default=0.0)
    return TargetResult(f"http:{url}", list(metrics), end, [], 0,
                        {"model": model, "kv_usage_known": False,
                         "timing": "TTFT/ITL from SSE chunk arrival; queue time not visible"})


def run_http(trace: Trace, url: str, model: str | None = None, progress: bool = False,
             tokenizer=None, transport=None, api_key: str | None = None) -> TargetResult:
    if any(r.prompt_token_ids is None for r in trace.requests):
        materialize_prompts(trace, tokenizer)
    return asyncio.run(_http_run(trace, url, model, progress, transport, api_key))
