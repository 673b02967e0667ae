"""AsyncEngine: an engine core's step loop in its own thread, with one async stream per request.

The engine core (engine/core.py: an Engine, or the P/D front) is not thread-safe, so every engine
call (add, abort, step) happens on the engine thread. asyncio code talks to it through a command
queue that is drained at each step boundary; outputs come back through `loop.call_soon_threadsafe`,
once per step for the whole batch (one event-loop wakeup per step, not one per token). An idle
engine thread blocks on an Event: no CPU; a remote core's step blocks on its workers' outputs until
a command wakes it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from iterserve.engine.core import EngineCore, LocalEngineCore, RemoteEngineCore, check_engine_core
from iterserve.engine.stats import EngineStats
from iterserve.executor.base import PoolingExecutor
from iterserve.heap import trim_heap
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.server.request_stream import _END, RequestStream
from iterserve.server.status_log import _StatusLine, log_finished

logger = logging.getLogger("iterserve.server")


class EngineDeadError(RuntimeError):
    """The engine loop has died; no request can be served until the server restarts."""
    status, type = 503, "engine_dead"


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-waiting-requests; the client should retry later."""
    status, type = 503, "server_overloaded"


class QueuedTokensError(QueueFullError):
    """The waiting requests' tokens would pass --max-num-queued-tokens; the client should retry later."""
    status, type = 429, "rate_limit_exceeded"


class RequestTimeoutError(RuntimeError):
    """The request ran past --request-timeout; it was aborted and its KV blocks freed."""
    status, type = 504, "timeout"


class ShuttingDownError(RuntimeError):
    """The server is draining before it exits: no new requests; the client should retry elsewhere."""
    status, type = 503, "server_shutting_down"


class ShutdownTimeoutError(RequestTimeoutError):
    """The request was still running when --shutdown-timeout ran out; it was aborted."""
    status, type = 503, "server_shutting_down"


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    n: int
    stream: "RequestStream"
    accepted: asyncio.Future  # resolved on the engine thread: None, or the exception add raised


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[EngineCore], None]  # an engine call other than add/abort (LoRA load/unload)
    accepted: asyncio.Future  # resolved on the engine thread: None, or the exception fn raised


class AsyncEngine:
    def __init__(self, engine: EngineCore | Callable[[], EngineCore], *, max_waiting_requests: int | None = None,
                 request_timeout: float | None = None, log_interval: float = 10.0,
                 max_num_queued_tokens: int | None = None,
                 on_step: Callable[[EngineStats, list[RequestOutput]], None] | None = None,
                 wait: bool = True) -> None:
        """`engine` is an engine core, or a function that builds one; the server passes the function, so
        the model loads on the engine thread and it is the only thread that ever runs torch ops. (A second
        thread running ops gets a second OpenMP pool; on 2 cores its steps measured ~25% slower.)
        wait=False returns while it builds (the server imports its HTTP stack meanwhile): call
        wait_built() before anything else. The core is checked against the EngineCore contract once built."""
        self.request_timeout = request_timeout  # seconds from arrival; None: no limit
        self.log_interval = log_interval
        self.on_step = on_step  # called on the engine thread after every step (metrics)
        self.dead: BaseException | None = None
        self.draining = False  # set by drain(): no new requests
        self._drain_deadline: float | None = None  # monotonic time when the rest are aborted
        self._commands: deque[_Add | _Abort | _Call] = deque()  # deque append/popleft are thread-safe
        self._wake = threading.Event()
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._deadlines: deque[RequestStream] = deque()  # engine thread only; arrival order = deadline order
        self._thread: threading.Thread | None = None
        self._status = _StatusLine(log_interval)
        self._max_waiting = max_waiting_requests
        self.max_num_queued_tokens = max_num_queued_tokens  # None: no limit
        self._built = threading.Event()
        self._build_failed: list[BaseException] = []
        self._remote = False  # the core's step waits on other processes (RemoteEngineCore): wake it for commands
        if callable(engine):
            self._build_on_engine_thread(engine)
        else:
            self._take(engine)
            self._built.set()
        if wait:
            self.wait_built()

    def wait_built(self) -> None:
        """Until the engine is built; its exception if building failed."""
        self._built.wait()
        if self._build_failed:
            raise self._build_failed[0]
        # A flood gets 503s, not unbounded memory: the queue is always bounded.
        self.max_waiting_requests = self._max_waiting or self.engine.config.scheduler_config.max_waiting_requests

    def _take(self, engine: EngineCore) -> None:
        check_engine_core(engine)
        self.engine = engine
        self._remote = isinstance(engine, RemoteEngineCore)

    def _build_on_engine_thread(self, build: Callable[[], EngineCore]) -> None:
        failed, ready = self._build_failed, self._built

        def run() -> None:
            try:
                self._take(build())
            except BaseException as exc:  # noqa: BLE001 - raised in the caller below
                failed.append(exc)
                return
            finally:
                ready.set()
            self._run()

        self._thread = threading.Thread(target=run, name="iterserve-engine", daemon=True)
        self._thread.start()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="iterserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()  # an executor's worker processes (tensor parallel) end with the engine

    def thread_cpu_s(self) -> float:
        """CPU seconds the engine thread has used (0 before it starts, or where the OS cannot say): beside
        the wall time of its steps, how much of a step the thread spent off the CPU."""
        thread = self._thread
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (AttributeError, OSError, TypeError):
            return 0.0

    def drain(self, timeout: float) -> None:
        """Graceful shutdown: refuse new requests (503) from now on; the accepted ones run for up to
        `timeout` seconds, then end with a ShutdownTimeoutError (an SSE error event). Any thread."""
        self.draining = True
        self._drain_deadline = time.monotonic() + timeout
        self._notify()

    @property
    def num_open_requests(self) -> int:
        """Requests the engine thread still delivers to (a leak check: 0 when idle)."""
        return len(self._streams)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    # ---- the model, as the app sees it (server/engine_client.py); constant, so safe off the engine thread
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int | None:
        return self.engine.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    @property
    def supports_pooling(self) -> bool:
        """Whether its executor pools hidden states (SamplingParams.pooling; the ModelRunner does)."""
        return isinstance(self.engine, LocalEngineCore) and isinstance(self.engine.executor, PoolingExecutor)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """The engine's own prompt check (pure: reads only the tokenizer and the vocabulary size)."""
        return self.engine.encode(prompt)

    # ---- called from asyncio ------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          request_id: str | None = None, priority: int = 0,
                          cache_salt: str | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        Raises ValueError (bad input, prompt too long), QueueFullError or EngineDeadError."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop has died: {self.dead!r}")
        if self.draining:
            raise ShuttingDownError("the server is shutting down and takes no new requests")
        self.start()
        self._loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(request_id, self)
        accepted = self._loop.create_future()
        self._submit(_Add(request_id, prompt, params, priority, cache_salt, time.monotonic(), params.n,
                          stream, accepted))
        if self.dead is not None and not accepted.done():  # died after our check: no one will answer
            accepted.set_result(EngineDeadError(f"the engine loop has died: {self.dead!r}"))
        try:
            error = await accepted
        except asyncio.CancelledError:
            stream.finished = True  # the engine may have accepted it meanwhile: abort it too
            self.abort(request_id)
            raise
        if error is not None:
            raise error
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(prompt, params, **kwargs)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Safe from any thread; the request leaves at the next step boundary."""
        self._submit(_Abort(request_id))

    async def call(self, fn: Callable[[EngineCore], None]) -> None:
        """fn(engine) on the engine thread between steps, in order with the adds and aborts queued before it;
        raises what it raised (or EngineDeadError)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop has died: {self.dead!r}")
        self.start()
        self._loop = asyncio.get_running_loop()
        accepted = self._loop.create_future()
        self._submit(_Call(fn, accepted))
        error = await accepted
        if error is not None:
            raise error

    def _submit(self, command: _Add | _Abort | _Call) -> None:
        self._commands.append(command)
        self._notify()

    def _notify(self) -> None:
        """Wake the engine thread, idle or waiting in a remote core's step."""
        self._wake.set()
        if self._remote:
            self.engine.wake()

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            busy = False
            while not self._stop:
                self._wake.clear()  # before draining: a command queued after the drain re-sets it
                self._drain_commands()
                self._expire()
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    self._abort_all(ShutdownTimeoutError("the server shut down before this request finished "
                                                         "(--shutdown-timeout)"))
                if not self.engine.has_unfinished():
                    self._status.idle()
                    if busy:  # a busy spell's step activations (up to max_num_batched_tokens rows per layer)
                        trim_heap()  # are freed to the heap, which keeps them (docs/operations.md)
                        busy = False
                    self._wake.wait()
                    continue
                busy = True
                outputs = self.engine.step(self._until_deadline()) if self._remote else self.engine.step()
                stats = self.engine.stats
                if self.on_step is not None:  # metrics first: a client that saw its last token sees it counted
                    self.on_step(stats, outputs)
                self._deliver(outputs)
                self._status.maybe_log(stats, outputs)
        except BaseException as exc:  # noqa: BLE001 - whatever killed the loop, fail every stream
            logger.exception("the engine loop died; failing %d pending requests", len(self._streams))
            self.dead = exc
            self._fail_everything(exc)

    def _until_deadline(self) -> float | None:
        """Seconds to the next request timeout or the drain's end (None: none): how long a remote core's
        step may wait for its outputs before this thread has work of its own."""
        deadlines = [self._deadlines[0].deadline] if self._deadlines else []
        if self._drain_deadline is not None:
            deadlines.append(self._drain_deadline)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _drain_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Abort):
                self._abort(command.request_id)
            elif isinstance(command, _Call):
                self._call(command)
            else:
                self._add(command)

    def _call(self, c: _Call) -> None:
        """Whatever fn raises goes back to its caller: a failed adapter load never ends the step loop."""
        error: BaseException | None = None
        try:
            c.fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, who answers 400 or 500
            if not isinstance(exc, ValueError):
                logger.exception("an engine call failed")
            error = exc
        self._loop.call_soon_threadsafe(_resolve, c.accepted, error)

    def _abort(self, request_id: str, error: BaseException | None = None) -> None:
        stream = self._streams.pop(request_id, None)
        outs = self.engine.abort_request(request_id)
        for out in outs:
            log_finished(out)
        if outs and self.on_step is not None:
            self.on_step(self.engine.stats, outs)  # counted as aborted
        if stream is not None:
            self._post([(stream, error)] if error else [(stream, out) for out in outs] + [(stream, _END)])

    def _add(self, c: _Add) -> None:
        error: BaseException | None = None
        if c.stream.finished:  # the caller gave up before we got here
            return
        if self.draining:  # queued just before drain(): refused like any later one
            self._loop.call_soon_threadsafe(_resolve, c.accepted,
                                            ShuttingDownError("the server is shutting down and takes no new requests"))
            return
        error = self._refusal(c)
        if error is None:
            try:
                self.engine.add_request(c.prompt, c.params, c.request_id, c.arrival_time,
                                        priority=c.priority, cache_salt=c.cache_salt)
                c.stream.unfinished = c.n
                self._streams[c.request_id] = c.stream
                if self.request_timeout is not None:
                    c.stream.deadline = c.arrival_time + self.request_timeout
                    self._deadlines.append(c.stream)
            except ValueError as exc:
                error = exc
        self._loop.call_soon_threadsafe(_resolve, c.accepted, error)

    def _refusal(self, c: _Add) -> QueueFullError | None:
        """Admission by the queue's length and its tokens. A request that finds no tokens waiting is
        admitted whatever its size, so a long prompt is never refused for good."""
        stats = self.engine.stats
        if stats.num_queued >= self.max_waiting_requests:
            return QueueFullError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
        limit, queued = self.max_num_queued_tokens, stats.num_queued_tokens
        if limit is not None and queued:
            new = c.n * (len(c.prompt) if isinstance(c.prompt, list) else len(self.engine.encode(c.prompt)))
            if queued + new > limit:
                return QueuedTokensError(f"the waiting requests hold {queued} prompt tokens; {new} more would pass "
                                         f"the server's limit of {limit} (--max-num-queued-tokens)")
        return None

    def _abort_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._abort(request_id, error)

    def _expire(self) -> None:
        """Abort the requests past --request-timeout; their streams end with RequestTimeoutError."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0].deadline <= now:
            stream = self._deadlines.popleft()
            if self._streams.get(stream.request_id) is stream:
                self._abort(stream.request_id, RequestTimeoutError(
                    f"the request ran past the server's {self.request_timeout:g}s timeout and was aborted"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            request_id = out.parent_id or out.request_id
            stream = self._streams.get(request_id)
            if out.finished:
                log_finished(out)
            if stream is None:
                continue
            batch.append((stream, out))
            if out.finish_reason == "error":  # one failed sequence fails the request: stop its siblings
                self._post(batch)
                batch = []
                self._abort(request_id)
            elif out.finished:
                stream.unfinished -= 1
                if stream.unfinished == 0:
                    del self._streams[request_id]
                    batch.append((stream, _END))
        if batch:
            self._post(batch)

    def _post(self, batch: list) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _fail_everything(self, exc: BaseException) -> None:
        error = EngineDeadError(f"the engine loop has died: {exc!r}")
        batch = [(s, error) for s in self._streams.values()]
        self._streams.clear()
        while self._commands:
            c = self._commands.popleft()
            if isinstance(c, (_Add, _Call)) and self._loop is not None:
                self._loop.call_soon_threadsafe(_resolve, c.accepted, error)
        self._post(batch)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(error)


def _put_all(batch: list) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)
