"""`iterserve serve --data-parallel-size N`: the flags and the start-up of the Ray Serve app.

Kept apart from ray_app.py so that `iterserve serve --help` (and the one-process server) never
import Ray; Ray is an optional extra (`pip install 'iterserve[serve]'`).
"""
from __future__ import annotations

import argparse
import functools
import logging
import signal
import time

from iterserve.router.policy import POLICIES

logger = logging.getLogger("iterserve.server")


def add_replica_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas on Ray Serve (with --data-parallel-size > 1)")
    g.add_argument("--ray-address", default=None,
                   help="join this running Ray cluster (e.g. 10.0.0.1:6379 or auto); default: start a local Ray")
    g.add_argument("--num-cpus-per-replica", type=float, default=1.0,
                   help="CPUs Ray reserves for each engine replica (its placement, not a thread count)")
    g.add_argument("--router", choices=POLICIES, default="prefix-affinity", help="how requests pick a replica")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def serve_replicas(config, server, args: argparse.Namespace, name: str, origins: list[str] | None) -> int:
    """Start Ray (or join it), deploy ingress + N replicas, serve until interrupted; then tear it all down."""
    from iterserve.entrypoints.args import fail
    if args.num_cpus_per_replica <= 0:
        fail(f"--num-cpus-per-replica must be > 0, got {args.num_cpus_per_replica}")
    try:
        import ray
        from ray import serve

        from iterserve.server import ray_app
    except ImportError as e:
        fail(f"--data-parallel-size needs Ray Serve ({e.name} is missing): pip install 'iterserve[serve]'")
    from iterserve.engine import Engine
    n = config.parallel_config.data_parallel_size
    try:
        ray_app.start_ray(args.ray_address)
    except ValueError as e:
        fail(str(e))
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` tears the app down like Ctrl-C does
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        app = ray_app.build_ray_app(functools.partial(Engine, config), n, name, policy=args.router,
                                    block_size=config.cache_config.block_size,
                                    num_cpus_per_replica=args.num_cpus_per_replica,
                                    request_timeout=server.request_timeout, api_key=server.api_key,
                                    max_request_bytes=server.max_request_bytes, allowed_origins=origins)
        serve.run(app, blocking=False)
        ray_app.wait_until_ready(600)
        logger.info("serving %s on http://%s:%d/v1: %d replicas, %s routing", name, server.host, server.port, n,
                    args.router)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    except (ValueError, RuntimeError) as e:
        fail(str(e).splitlines()[0])
    finally:
        serve.shutdown()
        ray.shutdown()
