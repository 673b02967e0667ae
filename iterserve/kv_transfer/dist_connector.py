"""KV transport over torch.distributed point-to-point send/recv: a two-rank group, rank 0 the
prefill engine and rank 1 the decode engine; gloo between CPU processes, NCCL between GPUs.

Each transfer is three messages: a header's length, the header (request id, hashes, meta, the
blocks' shape and dtype, pickled) and the blocks themselves. The receiver runs recv in a thread, so
receive() never blocks the decode loop; a sender whose peer died gets an exception from send().
"""
from __future__ import annotations

import logging
import pickle
import queue as queue_module
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from iterserve.kv_transfer.connector import HandoffMeta, KVTransfer, get_or_none

logger = logging.getLogger("iterserve.kv_transfer")
PREFILL_RANK, DECODE_RANK = 0, 1
_DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.int8)}


class DistConnector:
    def __init__(self, rank: int, init_method: str, backend: str = "gloo", timeout_s: float = 120.0) -> None:
        """Joins (or forms) the two-rank group; blocks until the other side joins too."""
        if rank not in (PREFILL_RANK, DECODE_RANK):
            raise ValueError(f"rank must be {PREFILL_RANK} (prefill) or {DECODE_RANK} (decode), got {rank}")
        self.rank, self.backend = rank, backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=2,
                                timeout=timedelta(seconds=timeout_s))
        self.arrived: queue_module.Queue[KVTransfer] = queue_module.Queue()
        self.error: str | None = None  # why the receiving thread stopped
        if rank == DECODE_RANK:
            threading.Thread(target=self._receive_loop, name="kv-recv", daemon=True).start()

    def send(self, request_id: str, blocks: torch.Tensor, hashes: list[bytes], meta: HandoffMeta) -> None:
        header = pickle.dumps((request_id, hashes, meta, tuple(blocks.shape), str(blocks.dtype)))
        self._send_header(header)
        dist.send(blocks.contiguous().to(self.device), DECODE_RANK)

    def _send_header(self, header: bytes) -> None:
        dist.send(torch.tensor([len(header)], dtype=torch.int64, device=self.device), DECODE_RANK)
        if header:
            dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device), DECODE_RANK)

    def _receive_loop(self) -> None:
        try:
            while True:
                size = torch.empty(1, dtype=torch.int64, device=self.device)
                dist.recv(size, PREFILL_RANK)
                if size.item() == 0:
                    return  # the sender closed
                raw = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
                dist.recv(raw, PREFILL_RANK)
                request_id, hashes, meta, shape, dtype = pickle.loads(raw.cpu().numpy().tobytes())
                blocks = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
                dist.recv(blocks, PREFILL_RANK)
                self.arrived.put(KVTransfer(request_id, blocks, hashes, meta))
        except Exception as exc:  # the prefill side died: the engine carries on with what it has
            self.error = f"KV receiver stopped: {exc}"
            logger.warning(self.error)

    def receive(self, timeout: float = 0.0) -> KVTransfer | None:
        return get_or_none(self.arrived, timeout)

    def close(self) -> None:
        """The sender tells the receiver to stop; the group stays until the process exits (a peer
        blocked in recv would hang destroy_process_group)."""
        if self.rank == PREFILL_RANK:
            try:
                self._send_header(b"")
            except Exception:  # the peer is already gone
                pass
