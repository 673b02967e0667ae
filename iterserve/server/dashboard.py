"""What an operator looks at: GET /dashboard (a static page shipped in the package: no build step, no
CDN), the JSON it polls (GET /v1/dashboard: the last few hundred steps, recent latencies, the active
diagnostics) and GET /v1/diagnostics.

The recorder and the diagnostics are fed from the AsyncEngine's on_step on the engine thread, where
they only append to bounded deques; the event loop reads snapshots of them under a lock, and the
diagnostics are evaluated on a worker thread every few seconds.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from contextlib import asynccontextmanager
from importlib import resources
from typing import TYPE_CHECKING, Callable

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from iterserve.engine.diagnostics import Capacity, Diagnostics, Slo, WhatIf
from iterserve.engine.stats import EngineStats
from iterserve.outputs import RequestOutput
from iterserve.server.async_engine import AsyncEngine
from iterserve.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from iterserve.engine.engine import Engine

logger = logging.getLogger("iterserve.server")

STATIC = resources.files("iterserve.server") / "static"

# Builds an engine's SLO what-if, or None where nothing models it. The CLI hands one in
# (iterserve/sim/server_whatif.py): the server imports neither the simulator nor the bench.
WhatIfFor = Callable[["Engine"], "WhatIf | None"]


class StepRecorder:
    """The last `max_steps` steps with the engine's stats after each, and the latencies of the last
    `max_requests` requests: what the dashboard draws."""

    def __init__(self, max_steps: int = 600, max_requests: int = 1000) -> None:
        self._steps: deque[tuple[int, EngineStats, int]] = deque(maxlen=max_steps)
        self._arrivals: deque[tuple[str, float]] = deque(maxlen=max_requests)
        self._latencies: deque[tuple[float | None, float | None]] = deque(maxlen=max_requests)
        self._lock = threading.Lock()
        self._last_step = -1

    def on_step(self, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        """Engine thread: O(outputs) appends at most, no formatting."""
        with self._lock:
            if stats.num_steps != self._last_step and stats.last_step is not None:
                self._last_step = stats.num_steps
                self._steps.append((stats.num_steps, stats, len(outputs)))
            for out in outputs:
                if out.new_token_ids and len(out.new_token_ids) == len(out.token_ids):
                    self._arrivals.append((out.request_id, out.times.arrival))
                if out.finished:
                    self._latencies.append((out.times.ttft, out.times.tpot))

    def snapshot(self, num_steps: int) -> dict:
        with self._lock:
            steps = list(self._steps)[-num_steps:]
            arrivals, latencies = list(self._arrivals), list(self._latencies)
        rows = []
        for n, s, num_outputs in steps:
            r = s.last_step
            rows.append({"step": n, "start": r.start, "end": r.end, "prefill": r.prefill_ids, "decode": r.decode_ids,
                         "preempted": r.preempted_ids, "running": s.num_running, "waiting": s.num_waiting,
                         "swapped": s.num_swapped, "kv_usage": round(s.kv_usage, 4),
                         "batched_tokens": r.num_batched_tokens, "new_tokens": num_outputs})
        last = steps[-1][1] if steps else None
        running = sorted(set(last.last_step.prefill_ids) | set(last.last_step.decode_ids)) if last else []
        return {"now": time.monotonic(), "steps": rows, "running": running,
                "arrivals": dict(arrivals),
                "ttft": [t for t, _ in latencies if t is not None],
                "tpot": [t for _, t in latencies if t is not None]}


def fan_out(first: Callable | None, *observers: Callable | None) -> Callable:
    """One on_step: `first` (the metrics), then each observer. An observer that fails is logged and
    dropped: the dashboard and the diagnostics must never take the engine loop down."""
    chosen = [c for c in observers if c is not None]

    def on_step(stats: EngineStats, outputs: list[RequestOutput]) -> None:
        if first is not None:
            first(stats, outputs)
        for c in chosen:
            try:
                c(stats, outputs)
            except Exception:  # noqa: BLE001
                logger.exception("%r failed; it gets no more steps", c)
                chosen.remove(c)
                break
    return on_step


def make_diagnostics(engine: Engine, slo_ttft: float | None = None, slo_tpot: float | None = None,
                     whatif_for: WhatIfFor | None = None) -> Diagnostics:
    """The server's diagnostics over this engine; SLO misses get the what-if `whatif_for` builds for it
    (the CLI hands in the simulator's), or none."""
    whatif = whatif_for(engine) if whatif_for is not None else None
    return Diagnostics(Capacity.of_engine(engine), Slo(slo_ttft, slo_tpot), whatif=whatif)


def mount(app: FastAPI, async_engine: AsyncEngine, metrics: ServerMetrics,
          diagnostics: Diagnostics | None) -> StepRecorder:
    """Add the dashboard and diagnostics routes, and feed them from the engine's on_step."""
    recorder = StepRecorder()
    async_engine.on_step = fan_out(async_engine.on_step, recorder.on_step,
                                   diagnostics.on_step if diagnostics is not None else None)
    engine = async_engine.engine
    sched, cache, spec = engine.config.scheduler_config, engine.config.cache_config, engine.executor.kv_cache_spec
    num_kv_blocks = engine.stats.num_kv_blocks  # read once, here: later the engine is the engine thread's
    metrics.set_cache_config(spec.block_size, num_kv_blocks, spec.num_host_blocks, spec.dtype,
                             cache.enable_prefix_caching, cache.watermark)
    if diagnostics is not None:
        metrics.set_diagnostics(())
        diagnostics.on_change = metrics.set_diagnostics

    async def evaluate_every() -> None:
        while True:
            await asyncio.sleep(diagnostics.thresholds.evaluate_every_s)
            try:
                await asyncio.to_thread(diagnostics.evaluate, engine.clock())
            except Exception:  # noqa: BLE001 - a failed evaluation must not stop the next one
                logger.exception("diagnostics evaluation failed")

    if diagnostics is not None:
        inner = app.router.lifespan_context

        async def lifespan(a):  # the evaluation task lives and dies with the server
            async with inner(a) as state:
                task = asyncio.ensure_future(evaluate_every())
                try:
                    yield state
                finally:
                    task.cancel()
        app.router.lifespan_context = asynccontextmanager(lifespan)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard():
        return HTMLResponse((STATIC / "dashboard.html").read_text())

    @app.get("/dashboard.js", include_in_schema=False)
    async def dashboard_js():
        return Response((STATIC / "dashboard.js").read_text(), media_type="text/javascript")

    @app.get("/v1/dashboard")
    async def dashboard_state(steps: int = 300):
        state = recorder.snapshot(max(1, min(steps, 600)))
        state["config"] = {"max_num_seqs": sched.max_num_seqs, "num_kv_blocks": num_kv_blocks,
                           "diagnostics": diagnostics is not None}
        state["diagnostics"] = diagnostics.report()["diagnostics"] if diagnostics is not None else []
        return state

    @app.get("/v1/diagnostics")
    async def diagnostics_report():
        if diagnostics is None:
            return {"enabled": False, "diagnostics": []}
        return {"enabled": True, **diagnostics.report()}

    return recorder

