"""AsyncEngine: the Engine's step loop in its own thread, with one async stream per request.

The Engine is not thread-safe, so every engine call (add, abort, step) happens on the engine
thread. asyncio code talks to it through a command queue that is drained at each step boundary;
outputs come back through `loop.call_soon_threadsafe`, once per step for the whole batch (one
event-loop wakeup per step, not one per token). An idle engine thread blocks on an Event: no CPU.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from iterserve.engine import Engine
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams

logger = logging.getLogger("iterserve.server")


class EngineDeadError(RuntimeError):
    """The engine loop has died; no request can be served until the server restarts."""


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-waiting-requests; the client should retry later."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    stream: "RequestStream"
    accepted: asyncio.Future  # resolved on the engine thread: None, or the exception add raised


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True, eq=False)
class RequestStream:
    """The outputs of one request, in order; iterate with `async for`. Closing it early aborts."""

    request_id: str
    engine: "AsyncEngine"
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                items = [await self.queue.get()]
                while not self.queue.empty():  # a consumer that fell behind catches up in one yield
                    items.append(self.queue.get_nowait())
                outputs = [i for i in items if not isinstance(i, BaseException)]
                if outputs:
                    out = _merge(outputs)
                    self.finished = out.finished
                    yield out
                errors = [i for i in items if isinstance(i, BaseException)]
                if errors and not self.finished:
                    self.finished = True
                    raise errors[0]
        finally:
            if not self.finished:  # cancelled (client gone) or closed early: free its KV blocks
                self.finished = True
                self.engine.abort(self.request_id)


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    """Several step outputs of one request as one: the deltas joined, the rest from the latest."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    last.new_text = "".join(o.new_text for o in outputs)
    last.new_token_ids = [t for o in outputs for t in o.new_token_ids]
    return last


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_waiting_requests: int | None = None,
                 log_interval: float = 10.0,
                 on_step: Callable[[Engine, list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = (engine.config.max_waiting_requests
                                     if max_waiting_requests is None else max_waiting_requests)
        self.log_interval = log_interval
        self.on_step = on_step  # called on the engine thread after every step (metrics)
        self.dead: BaseException | None = None
        self._commands: deque[_Add | _Abort] = deque()  # deque append/popleft are thread-safe
        self._wake = threading.Event()
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._status = _StatusLine(log_interval)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="iterserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    # ---- called from asyncio ------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          request_id: str | None = None, priority: int = 0,
                          cache_salt: str | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        Raises ValueError (bad input, prompt too long), QueueFullError or EngineDeadError."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop has died: {self.dead!r}")
        self.start()
        self._loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(request_id, self)
        accepted = self._loop.create_future()
        self._submit(_Add(request_id, prompt, params, priority, cache_salt, time.monotonic(), stream, accepted))
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

    def _submit(self, command: _Add | _Abort) -> None:
        self._commands.append(command)
        self._wake.set()

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._wake.clear()  # before draining: a command queued after the drain re-sets it
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._status.idle()
                    self._wake.wait()
                    continue
                outputs = self.engine.step()
                if self.on_step is not None:  # metrics first: a client that saw its last token sees it counted
                    self.on_step(self.engine, outputs)
                self._deliver(outputs)
                self._status.maybe_log(self.engine, outputs)
        except BaseException as exc:  # noqa: BLE001 - whatever killed the loop, fail every stream
            logger.exception("the engine loop died; failing %d pending requests", len(self._streams))
            self.dead = exc
            self._fail_everything(exc)

    def _drain_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Abort):
                out = self.engine.abort_request(command.request_id)
                stream = self._streams.pop(command.request_id, None)
                if out is not None:
                    log_finished(out)
                    if self.on_step is not None:
                        self.on_step(self.engine, [out])  # counted as aborted
                    if stream is not None:
                        self._post([(stream, out)])
            else:
                self._add(command)

    def _add(self, c: _Add) -> None:
        error: BaseException | None = None
        if c.stream.finished:  # the caller gave up before we got here
            return
        if self.max_waiting_requests is not None and self.engine.scheduler.num_waiting >= self.max_waiting_requests:
            error = QueueFullError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
        else:
            try:
                self.engine.add_request(c.prompt, c.params, c.request_id, c.arrival_time,
                                        priority=c.priority, cache_salt=c.cache_salt)
                self._streams[c.request_id] = c.stream
            except ValueError as exc:
                error = exc
        self._loop.call_soon_threadsafe(_resolve, c.accepted, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                log_finished(out)
            if stream is not None:
                batch.append((stream, out))
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
            if isinstance(c, _Add) and self._loop is not None:
                self._loop.call_soon_threadsafe(_resolve, c.accepted, error)
        self._post(batch)


def log_finished(out: RequestOutput) -> None:
    t = out.times
    ms = lambda x: "-" if x is None else f"{1000 * x:.0f}ms"  # noqa: E731
    logger.info("request %s %s: prompt %d tokens, output %d tokens, TTFT %s, e2e %s",
                out.request_id, out.finish_reason, out.num_prompt_tokens, len(out.token_ids), ms(t.ttft), ms(t.e2e))


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(error)


def _put_all(batch: list) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)


@dataclass(slots=True)
class _StatusLine:
    """One engine status line every `interval` seconds, only while there is work."""

    interval: float
    last: float = 0.0
    tokens: int = 0

    def idle(self) -> None:
        self.last, self.tokens = 0.0, 0

    def maybe_log(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        self.tokens += sum(len(o.new_token_ids) for o in outputs)
        if self.last == 0.0:
            self.last = now
        elif now - self.last >= self.interval:
            s = engine.scheduler
            logger.info("engine: running %d, waiting %d, KV usage %.1f%%, %.1f tokens/s",
                        s.num_running, s.num_waiting, 100 * s.kv_usage, self.tokens / (now - self.last))
            self.last, self.tokens = now, 0
