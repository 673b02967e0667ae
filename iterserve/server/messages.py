"""Anthropic's Messages API, POST /v1/messages and /v1/messages/count_tokens, on the chat path.

A request becomes a ChatCompletionRequest and runs through app.py's start_chat (prompt rendering, tools,
reasoning split). Content blocks map onto chat messages: tool_use blocks are an assistant's tool_calls
(input as JSON arguments), tool_result blocks tool messages; the reply comes back as thinking (with
--reasoning-parser), text and tool_use blocks. Errors leave in Anthropic's shape, {"type": "error",
"error": {"type", "message"}}: the router's route class turns ApiError and FastAPI's validation error (an
unknown field is a 400 naming it) into that shape before the app's OpenAI-shaped handlers see them.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, AsyncIterator, Literal, Union

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from iterserve.server.errors import _UNSUPPORTED, ApiError
from iterserve.server.streams import _STREAM_ERRORS, _collect, _SSEResponse
from iterserve.server.protocol import ChatCompletionRequest, ResponseMessage
from iterserve.server.reply_stream import Done, Text, reply_events

if TYPE_CHECKING:
    from iterserve.outputs import RequestOutput
    from iterserve.server.routes import Chat, Routes

_STRICT = ConfigDict(extra="forbid")


class TextBlock(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a hint: the prefix cache needs none
    citations: list[Any] | None = None


class ThinkingBlock(BaseModel):
    """An earlier reply's thinking, handed back; chat templates drop it, and so do we."""
    model_config = _STRICT
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


Block = Annotated[Union[TextBlock, ThinkingBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def chat_messages(self) -> list[dict[str, Any]]:
        """Tool results first (each a tool message), then the text; an assistant's tool_use its tool_calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in self.content if isinstance(b, ToolUseBlock)]
        out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
               for b in self.content if isinstance(b, ToolResultBlock)]
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif text or not out:
            out.append({"role": self.role, "content": text})
        return out


class ToolDef(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = _STRICT
    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None

    def chat_request(self, **fields) -> ChatCompletionRequest:
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        messages = [{"role": "system", "content": system}] if system else []
        for m in self.messages:
            messages += m.chat_messages()
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                                 "parameters": t.input_schema}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None and (self.tools or choice.type in ("any", "tool")):  # auto or none alone: nothing
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name or ""}}
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return ChatCompletionRequest(model=self.model, messages=messages, **fields)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # user_id, for abuse tracking: nothing to do with generation
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # a hint: the prefix cache needs none

    def chat(self) -> ChatCompletionRequest:
        fields: dict[str, Any] = {"max_tokens": self.max_tokens, "stop": self.stop_sequences}
        if self.output_config is not None and self.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.json_schema}}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return self.chat_request(**fields)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message), status_code=status, headers=headers)


def _error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def _invalid(errors: list[dict]) -> JSONResponse:
    def one(err) -> str:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        return f"{where}: {_UNSUPPORTED if err.get('type') == 'extra_forbidden' else err.get('msg')}"
    return _error(400, "; ".join(one(err) for err in errors[:5]) or "invalid request body")


class _AnthropicRoute(APIRoute):
    """Errors in Anthropic's shape, raised while parsing the body or in the handler."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as e:
                return _invalid(e.errors())
            except ApiError as e:
                return _error(e.status, e.message, e.headers)
        return route


def router(routes: Routes) -> APIRouter:
    api = APIRouter(route_class=_AnthropicRoute)

    @api.post("/v1/messages")
    async def create(body: MessagesRequest, request: Request):
        chat = await routes.start_chat(_chat(body.chat))
        if body.stream:
            return _SSEResponse([chat.stream], _events(chat, body, routes.model))
        out = (await _collect([chat.stream], request))[0][0]
        message, finish = chat.message(out)
        return {"id": "msg_" + chat.stream.request_id, "type": "message", "role": "assistant", "model": routes.model,
                "content": _blocks(message), **_stop(out, finish, body),
                "usage": {"input_tokens": out.num_prompt_tokens, "output_tokens": len(out.token_ids)}}

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        routes.check_model(body.model)
        if routes.engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template")
        chat = _chat(body.chat_request)
        try:
            tool_list, _ = chat.tool_mode()
            return {"input_tokens": len(routes.chat_prompt(chat.messages, tool_list))}
        except ValueError as e:
            raise ApiError(400, str(e)) from e

    return api


def _chat(build) -> ChatCompletionRequest:
    try:
        return build()
    except ValidationError as e:
        raise ApiError(400, "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"
                                      for err in e.errors()[:5])) from e


def _stop(out: RequestOutput, finish: str | None, body: MessagesRequest) -> dict[str, Any]:
    """Anthropic's stop_reason (and the stop sequence that ended the reply, if one did)."""
    if finish == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(out.stop_reason, str) and out.stop_reason in (body.stop_sequences or ()):
        return {"stop_reason": "stop_sequence", "stop_sequence": out.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _tool_use(call) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.function.name, "input": json.loads(call.function.arguments)}


def _blocks(message: ResponseMessage) -> list[dict]:
    blocks = [{"type": "thinking", "thinking": message.reasoning, "signature": ""}] if message.reasoning else []
    if message.content:
        blocks.append({"type": "text", "text": message.content, "citations": None})
    return blocks + [_tool_use(c) for c in message.tool_calls or []]


def _sse(type: str, **fields) -> str:
    return f"event: {type}\ndata: {json.dumps({'type': type, **fields}, ensure_ascii=False)}\n\n"


async def _events(chat: Chat, body: MessagesRequest, model: str) -> AsyncIterator[str]:
    """message_start, then per block start / deltas / stop (thinking, text, tool_use), message_delta with the
    stop reason and usage, message_stop; an error mid-stream is an error event."""
    yield _sse("message_start", message={
        "id": "msg_" + chat.stream.request_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(chat.prompt), "output_tokens": 0}})
    index, open_kind = -1, None
    try:
        async for e in reply_events(chat):
            if isinstance(e, Text):
                if e.kind != open_kind:
                    if open_kind is not None:
                        yield _sse("content_block_stop", index=index)
                    index, open_kind = index + 1, e.kind
                    block = {"type": "thinking", "thinking": "", "signature": ""} if e.kind == "reasoning" else \
                        {"type": "text", "text": "", "citations": None}
                    yield _sse("content_block_start", index=index, content_block=block)
                delta = {"type": "thinking_delta", "thinking": e.text} if e.kind == "reasoning" else \
                    {"type": "text_delta", "text": e.text}
                yield _sse("content_block_delta", index=index, delta=delta)
                continue
            assert isinstance(e, Done)
            if open_kind is not None:
                yield _sse("content_block_stop", index=index)
            for call in e.message.tool_calls or []:
                index += 1
                yield _sse("content_block_start", index=index, content_block={**_tool_use(call), "input": {}})
                yield _sse("content_block_delta", index=index,
                           delta={"type": "input_json_delta", "partial_json": call.function.arguments})
                yield _sse("content_block_stop", index=index)
            yield _sse("message_delta", delta=_stop(e.out, e.finish_reason, body),
                       usage={"output_tokens": len(e.out.token_ids)})
            yield _sse("message_stop")
    except (ApiError, *_STREAM_ERRORS) as e:
        yield _sse("error", error=_error_body(getattr(e, "status", 500), str(e))["error"])
