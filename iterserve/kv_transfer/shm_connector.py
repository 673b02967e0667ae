"""Same-host KV transport: transfers go through a torch.multiprocessing queue, which moves a CPU
tensor's storage into shared memory and passes a handle, so the blocks are copied once (into the
segment) and read in place by the receiver, never serialized."""
from __future__ import annotations


import torch
import torch.multiprocessing as mp

from iterserve.kv_transfer.connector import HandoffMeta, KVTransfer, get_or_none


class ShmConnector:
    """One direction, prefill -> decode. Build it before starting the processes and pass it to both
    (it pickles as its queue); in one process it works as is."""

    def __init__(self, queue=None) -> None:
        self.queue = queue if queue is not None else mp.get_context("spawn").Queue()

    def send(self, request_id: str, blocks: torch.Tensor, hashes: list[bytes], meta: HandoffMeta) -> None:
        self.queue.put(KVTransfer(request_id, blocks.share_memory_(), hashes, meta))

    def receive(self, timeout: float = 0.0) -> KVTransfer | None:
        return get_or_none(self.queue, timeout)

    def close(self) -> None:
        self.queue.close()
