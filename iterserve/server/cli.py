"""`iterserve serve`: load the model, start the engine thread, serve the OpenAI API with uvicorn."""
from __future__ import annotations

import argparse
import logging
import os

from iterserve.config import parse_bytes
from iterserve.entrypoints.args import add_engine_args, config_from_args

logger = logging.getLogger("iterserve.server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve serve", description="OpenAI-compatible HTTP server")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("ITERSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/ routes (env ITERSERVE_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients send (default: file name)")
    parser.add_argument("--max-request-bytes", type=parse_bytes, default=4 << 20, help="larger bodies get a 413")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="abort a request (and free its KV blocks) this many seconds after arrival")
    parser.add_argument("--allowed-origins", default=None,
                        help="comma-separated origins allowed by CORS, or '*' (default: CORS off)")
    parser.add_argument("--log-interval", type=float, default=10.0, help="seconds between engine status lines")
    parser.add_argument("--access-log", action="store_true", help="also log uvicorn's per-request access line")
    add_engine_args(parser)
    return parser


def served_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from iterserve.engine import Engine
    from iterserve.server.app import build_app
    from iterserve.server.async_engine import AsyncEngine

    config = config_from_args(args)
    async_engine = AsyncEngine(lambda: Engine(config), request_timeout=args.request_timeout,
                               log_interval=args.log_interval)
    engine = async_engine.engine
    name = args.served_model_name or served_name(config.model)
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()] if args.allowed_origins else None
    app = build_app(async_engine, name, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                    allowed_origins=origins)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)
    logger.info("serving %s on http://%s:%d/v1 (max_model_len %d)", name, args.host, args.port,
                engine.scheduler.max_model_len)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=args.access_log)
    return 0
