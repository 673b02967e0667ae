"""`iterserve serve`: load the model, start the engine thread, serve the OpenAI API with uvicorn."""
from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from iterserve.config import ServerConfig
from iterserve.entrypoints.args import HelpFormatter, add_config_args, add_engine_args, config_from_args, fail

if TYPE_CHECKING:
    from iterserve.server.dashboard import WhatIfFor

logger = logging.getLogger("iterserve.server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve serve", description="OpenAI-compatible HTTP server",
                                     formatter_class=HelpFormatter)
    add_config_args(parser, ServerConfig, "server", defaults={"api_key": os.environ.get("ITERSERVE_API_KEY")})
    add_engine_args(parser)
    pd = parser.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    pd.add_argument("--pd", default=None, help="xPyD (e.g. 1P1D, 2P1D, 1P2D): x prefill and y decode engines, "
                    "each its own process, joined by KV connectors; the prefill engine chosen by prefix "
                    "affinity, the decode engine by least KV usage")
    pd.add_argument("--kv-transport", choices=("shm", "dist"), default="shm",
                    help="with --pd: shared memory (any xPyD), or torch.distributed send/recv (1P1D)")
    return parser


def served_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, taken before the model loads: a port in use fails at once, not after it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(infos[0][4])
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    return sock


def main(argv: list[str] | None = None, whatif_for: WhatIfFor | None = None) -> int:
    """`whatif_for` builds the diagnostics' SLO what-if (iterserve/cli.py hands in the simulator's)."""
    args = build_parser().parse_args(argv)
    server, config = config_from_args(args, ServerConfig), config_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = server.served_model_name or served_name(config.model_config.model)
    origins = [o.strip() for o in server.allowed_origins.split(",") if o.strip()] if server.allowed_origins else None
    if config.parallel_config.data_parallel_size > 1:  # replicas on Ray Serve, whose proxy takes the port
        if server.max_num_queued_tokens is not None:
            fail("--max-num-queued-tokens works on one engine (or --pd), not yet with --data-parallel-size > 1")
        from iterserve.server.ray_cli import serve_replicas
        return serve_replicas(config, server, name, origins)
    if server.ray_address is not None:
        fail("--ray-address places replicas on a Ray cluster: it needs --data-parallel-size > 1")
    sock = bind(server.host, server.port)
    # No cyclic GC while the start allocates (torch's import, the app's, the load): each pass walks every
    # object made so far, again and again. The load frees its buffers by refcount and collects once
    # (weight_cache.release_load_buffers); what the start made is frozen out of later passes.
    gc.disable()
    from iterserve.engine import Engine
    from iterserve.engine.core import LocalEngineCore
    from iterserve.server.async_engine import AsyncEngine

    start = time.monotonic()
    logger.info("loading %s ...", config.model_config.model or "the default model (SmolLM2-135M-Instruct)")
    build = lambda: Engine(config)  # noqa: E731
    if args.pd:
        from iterserve.engine.disagg import parse_pd
        from iterserve.engine.pd_front import check_transport, serving_engines
        if config.parallel_config.tensor_parallel_size > 1:
            fail("--pd runs without tensor parallelism (each engine is one process)")
        try:
            x, y = parse_pd(args.pd)
            check_transport(args.kv_transport, x, y)
        except ValueError as exc:
            fail(str(exc))
        build = lambda: serving_engines(config, args.kv_transport, x, y)  # noqa: E731
    async_engine = AsyncEngine(build, request_timeout=server.request_timeout, log_interval=server.log_interval,
                               max_num_queued_tokens=server.max_num_queued_tokens, wait=False)
    # the HTTP stack imports while the engine thread loads: it fits in the load's GIL-free stretches
    # (weight reads, packing, the tokenizer's Rust side)
    import uvicorn

    from iterserve.server.app import build_app
    from iterserve.server.dashboard import make_diagnostics
    from iterserve.server.shutdown import GracefulServer
    async_engine.wait_built()
    engine = async_engine.engine
    logger.info("loaded in %.1f s: %d KV blocks of %d tokens", time.monotonic() - start,
                engine.stats.num_kv_blocks, config.cache_config.block_size)
    diagnostics = None
    if server.diagnostics and isinstance(engine, LocalEngineCore):  # they read its KV spec and clock
        diagnostics = make_diagnostics(engine, server.slo_ttft, server.slo_tpot, whatif_for)
    app = build_app(async_engine, name, api_key=server.api_key, max_request_bytes=server.max_request_bytes,
                    allowed_origins=origins, diagnostics=diagnostics, pooling=server.pooling,
                    reasoning_parser=server.reasoning_parser, runtime_lora_updating=server.runtime_lora_updating)
    if server.host not in ("127.0.0.1", "localhost", "::1") and not server.api_key:
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", server.host)
    logger.info("serving %s on http://%s:%d/v1 (max_model_len %d)", name, server.host, server.port,
                engine.max_model_len)
    gc.freeze()
    gc.enable()
    # the drain ends every stream by --shutdown-timeout; uvicorn's own limit only backs it up
    uv_config = uvicorn.Config(app, log_level="info", access_log=server.access_log, timeout_graceful_shutdown=5)
    GracefulServer(uv_config, async_engine, server.shutdown_timeout).run(sockets=[sock])
    return 0
