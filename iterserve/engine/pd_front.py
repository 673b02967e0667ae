"""xPyD as processes: x prefill engines and y decode engines, each spawned in its own process
(pd_worker.py) and joined by KV connectors (docs/disaggregation.md). The front here routes each
request, merges the processes' outputs into one stream per request (the first token from its prefill
engine, the rest from its decode engine) and is an engine core (core.py) the AsyncEngine drives: its
step waits on the workers' outputs, a remote engine core's step.

Routing, with the router's own classes: the front hashes the prompt's blocks once, a
PrefixAffinityRouter picks the prefill engine (a shared prefix lands where it is cached) and a
LeastKVRouter the decode engine (what a decode engine runs out of is blocks). The decode target
travels with the request to its prefill engine, whose connector has one channel per decode engine.
Every engine reports its EngineStats after each step, with its outputs; the routers read those.

Each worker writes its outputs to a pipe of its own, and a step waits on all of them, a wake pipe and
the processes' sentinels at once: a worker killed mid-write leaves nothing held that another needs
(a queue shared by the workers has one write lock, which a killed writer can hold for good).

A decode process that dies ends only the requests routed to it, with an error naming it; the other
engines carry on and the routers stop choosing it. A dead prefill process ends the requests it held.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import threading
import time
from dataclasses import replace

from iterserve.engine.disagg import check_pd_params
from iterserve.engine.pd_worker import check_transport, worker
from iterserve.engine.stats import EngineStats
from iterserve.outputs import RequestOutput
from iterserve.router.policy import LeastKVRouter, PrefixAffinityRouter, ReplicaLoad, prompt_block_hashes
from iterserve.sampling_params import SamplingParams

logger = logging.getLogger("iterserve.pd")


def engine_names(num_prefill: int, num_decode: int) -> tuple[list[str], list[str]]:
    return [f"prefill-{i}" for i in range(num_prefill)], [f"decode-{j}" for j in range(num_decode)]


def merged_stats(prefill: list[EngineStats], decode: list[EngineStats]) -> EngineStats:
    """One engine's view of xPyD: the decode engines' pools and batches, with what the prefill engines
    hold counted as waiting, and their prefix-cache lookups (decode engines look nothing up)."""
    total, free = sum(s.num_kv_blocks for s in decode), sum(s.num_free_kv_blocks for s in decode)
    return replace(
        decode[0], num_running=sum(s.num_running for s in decode),
        num_waiting=sum(s.num_waiting for s in decode) + sum(s.num_waiting + s.num_running for s in prefill),
        num_swapped=sum(s.num_swapped for s in decode), kv_usage=(total - free) / total if total else 0.0,
        num_kv_blocks=total, num_free_kv_blocks=free, num_preemptions=sum(s.num_preemptions for s in decode),
        num_prefix_queries=sum(s.num_prefix_queries for s in prefill),
        num_prefix_hits=sum(s.num_prefix_hits for s in prefill), num_steps=sum(s.num_steps for s in decode),
        max_model_len=min(s.max_model_len for s in prefill + decode),
        num_kv_transfers_recomputed=sum(s.num_kv_transfers_recomputed for s in decode),
        num_queued_tokens=sum(s.num_queued_tokens for s in prefill + decode))


def _error_output(request_id: str, error: str, last: RequestOutput | None = None) -> RequestOutput:
    if last is None:
        return RequestOutput(request_id, [], [], "", [], "", True, "error", None, [], None, error)
    return replace(last, new_token_ids=[], new_text="", finished=True, finish_reason="error", error=error)


class PDRoutes:
    """The front's bookkeeping, apart from the processes: which engines each unfinished request was
    routed to, which one holds it now, and the two routers' counts of what is in flight."""

    def __init__(self) -> None:
        self.prefill_router, self.decode_router = PrefixAffinityRouter(), LeastKVRouter()
        self.stage: dict[str, str] = {}  # unfinished request -> the engine that holds it
        self.route: dict[str, tuple[str, str]] = {}  # unfinished request -> (its prefill, its decode engine)
        self.last: dict[str, RequestOutput] = {}
        self.early: dict[str, list[tuple[str, RequestOutput]]] = {}  # decode outputs that beat the prefill's

    def choose(self, request_id: str, hashes: list[bytes], prefill_loads: dict[str, ReplicaLoad],
               decode_loads: dict[str, ReplicaLoad]) -> tuple[str, str]:
        """(prefill engine, decode engine) among the live ones given, by prefix affinity and least KV usage."""
        prefill = self.prefill_router.choose(hashes, prefill_loads)
        decode = self.decode_router.choose(hashes, decode_loads)
        self.prefill_router.on_routed(prefill, hashes)
        self.decode_router.on_routed(decode, hashes)
        self.stage[request_id], self.route[request_id] = prefill, (prefill, decode)
        return prefill, decode

    def on_output(self, name: str, out: RequestOutput) -> list[RequestOutput]:
        """What engine `name`'s output for a request gives its stream, in order (maybe nothing yet)."""
        rid = out.request_id
        held = self.stage.get(rid)
        if held is None:
            return []  # already ended here (aborted, or an engine of its died)
        prefill, decode = self.route[rid]
        if name == decode and held == prefill:  # its decode engine reported before its prefill engine did
            self.early.setdefault(rid, []).append((name, out))
            return []
        if out.finished:
            self.end(rid)
            return [out]
        self.last[rid] = out
        if name != prefill or held != prefill:
            return [out]
        self.stage[rid] = decode  # its blocks are on their way
        self.prefill_router.on_finished(prefill)
        return [out] + [o for n, early in self.early.pop(rid, []) for o in self.on_output(n, early)]

    def end(self, rid: str) -> tuple[str, str]:
        """Forget a request that ended (finished, failed, aborted): the routers count it no more.
        Returns its (prefill, decode) engines."""
        held = self.stage.pop(rid, None)
        prefill, decode = self.route.pop(rid)
        self.last.pop(rid, None)
        self.early.pop(rid, None)
        if held == prefill:
            self.prefill_router.on_finished(prefill)
        self.decode_router.on_finished(decode)
        return prefill, decode

    def routed_to(self, name: str) -> list[str]:
        """The requests an engine's death ends: a decode engine's are those routed to it, in either
        stage; a prefill engine's, those it still holds (the rest are already on a decode engine)."""
        return [r for r, route in self.route.items() if self.stage[r] == name or route[1] == name]

    def forget(self, name: str) -> None:
        """A dead engine: neither router counts or chooses it again (its requests end with end())."""
        self.prefill_router.forget(name)
        self.decode_router.forget(name)


class PDEngines:
    """The front of x prefill and y decode processes. Not thread-safe: one caller drives it (wake() is
    safe from any thread)."""

    # The model's facts the server reads through its AsyncEngine (an EngineClient, server/engine_client.py);
    # serving_engines sets them from the model's files, and build_app names any that is missing.
    tokenizer: object | None
    vocab_size: int | None
    eos_token_ids: frozenset[int]
    max_model_len: int

    def __init__(self, config_kwargs, transport: str = "shm", num_prefill: int = 1, num_decode: int = 1,
                 port: int = 29561, start_timeout_s: float = 180.0) -> None:
        """config_kwargs: an EngineConfig or its keyword arguments, for every engine."""
        from iterserve.config import EngineConfig
        check_transport(transport, num_prefill, num_decode)
        import torch.multiprocessing as mp
        self.config = config_kwargs if isinstance(config_kwargs, EngineConfig) else EngineConfig(**config_kwargs)
        self.block_size = self.config.cache_config.block_size
        self.prefill_names, self.decode_names = engine_names(num_prefill, num_decode)
        ctx = mp.get_context("spawn")
        self.inbox = {name: ctx.Queue() for name in self.prefill_names + self.decode_names}
        # shm: a queue per (prefill, decode) pair, each with one writer (one shared by the prefill
        # engines would have one write lock, which a prefill process killed mid-send could hold for good)
        channels = {d: {p: ctx.Queue() for p in self.prefill_names} if transport == "shm" else None
                    for d in self.decode_names}
        init_method = f"tcp://127.0.0.1:{port}" if transport == "dist" else None
        self.procs = {}
        self._outboxes: dict[str, multiprocessing.connection.Connection] = {}  # open until it gives EOF
        for name in self.inbox:
            self._outboxes[name], outbox = ctx.Pipe(duplex=False)
            self.procs[name] = ctx.Process(target=worker, name=f"iterserve-{name}", daemon=True, args=(
                name, self.config, transport, channels, init_method, self.inbox[name], outbox))
            self.procs[name].start()
            outbox.close()  # the worker's copy is then the only one: its death is an EOF here
        self._sentinels = {proc.sentinel: name for name, proc in self.procs.items()}  # those not yet ended
        self._wake_reader, self._wake_writer = ctx.Pipe(duplex=False)
        self._wake_lock, self._woken = threading.Lock(), False
        self.routes = PDRoutes()
        self.loads: dict[str, ReplicaLoad] = {}  # each engine's latest report, as the routers read it
        self.dead: set[str] = set()  # engines found dead (their requests ended)
        self.tokenizer = None
        self._stats: dict[str, EngineStats] = {}
        self._ready: set[str] = set()
        self._fresh: set[str] = set()  # engines whose report came in answer to fetch_stats
        self._pending: list[RequestOutput] = []  # drained while waiting for stats, not yet handed out
        deadline = time.monotonic() + start_timeout_s
        while self._ready != set(self.procs):
            ended = [n for n in self.procs if n not in self._outboxes and n not in self._ready]
            if ended or time.monotonic() > deadline:
                self.close()
                if ended:
                    raise RuntimeError(f"the {ended[0]} engine exited before it was ready")
                raise RuntimeError(f"the prefill/decode processes did not start within {start_timeout_s:.0f}s")
            self._drain(0.1)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str = "",
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None) -> str:
        params = params or SamplingParams()
        params.validate()
        check_pd_params(params)
        if not request_id or request_id in self.routes.stage:
            raise ValueError(f"request id {request_id!r} is empty or already in use")
        token_ids = self.encode(prompt)
        hashes = prompt_block_hashes(token_ids, self.block_size, cache_salt)
        prefill, decode = self.routes.choose(request_id, hashes, self._live(self.prefill_names),
                                             self._live(self.decode_names))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.inbox[prefill].put(("add", request_id, token_ids, params, arrival, priority, cache_salt, decode))
        return request_id

    def _live(self, names: list[str]) -> dict[str, ReplicaLoad]:
        """The routers' view: the latest report of each engine still alive (a dead one is never chosen)."""
        live = {n: self.loads[n] for n in names if n not in self.dead and self.procs[n].is_alive()}
        if not live:
            raise RuntimeError(f"no live {names[0].split('-')[0]} engine: {', '.join(names)} all died")
        return live

    def abort(self, request_id: str) -> None:
        """Forgotten here at once; both its engines are told, since its blocks may be between them."""
        if request_id not in self.routes.route:
            return
        for name in self.routes.end(request_id):
            if self.procs[name].is_alive():
                self.inbox[name].put(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self.routes.stage)

    def get_outputs(self, timeout: float | None = 0.1) -> list[RequestOutput]:
        """Outputs since the last call (waiting up to `timeout` for the first message; None: no limit)."""
        outputs = self._drain(timeout)
        return outputs + self._check_deaths()

    # ---- the engine core (core.py): the AsyncEngine and the HTTP server drive xPyD as one engine ---
    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """What the engines sent since the last step, waiting up to `timeout` seconds (None: no limit) for
        the first of it; wake() and an engine's death end the wait at once."""
        return self.get_outputs(timeout)

    def wake(self) -> None:
        """End the wait of a step now or the next one (any thread): the driver has work of its own."""
        with self._wake_lock:
            if not self._woken:  # one pending wake is enough, and the pipe never fills
                self._woken = True
                self._wake_writer.send_bytes(b"")

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Asynchronous: the aborted output comes back from the engine that holds the request."""
        self.abort(request_id)
        return []

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids, once, here: the routers hash them and the prefill engine takes them as they are."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return list(self._tokenizer().encode(prompt))
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        return token_ids

    def _tokenizer(self):
        if self.tokenizer is None:
            from iterserve.model import weight_cache
            from iterserve.model.loader import default_model_path
            self.tokenizer = weight_cache.load_tokenizer(self.config.model_config.model or default_model_path())
        return self.tokenizer

    @property
    def stats(self) -> EngineStats:
        """The live engines' latest reports merged (merged_stats); every engine reports when ready."""
        def reports(names):
            return [self._stats[n] for n in names if n not in self.dead] or [self._stats[n] for n in names]
        return merged_stats(reports(self.prefill_names), reports(self.decode_names))

    def stats_of(self, name: str) -> EngineStats:
        return self._stats.get(name) or self.fetch_stats(name)

    def shutdown(self) -> None:
        self.close()

    # ---- processes ------------------------------------------------------------------------------
    def fetch_stats(self, name: str, timeout: float = 30.0) -> EngineStats:
        """A fresh report from one engine (e.g. prefill-0, decode-1)."""
        self._fresh.discard(name)
        self.inbox[name].put(("stats",))
        deadline = time.monotonic() + timeout
        while name not in self._fresh:
            if time.monotonic() > deadline or name not in self._outboxes or not self.procs[name].is_alive():
                raise RuntimeError(f"the {name} engine did not report its stats")
            self._pending.extend(self._drain(0.05))
        return self._stats[name]

    def kill(self, name: str) -> None:
        """Kill one engine's process at once (tests of what survives a death)."""
        self.procs[name].kill()
        self.procs[name].join(10)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every engine, reading what they still send meanwhile (a worker blocks on a full pipe)."""
        for name, proc in self.procs.items():
            if proc.is_alive():
                self.inbox[name].put(("stop",))
        deadline = time.monotonic() + timeout
        while self._outboxes and (left := deadline - time.monotonic()) > 0:
            for conn in multiprocessing.connection.wait(list(self._outboxes.values()), left):
                self._receive(conn)
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
        for conn in self._outboxes.values():
            conn.close()
        self._outboxes.clear()

    def _receive(self, conn) -> tuple | None:
        """One worker's next message; None once its pipe has ended (the worker exited or died)."""
        try:
            return conn.recv()
        except (EOFError, OSError):  # a worker killed mid-message leaves a truncated one, then EOF
            name = next(n for n, c in self._outboxes.items() if c is conn)
            del self._outboxes[name]
            conn.close()
            return None

    def _drain(self, timeout: float | None) -> list[RequestOutput]:
        """Every message waiting from the workers, after waiting up to `timeout` (None: no limit) for the
        first; a wake or a worker's end also ends the wait."""
        outputs, self._pending = self._pending, []
        wait_s = 0.0 if outputs else timeout
        while True:
            waited = [*self._outboxes.values(), self._wake_reader, *self._sentinels]
            ready = multiprocessing.connection.wait(waited, wait_s)
            if not ready:
                return outputs
            wait_s = 0.0  # then only what is already there
            for r in ready:
                if r is self._wake_reader:
                    with self._wake_lock:
                        self._wake_reader.recv_bytes()
                        self._woken = False
                elif r in self._sentinels:  # its outbox ends too, once what it sent has been read
                    del self._sentinels[r]
                elif (message := self._receive(r)) is not None:
                    outputs.extend(self._handle(*message))

    def _handle(self, kind: str, name: str, payload) -> list[RequestOutput]:
        """One worker message: the outputs it gives the streams, and the front's view of that engine."""
        outputs = []
        if kind == "out":
            batch, stats = payload
            self._report(name, stats)
            for out in batch:
                outputs.extend(self.routes.on_output(name, out))
        elif kind == "rejected":
            request_id, error = payload
            if request_id in self.routes.route:
                self.routes.end(request_id)
                outputs.append(_error_output(request_id, error))
        elif kind in ("stats", "ready"):
            self._report(name, payload)
            (self._fresh if kind == "stats" else self._ready).add(name)
        elif kind == "failed":
            self.close()
            raise RuntimeError(f"the {name} engine failed to start: {payload}")
        return outputs

    def _report(self, name: str, stats: EngineStats) -> None:
        self._stats[name] = stats
        self.loads[name] = ReplicaLoad(stats.num_running, stats.num_queued, stats.kv_usage)

    def _check_deaths(self) -> list[RequestOutput]:
        """An engine found dead (its outbox ended, or its process): the requests routed to it end with an
        error naming it, nothing else."""
        failed = []
        for name, proc in self.procs.items():
            if name in self.dead or (name in self._outboxes and proc.is_alive()):
                continue
            proc.join(5.0)  # its outbox ends as it exits: its exit code comes a moment later
            self.dead.add(name)
            logger.warning("the %s engine died (exit code %s)", name, proc.exitcode)
            self.routes.forget(name)
            if name in self.decode_names:
                for prefill in self.prefill_names:  # their hand-offs to it fail at once, freeing the blocks
                    if prefill not in self.dead:
                        self.inbox[prefill].put(("dead", name))
            error = f"the {name} engine died (exit code {proc.exitcode}) while generating this request"
            for rid in self.routes.routed_to(name):
                last = self.routes.last.get(rid)
                self.abort(rid)  # its other engine drops it: blocks still being prefilled, or on their way
                failed.append(_error_output(rid, error, last))
        return failed


def serving_engines(config, transport: str = "shm", num_prefill: int = 1, num_decode: int = 1) -> PDEngines:
    """xPyD with what the HTTP server reads from an engine: the tokenizer, vocabulary, EOS ids, context
    (the EngineClient's model facts, server/engine_client.py)."""
    from iterserve.executor.model_runner import eos_token_ids
    from iterserve.model import weight_cache
    from iterserve.model.loader import default_model_path
    pd = PDEngines(config, transport, num_prefill, num_decode)
    arch = weight_cache.load_arch(config.model_config.model or default_model_path())
    pd.vocab_size = arch.vocab_size
    pd.eos_token_ids = eos_token_ids(arch, pd._tokenizer())
    pd.max_model_len = pd.stats.max_model_len
    return pd
