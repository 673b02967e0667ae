"""One engine of xPyD in its own process, and the KV transports between them (docs/disaggregation.md).

The front (pd_front.py) spawns each worker with an inbox of commands and an outbox of its own (the
write end of a pipe only it writes: a worker killed mid-write can block no other worker's outputs);
a worker steps its PrefillEngine or DecodeEngine (disagg.py) and reports its outputs and EngineStats
after every step. Prefill workers reach decode workers through KV connectors: a shared-memory queue
per (prefill, decode) pair (shm, any xPyD) or one torch.distributed group (dist, 1P1D).
"""
from __future__ import annotations

import multiprocessing.connection
import queue as queue_module

TRANSPORTS = ("shm", "dist")


def check_transport(transport: str, num_prefill: int, num_decode: int) -> None:
    """What the transports run, refused in one line before any process starts."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"--pd needs at least one prefill and one decode engine, not {num_prefill}P{num_decode}D")
    if transport == "dist" and num_prefill * num_decode > 1:
        raise ValueError(f"--kv-transport dist runs 1P1D only (one two-rank torch.distributed group), not "
                         f"{num_prefill}P{num_decode}D; --kv-transport shm runs any xPyD")


def _make_connector(name: str, transport: str, channels: dict, init_method: str | None):
    """A decode engine's receiver, or a prefill engine's RoutedConnector with a channel to each decode
    engine. channels: decode engine -> {prefill engine: their shared-memory queue} (shm) or None (dist, 1P1D)."""
    from iterserve.kv_transfer.connector import RoutedConnector
    if transport == "shm":
        from iterserve.kv_transfer.shm_connector import ShmConnector
        if name in channels:
            return _FanIn([ShmConnector(q) for q in channels[name].values()])
        return RoutedConnector({decode: ShmConnector(queues[name]) for decode, queues in channels.items()})
    from iterserve.kv_transfer.dist_connector import DECODE_RANK, PREFILL_RANK, DistConnector
    import torch
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if name in channels:
        return DistConnector(DECODE_RANK, init_method, backend)
    return RoutedConnector({decode: DistConnector(PREFILL_RANK, init_method, backend) for decode in channels})


class _FanIn:
    """A decode engine's receiving side under shm: one channel from each prefill engine, taken in as
    they come."""

    def __init__(self, channels: list) -> None:
        self.channels = channels

    def send(self, request_id: str, blocks, hashes: list[bytes], meta) -> None:
        raise TypeError("a fan-in only receives (it is the decode side's)")

    def receive(self, timeout: float = 0.0):
        for channel in self.channels:
            if (transfer := channel.receive(0.0)) is not None:
                return transfer
        readers = [channel.queue._reader for channel in self.channels]  # a queue is not waitable itself
        if timeout > 0 and multiprocessing.connection.wait(readers, timeout):
            return self.receive(0.0)
        return None

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def worker(name: str, config, transport: str, channels: dict, init_method: str | None, inbox, outbox) -> None:
    """One engine's process: take commands, step the engine, report outputs and stats. Ends on ("stop",)."""
    from iterserve.engine.disagg import DecodeEngine, PrefillEngine
    from iterserve.engine.engine import Engine
    decoding = name in channels
    try:
        engine = Engine(config)
        connector = _make_connector(name, transport, channels, init_method)
        side = DecodeEngine(engine, connector) if decoding else PrefillEngine(engine, connector)
    except Exception as exc:
        outbox.send(("failed", name, f"{type(exc).__name__}: {exc}"))
        return
    outbox.send(("ready", name, engine.stats))
    reported = engine.stats.num_steps
    while True:
        busy = side.has_unfinished()
        if decoding and not busy:  # idle, it waits on its KV channel, not on the commands: a transfer
            side.poll(timeout=0.02)  # landing is taken in at once
            busy = side.has_unfinished()
        try:
            while True:  # an idle prefill engine has nothing to do until a command comes
                cmd = inbox.get() if not (busy or decoding) else inbox.get_nowait()
                busy = True  # drain the rest without waiting
                if cmd[0] == "stop":
                    side.shutdown()
                    outbox.send(("stopped", name, None))
                    return
                _command(side, cmd, outbox, name)
        except queue_module.Empty:
            pass
        if side.has_unfinished():
            outputs, stats = side.step(), side.stats
            if outputs or stats.num_steps != reported:  # after every step run: the routers' view of its load
                reported = stats.num_steps
                outbox.send(("out", name, (outputs, stats)))


def _command(side, cmd: tuple, outbox, name: str) -> None:
    if cmd[0] == "add":
        _, request_id, prompt, params, arrival, priority, cache_salt, decode_target = cmd
        try:
            side.add_request(prompt, params, request_id, decode_target=decode_target, arrival_time=arrival,
                             priority=priority, cache_salt=cache_salt)
        except ValueError as exc:
            outbox.send(("rejected", name, (request_id, str(exc))))
    elif cmd[0] == "abort":
        outputs = side.abort_request(cmd[1])
        if outputs:
            outbox.send(("out", name, (outputs, side.stats)))
    elif cmd[0] == "dead":  # prefill side: a decode engine died, refuse to send to it
        side.connector.mark_dead(cmd[1])
    elif cmd[0] == "stats":
        outbox.send(("stats", name, side.stats))
