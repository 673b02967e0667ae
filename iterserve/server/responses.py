"""POST /v1/responses (OpenAI's Responses API) on the chat path, with stored responses.

A request becomes a ChatCompletionRequest (responses_protocol.py) and runs through app.py's start_chat:
the same prompt rendering, tools, structured output and reasoning split as /v1/chat/completions. The
reply becomes output items: a reasoning item (with --reasoning-parser), a message, function calls.

Stored responses live in memory, an LRU of `capacity`; each keeps its whole conversation, so a
`previous_response_id` continues it even after the responses before it were evicted. Instructions are
not carried over (OpenAI's rule). A `background: true` response runs detached from its HTTP request:
create returns it queued, GET shows its output so far and then the final response, and cancel aborts
its engine request (responses_store.py holds it, with its run, until it ends).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import APIRouter, Request
from pydantic import ValidationError

from iterserve.server.errors import ApiError
from iterserve.server.streams import _STREAM_ERRORS, _collect, _SSEResponse
from iterserve.server.protocol import ChatCompletionRequest, ResponseMessage
from iterserve.server.reply_stream import Done, Text, reply_events
from iterserve.server.responses_protocol import ResponsesRequest
from iterserve.server.responses_store import ResponseStore, Stored

if TYPE_CHECKING:
    from iterserve.outputs import RequestOutput
    from iterserve.server.routes import Chat, Routes


def router(routes: Routes, capacity: int = 1024) -> APIRouter:
    api = APIRouter()
    store = ResponseStore(capacity)

    @api.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        _check_background(body)
        messages = _history(store, body.previous_response_id) + body.chat_messages()
        chat = await routes.start_chat(_chat_request(body, messages))
        turn = _Turn(body, messages, routes.model, chat.stream.request_id)
        if body.background:
            return _start_background(turn, chat, store)
        if body.stream:
            return _SSEResponse([chat.stream], _events(turn, chat, store))
        out = (await _collect([chat.stream], request))[0][0]
        message, finish = chat.message(out)
        response = turn.response(_output_items(message, finish), out, finish)
        turn.save(store, response, message)
        return response

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        return store.get(response_id).response

    @api.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str):
        stored = store.get(response_id)
        status = stored.response["status"]
        if not stored.response["background"]:
            raise ApiError(400, "only a background response can be cancelled: this one ran in the foreground")
        if stored.running:
            stored.cancel()
        elif status != "cancelled":
            raise ApiError(400, f"this response has already ended ({status}): only a queued or in-progress "
                                "background response can be cancelled")
        return stored.response

    return api


def _check_background(body: ResponsesRequest) -> None:
    if body.background and not body.store:
        raise ApiError(400, "background: true needs store: a background response is read back by its id",
                       param="background")
    if body.background and body.stream:
        raise ApiError(400, "stream: true with background: true is not supported: create the response, then "
                            "poll GET /v1/responses/{id}", param="stream")


def _history(store: ResponseStore, previous_id: str | None) -> list[dict[str, Any]]:
    if not previous_id:
        return []
    stored = store.get(previous_id, "previous_response_id")
    if stored.response["status"] not in ("completed", "incomplete"):
        raise ApiError(400, f"the previous response {previous_id!r} is {stored.response['status']}: only a "
                            "finished response can be continued", param="previous_response_id")
    return stored.messages


def _chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    try:
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        if not messages:
            raise ValueError("input is empty")
        return ChatCompletionRequest(messages=system + messages, **body.chat_fields())
    except ValidationError as e:
        raise ApiError(400, f"input: {e.errors()[0]['msg']}", param="input") from e
    except ValueError as e:
        raise ApiError(400, str(e)) from e


@dataclass
class _Turn:
    """One response on its way: what its body repeats, and the conversation it extends."""
    body: ResponsesRequest
    messages: list[dict[str, Any]]
    model: str
    request_id: str
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return "resp_" + self.request_id

    def response(self, output: list[dict], out: RequestOutput | None = None, finish: str | None = None) -> dict:
        """The response body; without `out`, one still in progress."""
        status, incomplete, usage = "in_progress", None, None
        if out is not None:
            status = "incomplete" if finish == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
            n_in, n_out = out.num_prompt_tokens, len(out.token_ids)
            usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model, "output": output,
                "usage": usage, **self.body.echo()}

    def save(self, store: ResponseStore, response: dict, message: ResponseMessage) -> None:
        if self.body.store:
            store.put(Stored(response, self.messages + [_reply(message)]))


def _reply(message: ResponseMessage) -> dict[str, Any]:
    """The reply as the conversation's next chat message."""
    reply = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        reply["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    return reply


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_text_part(text)] if status != "in_progress" else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_items(message: ResponseMessage) -> list[dict]:
    return [{"type": "function_call", "id": "fc_" + c.id.removeprefix("call_"), "call_id": c.id,
             "name": c.function.name, "arguments": c.function.arguments, "status": "completed"}
            for c in message.tool_calls or []]


def _output_items(message: ResponseMessage, finish: str | None) -> list[dict]:
    items = []
    if message.reasoning:
        items.append(_reasoning_item(_new_id("rs"), message.reasoning))
    if message.content:
        status = "incomplete" if finish == "length" else "completed"
        items.append(_message_item(_new_id("msg"), message.content, status))
    return items + _call_items(message)


class _Events:
    """The SSE events of one streamed response, numbered in order; an open item takes text deltas."""

    def __init__(self, turn: _Turn) -> None:
        self.turn, self.seq = turn, 0
        self.output: list[dict] = []  # finished items
        self.open: tuple[str, str] | None = None  # (kind, item id) of the item taking deltas
        self.text = ""

    def event(self, type: str, **fields) -> str:
        payload = {"type": type, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def delta(self, kind: str, text: str) -> list[str]:
        frames = self.close() if self.open and self.open[0] != kind else []
        if self.open is None:
            frames += self._start(kind)
        self.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return frames + [self.event(name, item_id=self.open[1], output_index=len(self.output), content_index=0,
                                    delta=text, **extra)]

    def _start(self, kind: str) -> list[str]:
        item_id = _new_id("rs" if kind == "reasoning" else "msg")
        self.open, self.text = (kind, item_id), ""
        item = _reasoning_item(item_id, "", "in_progress") if kind == "reasoning" else \
            _message_item(item_id, "", "in_progress")
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part("")
        index = len(self.output)
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                           part=part)]

    def items(self) -> list[dict]:
        """The output so far: the finished items, then the open one with its text so far."""
        if self.open is None:
            return list(self.output)
        (kind, item_id), text = self.open, self.text
        item = _reasoning_item(item_id, text) if kind == "reasoning" else _message_item(item_id, text)
        return self.output + [{**item, "status": "in_progress"}]

    def close(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        (kind, item_id), index, text = self.open, len(self.output), self.text
        if kind == "reasoning":
            item, part = _reasoning_item(item_id, text), {"type": "reasoning_text", "text": text}
            frames = [self.event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                 content_index=0, text=text)]
        else:
            item, part = _message_item(item_id, text, status), _text_part(text)
            frames = [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                                 text=text, logprobs=[])]
        frames += [self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                              part=part),
                   self.event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        self.open = None
        return frames

    def call(self, item: dict) -> list[str]:
        index = len(self.output)
        self.output.append(item)
        ids = {"item_id": item["id"], "output_index": index}
        return [self.event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                   "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
                self.event("response.function_call_arguments.done", **ids, name=item["name"],
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]


async def _events(turn: _Turn, chat: Chat, store: ResponseStore) -> AsyncIterator[str]:
    ev = _Events(turn)
    start = turn.response([])
    yield ev.event("response.created", response=start)
    yield ev.event("response.in_progress", response=start)
    try:
        async for e in reply_events(chat):
            if isinstance(e, Text):
                for frame in ev.delta(e.kind, e.text):
                    yield frame
                continue
            assert isinstance(e, Done)
            for frame in ev.close("incomplete" if e.finish_reason == "length" else "completed"):
                yield frame
            for item in _call_items(e.message):
                for frame in ev.call(item):
                    yield frame
            response = turn.response(ev.output, e.out, e.finish_reason)
            turn.save(store, response, e.message)
            final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield ev.event(final, response=response)
    except (ApiError, *_STREAM_ERRORS) as e:
        yield ev.event("error", code=str(getattr(e, "status", 500)), message=str(e), param=None)


def _start_background(turn: _Turn, chat: Chat, store: ResponseStore) -> dict:
    """Store the response queued and run it detached from this HTTP request; GET reads it as it goes."""
    stored = Stored({**turn.response([]), "status": "queued"}, turn.messages, chat.stream)
    store.put(stored)
    stored.task = asyncio.create_task(_run_background(turn, chat, stored))
    return stored.response


async def _run_background(turn: _Turn, chat: Chat, stored: Stored) -> None:
    """The streamed response's items, kept in `stored` instead of sent: in_progress from the first text
    (a reply with tools is held until it ends, as when streamed), then the final response."""
    ev = _Events(turn)
    try:
        async for e in reply_events(chat):
            if not stored.running:  # cancelled: its request is already aborted
                return
            if isinstance(e, Text):
                ev.delta(e.kind, e.text)
                stored.response = turn.response(ev.items())
                continue
            ev.close("incomplete" if e.finish_reason == "length" else "completed")
            for item in _call_items(e.message):
                ev.call(item)
            stored.response = turn.response(ev.output, e.out, e.finish_reason)
            stored.messages, stored.stream, stored.task = turn.messages + [_reply(e.message)], None, None
            return
        error = "the request ended without a reply"
    except (ApiError, *_STREAM_ERRORS) as e:
        error = str(e)
    if stored.running:
        stored.response = {**turn.response(ev.items()), "status": "failed",
                           "error": {"code": "server_error", "message": error}}
        stored.stream = stored.task = None
