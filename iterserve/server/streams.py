"""From engine streams to HTTP replies: a non-streamed reply collected (aborted if the client goes
first), or an SSE stream that aborts its request however it ends; usage and logprobs bookkeeping."""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from iterserve.outputs import RequestOutput
from iterserve.server.async_engine import EngineDeadError, RequestTimeoutError
from iterserve.server.request_stream import RequestStream
from iterserve.server.token_text import TokenText
from iterserve.server.errors import ApiError
from iterserve.server.protocol import ErrorResponse, Usage

# What can end a stream early besides the request's own outputs; each carries its HTTP status and type.
_STREAM_ERRORS = (EngineDeadError, RequestTimeoutError)


def _new_id() -> str:
    return uuid.uuid4().hex[:24]


def _usage(outs: list[RequestOutput]) -> Usage:
    """The prompt once, however many choices share it; every choice's completion tokens."""
    return Usage.of(outs[0].num_prompt_tokens, sum(len(o.token_ids) for o in outs))


def _check_error(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise ApiError(500, f"generation failed: {out.error}", "internal_error")


async def _collect(streams: list[RequestStream], request: Request) -> list[list[RequestOutput]]:
    """Per stream, the final output of each sequence (by index); all aborted if the client goes first."""
    async def last(stream: RequestStream) -> list[RequestOutput]:
        final: dict[int, RequestOutput] = {}
        async for out in stream:
            _check_error(out)
            final[out.index] = out
        return [final[k] for k in sorted(final)]

    task = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()  # the stream's finally aborts the request
        for stream in streams:
            stream.engine.abort(stream.request_id)
        raise ApiError(499, "client disconnected", "client_closed_request")
    try:
        return task.result()
    except _STREAM_ERRORS as e:
        raise ApiError(e.status, str(e), e.type) from e


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
    """An SSE stream that aborts its request however the response ends (disconnect included:
    Starlette then cancels the send loop and never closes our generator)."""

    def __init__(self, streams: list[RequestStream], chunks: AsyncIterator[str]) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.streams:
                if not stream.finished:
                    stream.finished = True
                    stream.engine.abort(stream.request_id)


def _sse(payload) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def _sse_error(e: Exception, status: int, type: str) -> str:
    return f"data: {json.dumps(ErrorResponse.of(str(e), type, status))}\n\n"


_SENTINEL = "\x00iterserve-text\x00"


class _TextFrame:
    """The SSE frame of a plain text delta, rendered once with a placeholder: the per-token hot
    path then costs one json.dumps instead of building and serializing a pydantic model (the
    event loop shares the GIL with the engine thread, so this is throughput)."""

    def __init__(self, template) -> None:
        frame = _sse(template)
        self.head, found, self.tail = frame.partition(json.dumps(_SENTINEL))
        assert found, frame

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


class _Frames(dict):
    """The text frame of each choice index, built on first use."""

    def __init__(self, template) -> None:
        super().__init__()
        self.template = template  # index -> a response whose one choice has that index and _SENTINEL text

    def __missing__(self, index: int) -> _TextFrame:
        self[index] = frame = _TextFrame(self.template(index))
        return frame


async def _stream_errors_as_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream that ends in an error says so in an SSE error event, then [DONE] (the status is sent)."""
    try:
        async for chunk in chunks:
            yield chunk
    except ApiError as e:
        yield _sse_error(e, e.status, e.type)
    except _STREAM_ERRORS as e:
        yield _sse_error(e, e.status, e.type)
    yield "data: [DONE]\n\n"


def _new_logprobs(out: RequestOutput, key: int, sent: dict[int, int], convert, token_text: TokenText):
    """The logprobs of tokens not yet sent for this choice, or None."""
    done = sent.get(key, 0)
    if not out.logprobs or len(out.logprobs) <= done:
        return None
    sent[key] = len(out.logprobs)
    return convert(out.logprobs[done:], out.token_ids[done:], token_text)


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream number, output) from several streams, as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                left -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()



def _total_usage(groups: list[list[RequestOutput]], count_completion: bool = True) -> Usage:
    """Each prompt once, however many choices share it; every choice's completion tokens."""
    usages = [_usage(outs) for outs in groups if outs]
    return Usage.of(sum(u.prompt_tokens for u in usages),
                    sum(u.completion_tokens for u in usages) if count_completion else 0)

