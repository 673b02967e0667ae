"""The OpenAI-compatible HTTP API over an AsyncEngine: the app, assembled from one router per concern
(info.py, completions.py, chat.py, embeddings.py, responses.py, messages.py) behind the error handlers (errors.py) and the guard
(guard.py).

A client that goes away (mid-stream or while waiting for a non-streamed answer) has its request
aborted, which frees its KV blocks at the next step boundary (streams.py).
"""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

import iterserve
from iterserve.engine.core import LocalEngineCore
from iterserve.engine.diagnostics import Diagnostics
from iterserve.server import chat, completions, embeddings, info, lora_routes, messages, responses
from iterserve.server.async_engine import AsyncEngine
from iterserve.server.dashboard import mount as mount_dashboard
from iterserve.server.engine_client import EngineClient, check_engine_client
from iterserve.server.errors import add_error_handlers
from iterserve.server.guard import _Guard
from iterserve.server.metrics import ServerMetrics
from iterserve.server.routes import Routes


def build_app(async_engine: EngineClient, served_model_name: str, api_key: str | None = None,
              max_request_bytes: int = 1 << 20, metrics=None,
              allowed_origins: list[str] | None = None, diagnostics: Diagnostics | None = None,
              pooling: str = "last", reasoning_parser: str | None = None,
              runtime_lora_updating: bool = False, health=None) -> FastAPI:
    """The OpenAI app over an engine client (server/engine_client.py), checked here. `metrics`: what
    /metrics renders; by default a ServerMetrics fed by the client's on_step. A caller that passes its
    own (the Ray ingress: ClusterMetrics) feeds it itself. `pooling`: how /v1/embeddings pools;
    `reasoning_parser`: how chat replies' reasoning is split off (server/reasoning.py); `runtime_lora_updating`:
    mount the LoRA load/unload routes (server/lora_routes.py); `health`: a /health handler in place of the
    engine's own (the Ray ingress reports its replicas)."""
    check_engine_client(async_engine)
    if metrics is None:
        metrics = ServerMetrics(served_model_name)
        async_engine.on_step = metrics.on_step

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="iterserve", version=iterserve.__version__, lifespan=lifespan)
    app.state.async_engine, app.state.metrics = async_engine, metrics
    add_error_handlers(app)

    routes = Routes(async_engine, served_model_name, reasoning_parser)
    app.include_router(info.router(routes, metrics, health))
    app.include_router(completions.router(routes))
    app.include_router(chat.router(routes))
    app.include_router(embeddings.router(routes, pooling))
    app.include_router(responses.router(routes))
    app.include_router(messages.router(routes))
    if runtime_lora_updating:  # off by default: its requests name files on this machine
        app.include_router(lora_routes.router(routes))

    if isinstance(async_engine, AsyncEngine) and isinstance(async_engine.engine, LocalEngineCore):  # its KV spec, clock
        mount_dashboard(app, async_engine, metrics, diagnostics)  # /dashboard, /v1/dashboard, /v1/diagnostics
    app.add_middleware(_Guard, api_key=api_key, max_request_bytes=max_request_bytes)
    if allowed_origins:  # off by default; outside the guard, so preflights need no API key
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app
