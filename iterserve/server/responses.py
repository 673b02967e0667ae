"""POST /v1/responses (OpenAI's Responses API) on the chat path, with stored responses.

A request becomes a ChatCompletionRequest (responses_protocol.py) and runs through app.py's start_chat:
the same prompt rendering, tools, structured output and reasoning split as /v1/chat/completions. The
reply becomes output items: a reasoning item (with --reasoning-parser), a message, function calls.

Stored responses live in memory, an LRU of `capacity`; each keeps its whole conversation, so a
`previous_response_id` continues it even after the responses before it were evicted. Instructions are
not carried over (OpenAI's rule). Responses run in the foreground only: `background: true` is a 400, and
so is cancelling, which only a background response could be.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import APIRouter, Request
from pydantic import ValidationError

from iterserve.server.errors import ApiError
from iterserve.server.streams import _STREAM_ERRORS, _collect, _SSEResponse
from iterserve.server.protocol import ChatCompletionRequest, ResponseMessage
from iterserve.server.reply_stream import Done, Text, reply_events
from iterserve.server.responses_protocol import ResponsesRequest

if TYPE_CHECKING:
    from iterserve.outputs import RequestOutput
    from iterserve.server.routes import Chat, Routes


@dataclass
class Stored:
    response: dict[str, Any]  # the body GET returns
    messages: list[dict[str, Any]]  # the conversation so far, its reply included, without instructions


@dataclass
class ResponseStore:
    capacity: int = 1024
    items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def put(self, stored: Stored) -> None:
        self.items[stored.response["id"]] = stored
        self.items.move_to_end(stored.response["id"])
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        stored = self.items.get(response_id)
        if stored is None:
            raise ApiError(404, f"no stored response with id {response_id!r} (never stored, deleted, or evicted: "
                                f"this server keeps the latest {self.capacity})", "not_found_error", param)
        self.items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.items[response_id]


def router(routes: Routes, capacity: int = 1024) -> APIRouter:
    api = APIRouter()
    store = ResponseStore(capacity)

    @api.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        if body.background:
            raise ApiError(400, "background responses are not supported: iterserve runs a response while its "
                                "request is open", param="background")
        history = store.get(body.previous_response_id, "previous_response_id").messages \
            if body.previous_response_id else []
        messages = history + body.chat_messages()
        chat = await routes.start_chat(_chat_request(body, messages))
        turn = _Turn(body, messages, routes.model, chat.stream.request_id)
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
        store.get(response_id)
        raise ApiError(400, "only a background response can be cancelled, and iterserve runs none: this one has "
                            "already ended")

    return api


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
        if not self.body.store:
            return
        reply = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            reply["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        store.put(Stored(response, self.messages + [reply]))


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
