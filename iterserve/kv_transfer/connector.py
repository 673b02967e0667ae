"""The KV connector: how a prefill engine hands a request's KV blocks to a decode engine (docs/disaggregation.md).

One interface, several transports (shm_connector.py: shared memory on one host; dist_connector.py:
torch.distributed point-to-point). Blocks travel in the pool's native layout
[layers, 2, blocks, block_size, kv_heads, head_dim], only the request's own, with the prefix hashes
of its full blocks so the receiver's prefix cache learns them. An int8 pool's rows are head_dim + 4
int8 wide, each (token, kv head)'s float32 scale inline (model/kv_quant.py): the scales travel in
the same tensor, and both engines must share --kv-cache-dtype (write_blocks refuses the other kind).
Torch-free: a transport may carry any array-like; the executor's write_blocks reads it.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any, Protocol

from iterserve.sampling_params import SamplingParams


@dataclass(slots=True)
class HandoffMeta:
    """What the decode engine needs besides the blocks to carry the request on."""

    prompt_token_ids: list[int]
    first_token: int  # sampled by the prefill engine
    sampling_params: SamplingParams
    arrival_time: float  # monotonic, as the prefill engine saw it (same host: the same clock)
    first_token_time: float
    priority: int = 0
    cache_salt: str | None = None
    decode_target: str | None = None  # which decode engine gets it (xPyD: chosen by the front's router)


@dataclass(slots=True)
class KVTransfer:
    request_id: str
    blocks: Any | None  # [layers, 2, n, block_size, kv_heads, head_dim]; None: the blocks did not arrive
    hashes: list[bytes]
    meta: HandoffMeta
    error: str | None = None  # why the blocks did not arrive (the request is recomputed)


class KVConnector(Protocol):
    def send(self, request_id: str, blocks: Any, hashes: list[bytes], meta: HandoffMeta) -> None:
        """Deliver (or fail with an exception); the caller frees its blocks afterwards either way."""

    def receive(self, timeout: float = 0.0) -> KVTransfer | None:
        """The next transfer, or None if none arrived within `timeout` seconds."""

    def close(self) -> None: ...


class RoutedConnector:
    """A prefill engine's side of xPyD: one channel per decode engine, each transfer sent on the one
    its meta.decode_target names. A channel marked dead refuses at once, so the prefill engine ends
    that request with an error and frees its blocks instead of sending into a queue nobody reads."""

    def __init__(self, channels: dict[str, KVConnector]) -> None:
        if not channels:
            raise ValueError("a routed connector needs at least one decode channel")
        self.channels = channels
        self.dead: set[str] = set()

    def send(self, request_id: str, blocks: Any, hashes: list[bytes], meta: HandoffMeta) -> None:
        target = meta.decode_target
        if target is None and len(self.channels) == 1:
            target = next(iter(self.channels))
        if target not in self.channels:
            raise ValueError(f"request {request_id}: no KV channel to decode engine {target!r}")
        if target in self.dead:
            raise ConnectionError(f"decode engine {target} is dead")
        self.channels[target].send(request_id, blocks, hashes, meta)

    def receive(self, timeout: float = 0.0) -> KVTransfer | None:
        raise TypeError("a routed connector only sends (it is the prefill side's)")

    def mark_dead(self, target: str) -> None:
        self.dead.add(target)

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


def get_or_none(q, timeout: float) -> KVTransfer | None:
    """A queue's next transfer within `timeout` seconds (0: only if one is there), else None."""
    try:
        return q.get(timeout=timeout) if timeout > 0 else q.get_nowait()
    except queue.Empty:
        return None
