"""`iterserve serve --data-parallel-size N`: N engine replicas behind one OpenAI endpoint, on Ray Serve.

    Ray Serve proxy ── Ingress (the FastAPI app of server/app.py, over a ReplicaClient: an EngineClient)
                          │ deployment handle + IterserveRequestRouter (our policy, router/policy.py)
                          ├── EngineReplica 0: AsyncEngine ── Engine
                          └── EngineReplica 1: ...

The ingress tokenizes (the router needs the prompt's token ids to hash its blocks) and hands the
ids to Ray's router, which picks a replica with our policy; the replica streams RequestOutputs back.
Each replica reports its EngineStats through Ray's routing-stats hook; the router reads them
(and its own count of requests in flight) to balance load, and /health and /metrics show them per
replica. The ingress relays every output, so it measures TTFT, ITL and e2e latency itself, where the
client sees them (server/metrics.py RelayMetrics). Ray restarts a replica whose process dies: a request
that had not streamed anything yet is retried on another replica, one that had ends with an engine_dead
error; others are untouched.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from collections import deque
from typing import AsyncIterator, Callable

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig

from iterserve.engine import Engine
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.server.async_engine import AsyncEngine, EngineDeadError
from iterserve.server.metrics import RelayMetrics, RelayTimer

logger = logging.getLogger("iterserve.server")

ROUTER_CLASS = "iterserve.router.ray_router:IterserveRequestRouter"
# A request is retried this many times while no replica has started streaming it.
MAX_DISPATCH_ATTEMPTS = 3
_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


class EngineReplica:
    """One engine (an AsyncEngine on its own thread) in one Ray actor process."""

    def __init__(self, build_engine: Callable[[], object], request_timeout: float | None = None,
                 step_log_dir: str | None = None) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.num_requests = 0
        # Replica-side TTFT (the call's start to its first token leaving the replica): set against the
        # ingress's own TTFT, it tells the engine's share of what the client waits from the hops'.
        self.num_first_tokens = 0
        self.ttft_sum_s = 0.0
        # step_log_dir: every step's record and every request's prompt length, appended to
        # <dir>/<replica id>.jsonl at each stats poll, so a benchmark can price the real steps
        # (sim/step_check.py) after the run.
        self.step_log = None if step_log_dir is None else os.path.join(step_log_dir, f"{self.replica_id}.jsonl")
        self.unlogged: deque[dict] = deque()  # appended by the engine thread, emptied by the stats poll
        self.async_engine = AsyncEngine(build_engine, request_timeout=request_timeout, on_step=self._on_step)
        self.stats = self.async_engine.engine.stats

    def _on_step(self, stats, outputs) -> None:
        if self.step_log is not None and stats.last_step is not None and stats.num_steps != self.stats.num_steps:
            self.unlogged.append({"step": dataclasses.asdict(stats.last_step)})
        self.stats = stats

    def _flush_step_log(self) -> None:
        lines = [self.unlogged.popleft() for _ in range(len(self.unlogged))]
        if lines:
            with open(self.step_log, "a") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)

    async def generate(self, prompt: list[int] | str, params: SamplingParams, request_id: str, priority: int,
                       cache_salt: str | None) -> AsyncIterator[RequestOutput | str]:
        """Yields this replica's id once the engine accepted the request (bad input raises before), then
        its outputs."""
        start = time.monotonic()
        if self.step_log is not None and isinstance(prompt, list):  # before any step of it can be logged
            self.unlogged.append({"request_id": request_id, "prompt_len": len(prompt)})
        stream = await self.async_engine.add_request(prompt, params, request_id=request_id, priority=priority,
                                                     cache_salt=cache_salt)
        self.num_requests += 1
        yield self.replica_id
        first = True
        async for out in stream:
            if first and out.new_token_ids:
                first = False
                self.num_first_tokens += 1
                self.ttft_sum_s += time.monotonic() - start
            yield out

    def info(self) -> dict:
        e = self.async_engine
        return {"tokenizer": e.tokenizer, "max_model_len": e.max_model_len, "vocab_size": e.vocab_size,
                "eos_token_ids": e.eos_token_ids, "pid": os.getpid(), "replica": self.replica_id}

    def record_routing_stats(self) -> dict:
        """Ray's routing-stats hook, polled by the controller; our router reads the result."""
        if self.step_log is not None:
            self._flush_step_log()
        s = self.stats
        return {"num_running": s.num_running, "num_waiting": s.num_waiting + s.num_swapped, "kv_usage": s.kv_usage,
                "num_preemptions": s.num_preemptions, "num_prefix_queries": s.num_prefix_queries,
                "num_prefix_hits": s.num_prefix_hits, "num_requests": self.num_requests, "pid": os.getpid(),
                "num_first_tokens": self.num_first_tokens, "ttft_sum_s": self.ttft_sum_s,
                "engine_cpu_s": self.async_engine.thread_cpu_s(),
                "alive": self.async_engine.dead is None}

    def check_health(self) -> None:
        """Ray's health check: a dead engine loop makes Ray replace this replica."""
        if self.async_engine.dead is not None:
            raise RuntimeError(f"the engine loop has died: {self.async_engine.dead!r}")


class ReplicaStream:
    """One request's outputs from a replica (a ClientStream, as AsyncEngine's RequestStream is), timed
    as they pass. `finished` is the app's flag too (it sets it before aborting); `ended` is the call's
    own: whether the replica has sent the last output, so there is nothing left to cancel."""

    def __init__(self, request_id: str, engine: "ReplicaClient", response, timer: RelayTimer) -> None:
        self.request_id, self.engine, self.response, self.timer = request_id, engine, response, timer
        self.finished = False
        self.ended = False
        self.num_outputs = 0
        self.unfinished: int | None = None  # sequences still running, once the first one finished (n > 1)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self.response:
                self.num_outputs += 1
                self._observe(out)
                yield out
            self._end()
        except _REPLICA_GONE as e:
            self._end("error")
            raise EngineDeadError(f"the replica serving this request died after {self.num_outputs} outputs "
                                  f"({type(e).__name__}); retry the request") from e
        finally:
            self.close()

    def _observe(self, out: RequestOutput) -> None:
        self.timer.on_output(out, time.monotonic())
        if out.finished:
            self.unfinished = (out.n if self.unfinished is None else self.unfinished) - 1
            if self.unfinished == 0:  # before the last yield: a consumer may stop after it
                self._end()

    def _end(self, reason: str | None = None) -> None:
        self.finished = self.ended = True
        self.timer.on_end(time.monotonic(), reason)

    def close(self) -> None:
        """Ends the call; one still running is cancelled, which reaches the replica and aborts the request."""
        self.engine.streams.pop(self.request_id, None)
        self.finished = True
        if not self.ended:
            self._end("abort")
            self.response.cancel()


class ReplicaClient:
    """The ingress's engine client (server/engine_client.py): requests go to the replicas through the
    deployment handle; the model's facts came from one replica at start-up."""

    # The engine's own prompt check (it reads only .tokenizer and .vocab_size): bad ids are a 400 here,
    # before any replica is asked.
    encode = Engine.encode

    def __init__(self, handle, tokenizer, max_model_len: int, vocab_size: int | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), latencies: RelayMetrics | None = None) -> None:
        self.handle = handle.options(stream=True)
        self.tokenizer, self.max_model_len, self.vocab_size = tokenizer, max_model_len, vocab_size
        self.eos_token_ids = eos_token_ids
        self.latencies = latencies or RelayMetrics("")
        self.on_step = None  # never called: the engines step in the replicas, which report through Ray
        self.draining = False  # Ray Serve drains replicas itself on shutdown
        self.streams: dict[str, ReplicaStream] = {}  # open calls, by request id (abort cancels them)

    @property
    def dead(self) -> BaseException | None:
        return None if any(s.get("alive") for s in replica_stats().values()) else EngineDeadError("no live replica")

    def start(self) -> None:
        """Nothing to start here: Ray Serve started the replicas before it built this app."""

    def shutdown(self) -> None:
        """The ingress is going away: cancel the calls still open (each aborts its request in its replica)."""
        for stream in list(self.streams.values()):
            stream.close()

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                          priority: int = 0, cache_salt: str | None = None) -> ReplicaStream:
        arrival = time.monotonic()
        if isinstance(prompt, str) and prompt and self.tokenizer is not None:  # the router hashes token ids
            prompt = list(self.tokenizer.encode(prompt))
        error = None
        for _ in range(MAX_DISPATCH_ATTEMPTS):
            response = self.handle.generate.remote(prompt, params, request_id, priority, cache_salt)
            try:
                replica = await response.__anext__()  # accepted; bad input raises the engine's own error here
            except _REPLICA_GONE as e:  # nothing was streamed: safe to send it again
                logger.warning("request %s: its replica died before it started (%s); retrying", request_id, e)
                error = e
                continue
            timer = self.latencies.timer(replica, arrival)
            self.streams[request_id] = stream = ReplicaStream(request_id, self, response, timer)
            return stream
        raise EngineDeadError(f"no replica could take the request: {error!r}")

    def abort(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.close()


def replica_stats() -> dict[str, dict]:
    """Every live replica's latest report, from the Ray routers in this process."""
    from iterserve.router.ray_router import LIVE_ROUTERS
    out: dict[str, dict] = {}
    for router in list(LIVE_ROUTERS):
        out.update(router.replica_stats())
    return out


_GAUGES = {"num_running": ("num_requests_running", "Requests in the running batch."),
           "num_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
           "kv_usage": ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)."),
           "num_preemptions": ("num_preemptions_total", "Requests preempted since the replica started."),
           "num_prefix_queries": ("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
           "num_prefix_hits": ("prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
           "num_requests": ("replica_requests_total", "Requests this replica accepted since it started.")}


class ClusterMetrics:
    """/metrics for the ingress: the engine gauges with a `replica` label, from the replicas' reports, and
    the latencies the ingress measures on the streams it relays (`latencies`, fed by the ReplicaClient)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.latencies = RelayMetrics(model_name)

    def render(self) -> bytes:
        registry = CollectorRegistry()
        gauges = {k: Gauge("iterserve:" + name, doc, ["model_name", "replica"], registry=registry)
                  for k, (name, doc) in _GAUGES.items()}
        up = Gauge("iterserve:replica_up", "1 while the replica's engine loop runs.", ["model_name", "replica"],
                   registry=registry)
        for replica, stats in replica_stats().items():
            up.labels(self.model_name, replica).set(1 if stats.get("alive") else 0)
            for key, gauge in gauges.items():
                if key in stats:
                    gauge.labels(self.model_name, replica).set(stats[key])
        return generate_latest(self.latencies.registry) + generate_latest(registry)


class Ingress:
    """The OpenAI app of server/app.py over a ReplicaClient; built once the replicas answer."""

    def __init__(self, engines, served_model_name: str, api_key: str | None = None,
                 max_request_bytes: int = 4 << 20, allowed_origins: list[str] | None = None) -> None:
        self.engines = engines
        self.app_kwargs = {"served_model_name": served_model_name, "api_key": api_key,
                           "max_request_bytes": max_request_bytes, "allowed_origins": allowed_origins}

    async def __serve_build_asgi_app__(self):
        from iterserve.server.app import build_app
        info = await self.engines.info.remote()
        metrics = ClusterMetrics(self.app_kwargs["served_model_name"])
        client = ReplicaClient(self.engines, info["tokenizer"], info["max_model_len"], info["vocab_size"],
                               info["eos_token_ids"], metrics.latencies)
        async def health():
            """200 while at least one replica's engine runs; the body says how each one is doing."""
            stats = replica_stats()
            status = 200 if any(s.get("alive") for s in stats.values()) else 503
            return JSONResponse({"replicas": stats}, status_code=status)

        return build_app(client, metrics=metrics, health=health, **self.app_kwargs)  # /metrics renders ClusterMetrics


def build_ray_app(build_engine: Callable[[], object], num_replicas: int, served_model_name: str, *,
                  policy: str = "prefix-affinity", block_size: int = 16, num_cpus_per_replica: float = 1.0,
                  num_gpus_per_replica: int = 0, request_timeout: float | None = None, stats_period_s: float = 0.5,
                  step_log_dir: str | None = None, **app_kwargs):
    """The Serve application (bind graph): `serve.run(build_ray_app(...))` starts it."""
    if num_replicas < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {num_replicas}")
    router = RequestRouterConfig(request_router_class=ROUTER_CLASS,
                                 request_router_kwargs={"policy": policy, "block_size": block_size},
                                 request_routing_stats_period_s=stats_period_s)
    replica = serve.deployment(EngineReplica, name="EngineReplica", num_replicas=num_replicas,
                               ray_actor_options={"num_cpus": num_cpus_per_replica,
                                                  "num_gpus": num_gpus_per_replica},
                               max_ongoing_requests=100_000,  # the engine queues (and rejects) by itself
                               request_router_config=router, health_check_period_s=2, health_check_timeout_s=30)
    # Ray's default of 5 ongoing requests per replica would hold every request past the fifth in the
    # proxy, outside the engines' queues, metrics and routing, capping the whole app's batch at 5.
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)
    return ingress.bind(replica.bind(build_engine, request_timeout, step_log_dir), served_model_name, **app_kwargs)


def start_ray(address: str | None, num_cpus: float | None = None) -> None:
    """Join the cluster at `address`, or start a local Ray; a one-line ValueError when neither works."""
    import ray
    if address and ":" in address and "://" not in address:
        _check_reachable(address)
    if address is None:
        # Ray starts its workers at nice 15, so on a node shared with anything at nice 0 (the load
        # generator, Ray's own control plane) the engines lose every contended slice. A cluster we
        # join keeps its own setting.
        os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        ray.init(address=address, num_cpus=None if address else num_cpus, include_dashboard=False,
                 log_to_driver=False, ignore_reinit_error=True)
    except Exception as e:  # noqa: BLE001 - Ray raises many kinds; the user needs one line
        ray.shutdown()  # whatever part of a local Ray did start
        raise ValueError(f"cannot start Ray{f' at {address}' if address else ''}: {e}") from None


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """ray.init retries an unreachable GCS for minutes; a host:port nobody answers on fails here at once."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout).close()
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot reach a Ray cluster at {address}: {e}") from None


def wait_until_ready(timeout: float, app_name: str = "default") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app_name)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise ValueError(f"the Ray Serve app failed to start: {status.message}")
        time.sleep(0.5)
    raise ValueError(f"the Ray Serve app did not start within {timeout:g}s")
