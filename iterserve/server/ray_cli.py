"""`iterserve serve --data-parallel-size N`: the start-up of the Ray Serve app.

Its flags (--ray-address, --num-cpus-per-replica, --router) are ServerConfig fields, generated and
validated with the others. Kept apart from ray_app.py so that `iterserve serve --help` (and the
one-process server) never import Ray; Ray is an optional extra (`pip install 'iterserve[serve]'`).

Start-up refuses, in one line and with nothing left running: what the model rules out (a
--tensor-parallel-size that does not divide its heads), checked before Ray starts; more devices
than Ray has; a Ray that cannot start or be reached; an app whose replicas fail to start.
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import time

logger = logging.getLogger("iterserve.server")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def check_model(config) -> None:
    """What the model's shapes rule out, read from its config before Ray (or any replica) starts."""
    from iterserve.model import weight_cache
    from iterserve.model.loader import default_model_path
    from iterserve.model.sharding import check_tp_size
    check_tp_size(weight_cache.load_arch(config.model_config.model or default_model_path()),
                  config.parallel_config.tensor_parallel_size)


def replica_gpus(device: str, tensor_parallel_size: int, num_replicas: int, gpus: float) -> int:
    """GPUs each replica reserves from Ray: one per TP rank on CUDA, else none. Ray hides every GPU from
    an actor that reserves none, so an engine left on `auto` would quietly run on the CPU there."""
    on_cuda = device.startswith("cuda") or (device == "auto" and gpus > 0)
    if not on_cuda:
        return 0
    needed = num_replicas * tensor_parallel_size
    if needed > gpus:
        raise ValueError(f"{num_replicas} replicas x tensor_parallel_size {tensor_parallel_size} need {needed} "
                         f"GPUs; Ray has {gpus:g} (--device cpu runs the replicas on CPUs)")
    return tensor_parallel_size


def check_cpus(num_replicas: int, num_cpus_per_replica: float, cpus: float) -> None:
    """A local Ray never grows: replicas it cannot place would wait for CPUs forever. (A joined cluster
    may autoscale, so it is not checked there.)"""
    needed = num_replicas * num_cpus_per_replica
    if needed > cpus:
        raise ValueError(f"{num_replicas} replicas x num_cpus_per_replica {num_cpus_per_replica:g} need "
                         f"{needed:g} CPUs; this machine's Ray has {cpus:g}")


def _local_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _local_cpus() -> float:
    """The CPUs a local Ray will find here (it reads cgroup quotas too)."""
    try:
        from ray._private.utils import get_num_cpus  # private: fall back to the plain count if it moves
    except ImportError:
        return float(os.cpu_count() or 1)
    return get_num_cpus()


def serve_replicas(config, server, name: str, origins: list[str] | None) -> int:
    """Start Ray (or join it), deploy ingress + N replicas, serve until interrupted; then tear it all down.
    A refusal is printed after the teardown, so it is the last line the user sees."""
    from iterserve.entrypoints.args import fail
    try:
        import ray
        from ray import serve

        from iterserve.server import ray_app
    except ImportError as e:
        fail(f"--data-parallel-size needs Ray Serve ({e.name} is missing): pip install 'iterserve[serve]'")
    n, tp = config.parallel_config.data_parallel_size, config.parallel_config.tensor_parallel_size
    device, local = config.model_config.device, server.ray_address is None
    try:
        check_model(config)
        if local:  # a local Ray finds this machine's CPUs and GPUs: refused before it starts
            replica_gpus(device, tp, n, _local_gpus())
            check_cpus(n, server.num_cpus_per_replica, _local_cpus())
        ray_app.start_ray(server.ray_address)
    except (ValueError, OSError) as e:
        fail(str(e).splitlines()[0])
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill` tears the app down like Ctrl-C does
    serving, error = False, None  # a joined cluster may run others' Serve apps: shut Serve down only if ours
    try:
        gpus = replica_gpus(device, tp, n, ray.cluster_resources().get("GPU", 0))
        serving = True
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(_app(config, server, name, origins, gpus), blocking=False)
        ray_app.wait_until_ready(600)
        logger.info("serving %s on http://%s:%d/v1: %d replicas, %s routing", name, server.host, server.port, n,
                    server.router)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except (ValueError, RuntimeError) as e:
        error = str(e).splitlines()[0]
    finally:
        if serving:
            serve.shutdown()
        ray.shutdown()
        signal.signal(signal.SIGTERM, previous)
    if error is not None:
        fail(error)
    return 0


def _app(config, server, name: str, origins: list[str] | None, gpus: int):
    from iterserve.engine import Engine
    from iterserve.server import ray_app
    return ray_app.build_ray_app(functools.partial(Engine, config), config.parallel_config.data_parallel_size, name,
                                 policy=server.router, block_size=config.cache_config.block_size,
                                 num_cpus_per_replica=server.num_cpus_per_replica, num_gpus_per_replica=gpus,
                                 request_timeout=server.request_timeout, api_key=server.api_key,
                                 max_request_bytes=server.max_request_bytes, allowed_origins=origins)
