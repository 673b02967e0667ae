"""TPExecutor: one model split over N worker processes (tensor parallelism), behind the Executor contract.

Every rank is a worker process started with torch.multiprocessing (spawn) and joined by
torch.distributed (gloo on CPU, nccl on CUDA); each holds its shard of the weights
(model/sharding.py) and its kv heads' share of the paged KV cache. The block tables are the same on
every rank, so the scheduler and the KV manager run once, here in the engine process, unchanged.

Why no rank lives in the engine process: the engine process stays a plain client of the ranks.
A dead rank shows at once as its process sentinel, while the engine thread waits on pipes, never
inside a collective that a dead peer would hang; every rank is the same code with the same thread
count, so none is slowed by the engine's HTTP and detokenizing work; and shutting down is closing
pipes. The cost is one pickled plan per step written to N pipes (the plan is small: a request's full
data once, then each step its new tokens and blocks; executor/request_state.py), and one pickled
StepResult back from rank 0.

Each step every rank applies the plan's swaps and copies to its own blocks, runs the forward (two
all-reduces a layer, one logits all-gather) and samples from the same gathered logits with the same
seeded generators and grammar matchers, the matchers fed the same output deltas on every rank
(executor/structured_output.py); rank 0 answers. Any rank that fails or dies stops every rank: the
executor is then dead and says which rank failed and why (ExecutorDeadError, which the Engine does
not survive).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import traceback
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from iterserve.config import EngineConfig
from iterserve.executor.base import ExecutorDeadError
from iterserve.executor.dtypes import pick_device, storage_dtype
from iterserve.executor.model_runner import ModelRunner, eos_token_ids
from iterserve.model import weight_cache
from iterserve.model.loader import default_model_path, load_model_arch, load_weights
from iterserve.model.sharding import TensorParallel, check_tp_size, lm_head, rank_arch, shard_weights
from iterserve.scheduler.output import SchedulerOutput, StepResult

logger = logging.getLogger("iterserve.tp")
_HOST = "127.0.0.1"  # the ranks of one executor share a machine


class TPExecutor:
    def __init__(self, config: EngineConfig) -> None:
        mc, pc = config.model_config, config.parallel_config
        n = pc.tensor_parallel_size
        path = mc.model or default_model_path()
        arch = weight_cache.load_arch(path)
        check_tp_size(arch, n)
        device = pick_device(mc.device)
        if device.type == "cuda" and n > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {n} needs {n} CUDA devices, this machine has "
                             f"{torch.cuda.device_count()}")
        store = _listen(pc.distributed_port)
        self._dead: str | None = None
        self._procs: list = []
        self._conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns, store)
        try:
            _start_workers(config, n, store.port, self._procs, self._conns)
            self.tokenizer = weight_cache.load_tokenizer(path)  # while the ranks load their weights
            ready = self._receive(set(range(n)), "start-up")
        except BaseException:
            self.shutdown()
            raise
        spec = ready[0]["kv_cache_spec"]
        # on CUDA each rank profiles its own free memory: the pool is what the smallest one holds
        self.kv_cache_spec = replace(spec, num_device_blocks=min(r["kv_cache_spec"].num_device_blocks
                                                                 for r in ready.values()))
        self.max_model_len = ready[0]["max_model_len"]
        self.vocab_size = arch.vocab_size
        self.eos_token_ids = eos_token_ids(arch, self.tokenizer)
        logger.info("tensor parallel: %d ranks (pids %s), %d KV blocks of %d bytes per rank", n,
                    ", ".join(str(p.pid) for p in self._procs), self.kv_cache_spec.num_device_blocks,
                    self.kv_cache_spec.bytes_per_block)

    def execute(self, plan: SchedulerOutput) -> StepResult:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)  # once, for every rank
        for conn in self._conns:
            try:
                conn.send_bytes(data)
            except OSError:
                break  # that rank is gone: _receive reports how
        return self._receive({0}, "a step")[0]

    def shutdown(self) -> None:
        """Stops every rank (also run when the executor is collected or the process exits)."""
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _receive(self, ranks: set[int], during: str) -> dict:
        """One message from each of `ranks`, watching every rank's pipe and process meanwhile."""
        got: dict[int, object] = {}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        while len(got) < len(ranks):
            ready = wait(self._conns + list(sentinels))
            for rank, conn in enumerate(self._conns):  # pipes first: a rank's last words precede its exit
                if conn in ready:
                    kind, body = _recv(conn, rank)
                    if kind == "error":
                        text, users_mistake = body
                        self._fail(during, f"rank {rank} failed: {text}", users_mistake)
                    got[rank] = body
            for sentinel, rank in sentinels.items():
                if sentinel in ready and rank not in got:
                    proc = self._procs[rank]
                    proc.join(5)  # its sentinel fired: the exit status is moments away
                    self._fail(during, None if proc.exitcode else f"rank {rank} (pid {proc.pid}) exited")
        return got

    def _fail(self, during: str, error: str | None = None, users_mistake: bool = False) -> None:
        """A rank that died is named first: its peers' errors (a broken collective) are its echo, and
        may arrive before the dead process is reaped, so the ranks get a moment to end. A bad value
        or path found while loading is a ValueError, as it is without tensor parallelism."""
        deadline = time.monotonic() + 1.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        deaths = [f"rank {r} (pid {p.pid}) {_how_it_ended(p.exitcode)}" for r, p in enumerate(self._procs)
                  if p.exitcode not in (None, 0)]
        self._dead = f"tensor-parallel {'; '.join(deaths + ([error] if error else []))} during {during}"
        if error is None and during == "start-up":  # it died before it could say why
            self._dead += (" (its stderr says why; a script must start tensor parallelism under "
                           "`if __name__ == \"__main__\":`, as each spawned rank imports the script)")
        self.shutdown()
        raise (ValueError if users_mistake and during == "start-up" else ExecutorDeadError)(self._dead)


def _how_it_ended(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def _recv(conn: Connection, rank: int) -> tuple[str, object]:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return "error", (f"rank {rank} closed its pipe (the process died)", False)


def _listen(port: int | None) -> dist.TCPStore:
    """The ranks' rendezvous, served from the engine process: a bad port fails here, before any spawn."""
    try:
        return dist.TCPStore(_HOST, port or 0, None, True, wait_for_workers=False)
    except (RuntimeError, OverflowError, ValueError) as exc:
        raise ValueError(f"cannot listen on {_HOST}:{port} for the tensor-parallel ranks ({exc}); "
                         "pass a free --distributed-port, or none to take any free port") from None


def _start_workers(config: EngineConfig, n: int, port: int, procs: list, conns: list[Connection]) -> None:
    """Appends as it goes: whatever started is stopped by the caller's finalizer if a later rank fails."""
    ctx = mp.get_context("spawn")
    threads = config.model_config.num_threads or max(1, (os.cpu_count() or 1) // n)
    rank_config = config.replace(num_threads=threads, use_cuda_graphs=False)  # no collectives in captured graphs
    for rank in range(n):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(rank, n, rank_config, port, theirs), name=f"iterserve-tp{rank}",
                        daemon=True)  # multiprocessing ends daemon children when this process exits
        p.start()
        theirs.close()  # only the worker holds its end: its death is EOF here
        procs.append(p)
        conns.append(ours)


def _stop_workers(procs, conns: list[Connection], store) -> None:
    for conn in conns:
        try:
            conn.send_bytes(b"")  # the polite stop; a rank blocked in a collective is killed below
        except OSError:
            pass
    for p in procs:
        p.join(5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    for conn in conns:
        conn.close()
    # `store`, the rendezvous, is held until here (the finalizer owns it) and closes with it


# ---------------------------------------------------------------- the worker process

def _worker(rank: int, n: int, config: EngineConfig, port: int, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it stops us
    try:
        runner = build_rank(rank, n, config, port)
        conn.send(("ready", {"kv_cache_spec": runner.kv_cache_spec, "max_model_len": runner.max_model_len}))
    except BaseException as exc:  # noqa: BLE001 - reported to the engine, which stops every rank
        _report(conn, exc)
        return
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the engine process is gone
        if not data:
            break
        try:
            result = runner.execute(pickle.loads(data))
        except BaseException as exc:  # noqa: BLE001
            _report(conn, exc)
            break
        if rank == 0:
            conn.send(("result", result))
    dist.destroy_process_group()


def build_rank(rank: int, n: int, config: EngineConfig, port: int) -> ModelRunner:
    """Joins the process group (its rendezvous on 127.0.0.1:port) and loads this rank's shard."""
    mc = config.model_config
    device = pick_device(mc.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        config = config.replace(device=str(device))
    store = dist.TCPStore(_HOST, port, None, False)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=n)
    path = mc.model or default_model_path()
    arch = load_model_arch(path)
    # sliced on the host: one shard each on the device
    full = load_weights(path, arch, storage_dtype(mc.dtype, device, mc.quantization), "cpu")
    shard = {k: v.to(device) for k, v in shard_weights(full, arch, rank, n).items()}
    tp = TensorParallel(rank, n, vocab_size=lm_head(full, arch).shape[0])
    del full
    # the tokenizer: each rank's grammar matchers (structured output) need its vocabulary
    return ModelRunner(config, rank_arch(arch, n), shard, tokenizer=weight_cache.load_tokenizer(path), tp=tp)


def _report(conn: Connection, exc: BaseException) -> None:
    """The whole traceback to this rank's stderr (the engine's log), its last line to the engine."""
    traceback.print_exc()
    try:
        conn.send(("error", (traceback.format_exc().strip().splitlines()[-1], isinstance(exc, (ValueError, OSError)))))
    except OSError:
        pass
