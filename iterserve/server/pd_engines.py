"""1P1D as two processes: a prefill engine and a decode engine, each spawned in its own process and
joined by a KV connector (docs/disaggregation.md). The front object here sends each request to the
prefill process and merges both processes' outputs into one stream per request: the first token from
the prefill side, the rest from the decode side. A decode process that dies ends the requests it held
with an error naming it; the prefill process carries on.
"""
from __future__ import annotations

import logging
import queue as queue_module
import time
from dataclasses import replace

from iterserve.engine.disagg import check_pd_params
from iterserve.engine.stats import EngineStats
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams

logger = logging.getLogger("iterserve.pd")
TRANSPORTS = ("shm", "dist")
ROLES = ("prefill", "decode")


def _make_connector(transport: str, role: str, shm_queue, init_method: str | None):
    if transport == "shm":
        from iterserve.kv_transfer.shm_connector import ShmConnector
        return ShmConnector(shm_queue)
    from iterserve.kv_transfer.dist_connector import DECODE_RANK, PREFILL_RANK, DistConnector
    import torch
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return DistConnector(PREFILL_RANK if role == "prefill" else DECODE_RANK, init_method, backend)


def _worker(role: str, config_kwargs: dict, transport: str, shm_queue, init_method: str | None,
            inbox, outbox) -> None:
    """One side's process: take commands, step the engine, report outputs. Ends on ("stop",)."""
    from iterserve.config import EngineConfig
    from iterserve.engine.disagg import DecodeEngine, PrefillEngine
    from iterserve.engine.engine import Engine
    try:
        engine = Engine(config_kwargs if isinstance(config_kwargs, EngineConfig) else EngineConfig(**config_kwargs))
        connector = _make_connector(transport, role, shm_queue, init_method)
        side = PrefillEngine(engine, connector) if role == "prefill" else DecodeEngine(engine, connector)
    except Exception as exc:
        outbox.put(("failed", role, f"{type(exc).__name__}: {exc}"))
        return
    outbox.put(("ready", role, None))
    while True:
        busy = side.has_unfinished()
        if role == "decode" and not busy:
            side.poll(timeout=0.005)
            busy = side.has_unfinished()
        try:
            while True:
                cmd = inbox.get(timeout=0.02) if not busy else inbox.get_nowait()
                busy = True  # drain the rest without waiting
                if cmd[0] == "stop":
                    connector.close()
                    outbox.put(("stopped", role, None))
                    return
                _command(side, cmd, outbox, role)
        except queue_module.Empty:
            pass
        if side.has_unfinished():
            outputs = side.step()
            if outputs:
                outbox.put(("out", role, (outputs, side.engine.stats)))


def _command(side, cmd: tuple, outbox, role: str) -> None:
    if cmd[0] == "add":
        _, request_id, prompt, params, arrival, priority, cache_salt = cmd
        try:
            side.add_request(prompt, params, request_id, arrival_time=arrival, priority=priority, cache_salt=cache_salt)
        except ValueError as exc:
            outbox.put(("rejected", role, (request_id, str(exc))))
    elif cmd[0] == "abort":
        outputs = side.abort_request(cmd[1])
        if outputs:
            outbox.put(("out", role, (outputs, side.engine.stats)))
    elif cmd[0] == "stats":
        outbox.put(("stats", role, side.engine.stats))


class PDEngines:
    """The front of one prefill and one decode process. Not thread-safe: one caller drives it."""

    # The model's facts the server reads through its AsyncEngine (an EngineClient, server/engine_client.py);
    # serving_engines sets them from the model's files, and build_app names any that is missing.
    tokenizer: object | None
    vocab_size: int | None
    eos_token_ids: frozenset[int]
    max_model_len: int

    def __init__(self, config_kwargs, transport: str = "shm", port: int = 29561,
                 start_timeout_s: float = 180.0) -> None:
        """config_kwargs: an EngineConfig or its keyword arguments, for both engines."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inbox = {role: ctx.Queue() for role in ROLES}
        shm_queue = ctx.Queue() if transport == "shm" else None
        init_method = f"tcp://127.0.0.1:{port}" if transport == "dist" else None
        self.procs = {}
        for role in ROLES:
            self.procs[role] = ctx.Process(target=_worker, name=f"iterserve-{role}", daemon=True, args=(
                role, config_kwargs, transport, shm_queue, init_method, self.inbox[role], self.outbox))
            self.procs[role].start()
        self.stage: dict[str, str] = {}  # unfinished request -> the role that holds it
        self.last: dict[str, RequestOutput] = {}
        self._stats: dict[str, EngineStats] = {}
        self._ready: set[str] = set()
        self._pending: list[RequestOutput] = []  # drained while waiting for stats, not yet handed out
        deadline = time.monotonic() + start_timeout_s
        while self._ready != set(ROLES):
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the prefill/decode processes did not start within {start_timeout_s:.0f}s")
            self._drain(0.1)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str = "",
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None) -> str:
        params = params or SamplingParams()
        params.validate()
        check_pd_params(params)
        if not request_id or request_id in self.stage:
            raise ValueError(f"request id {request_id!r} is empty or already in use")
        self.stage[request_id] = "prefill"
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.inbox["prefill"].put(("add", request_id, prompt, params, arrival, priority, cache_salt))
        return request_id

    def abort(self, request_id: str) -> None:
        """Forgotten here at once; both sides are told, since its blocks may be between them."""
        if self.stage.pop(request_id, None) is None:
            return
        self.last.pop(request_id, None)
        for role in ROLES:
            if self.procs[role].is_alive():
                self.inbox[role].put(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self.stage)

    def get_outputs(self, timeout: float = 0.1) -> list[RequestOutput]:
        """Outputs since the last call (waiting up to `timeout` for the first)."""
        outputs = self._drain(timeout)
        return outputs + self._fail_orphans()

    # ---- the Engine's surface: the AsyncEngine and the HTTP server drive 1P1D as one engine -------
    def step(self) -> list[RequestOutput]:
        return self.get_outputs(0.01)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Asynchronous: the aborted output comes back from the engine that holds the request."""
        self.abort(request_id)
        return []

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    @property
    def stats(self) -> EngineStats:
        """The decode engine's latest report, with the prefill engine's queue as the waiting requests."""
        p, d = self._stats.get("prefill"), self._stats.get("decode")
        if p is None or d is None:
            return self.stats_of("decode")
        return replace(d, num_waiting=d.num_waiting + p.num_waiting + p.num_running,
                       num_prefix_queries=p.num_prefix_queries, num_prefix_hits=p.num_prefix_hits)

    def stats_of(self, role: str) -> EngineStats:
        return self._stats.get(role) or self.fetch_stats(role)

    def shutdown(self) -> None:
        self.close()

    # ---- processes ------------------------------------------------------------------------------
    def fetch_stats(self, role: str, timeout: float = 30.0) -> EngineStats:
        self._stats.pop(role, None)
        self.inbox[role].put(("stats",))
        deadline = time.monotonic() + timeout
        while role not in self._stats:
            if time.monotonic() > deadline or not self.procs[role].is_alive():
                raise RuntimeError(f"the {role} engine did not report its stats")
            self._pending.extend(self._drain(0.05))
        return self._stats[role]

    def kill(self, role: str) -> None:
        """Kill one side's process at once (tests of what survives a death)."""
        self.procs[role].kill()
        self.procs[role].join(10)

    def close(self, timeout: float = 10.0) -> None:
        for role, proc in self.procs.items():
            if proc.is_alive():
                self.inbox[role].put(("stop",))
        for proc in self.procs.values():
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)

    def _drain(self, timeout: float) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        wait = timeout
        while True:
            try:
                kind, role, payload = self.outbox.get(timeout=wait) if wait > 0 else self.outbox.get_nowait()
            except queue_module.Empty:
                return outputs
            wait = 0.0
            if kind == "out":
                batch, self._stats[role] = payload
                outputs.extend(o for out in batch if (o := self._route(role, out)) is not None)
            elif kind == "rejected":
                request_id, error = payload
                self.stage.pop(request_id, None)
                outputs.append(RequestOutput(request_id, [], [], "", [], "", True, "error", None, [], None, error))
            elif kind == "stats":
                self._stats[role] = payload
            elif kind == "ready":
                self._ready.add(role)
            elif kind == "failed":
                self.close()
                raise RuntimeError(f"the {role} engine failed to start: {payload}")

    def _route(self, role: str, out: RequestOutput) -> RequestOutput | None:
        rid = out.request_id
        if rid not in self.stage:
            return None  # already ended here (its decode process died)
        if role == "prefill" and not out.finished:
            self.stage[rid] = "decode"  # its blocks are on their way
        if out.finished:
            self.stage.pop(rid, None)
            self.last.pop(rid, None)
        else:
            self.last[rid] = out
        return out

    def _fail_orphans(self) -> list[RequestOutput]:
        """Requests held by a dead process end with an error naming it."""
        failed = []
        for role, proc in self.procs.items():
            if proc.is_alive():
                continue
            for rid in [r for r, held in self.stage.items() if held == role]:
                del self.stage[rid]
                last = self.last.pop(rid, None)
                error = f"the {role} engine died (exit code {proc.exitcode}) while generating this request"
                if last is None:
                    failed.append(RequestOutput(rid, [], [], "", [], "", True, "error", None, [], None, error))
                else:
                    failed.append(replace(last, new_token_ids=[], new_text="", finished=True,
                                          finish_reason="error", error=error))
        return failed


def serving_engines(config, transport: str = "shm") -> PDEngines:
    """1P1D with what the HTTP server reads from an engine: the tokenizer, vocabulary, EOS ids, context."""
    from iterserve.executor.model_runner import eos_token_ids
    from iterserve.model.loader import default_model_path, load_model_arch, load_tokenizer
    pd = PDEngines(config, transport)
    path = config.model_config.model or default_model_path()
    arch = load_model_arch(path)
    pd.config, pd.tokenizer, pd.vocab_size = config, load_tokenizer(path), arch.vocab_size
    pd.eos_token_ids = eos_token_ids(arch, pd.tokenizer)
    pd.max_model_len = min(pd.fetch_stats(role).max_model_len for role in ROLES)
    return pd
