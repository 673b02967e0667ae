"""RequestStream: one request's outputs as an async iterator, fed by the engine thread."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

from iterserve.outputs import RequestOutput

if TYPE_CHECKING:
    from iterserve.server.async_engine import AsyncEngine


@dataclass(slots=True, eq=False)
class RequestStream:
    """The outputs of one request, in order; iterate with `async for`. Closing it early aborts.

    A request with n > 1 sequences yields the outputs of all of them, interleaved; each carries
    its sequence's `index`. The stream ends when the engine thread says the request is done."""

    request_id: str
    engine: "AsyncEngine"
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    unfinished: int = 1  # engine thread only: sequences still running
    deadline: float | None = None  # engine thread only: monotonic time of --request-timeout

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                items = [await self.queue.get()]
                while not self.queue.empty():  # a consumer that fell behind catches up in one yield
                    items.append(self.queue.get_nowait())
                errors = [i for i in items if isinstance(i, BaseException)]
                if any(i is _END for i in items) and not errors:
                    self.finished = True  # before the last yield: a consumer may stop after it
                for out in _merge([i for i in items if isinstance(i, RequestOutput)]):
                    yield out
                if errors and not self.finished:
                    self.finished = True
                    raise errors[0]
        finally:
            if not self.finished:  # cancelled (client gone) or closed early: free its KV blocks
                self.finished = True
                self.engine.abort(self.request_id)


_END = "end"  # queued after a request's last output


def _merge(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Several step outputs as one per sequence: the deltas joined, the rest from the latest."""
    if len(outputs) <= 1:
        return outputs
    latest: dict[int, RequestOutput] = {}
    for out in outputs:
        prev = latest.get(out.index)
        if prev is not None:
            out.new_text = prev.new_text + out.new_text
            out.new_token_ids = prev.new_token_ids + out.new_token_ids
        latest[out.index] = out
    return list(latest.values())
