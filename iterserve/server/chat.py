"""POST /v1/chat/completions: a chat request (routes.start_chat) answered whole or as SSE chunks, with
tool calls and a reasoning part split off the reply."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import APIRouter, Request

from iterserve.outputs import RequestOutput
from iterserve.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatTokenLogprob, DeltaMessage, ToolCallDelta, TopLogprob,
)
from iterserve.server.reasoning import ReasoningSplitter
from iterserve.server.streams import (
    _SENTINEL, _check_error, _collect, _Frames, _new_logprobs, _sse, _SSEResponse, _stream_errors_as_events, _usage,
)
from iterserve.server.token_text import TokenText

if TYPE_CHECKING:
    from iterserve.server.routes import Chat, Routes


def router(routes: Routes) -> APIRouter:
    api = APIRouter()
    token_text = routes.token_text

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        chat = await routes.start_chat(body)
        stream, params = chat.stream, chat.params
        created, model = int(time.time()), params.lora_name or routes.model
        if body.stream:
            return _SSEResponse([stream], _chat_chunks(chat, created, model, body.include_usage, token_text))
        outs = (await _collect([stream], request))[0]
        choices = []
        for out in outs:
            message, finish = chat.message(out)
            choices.append(ChatChoice(index=out.index, message=message, finish_reason=finish,
                                      logprobs=_chat_logprobs(out.logprobs, out.token_ids, token_text)
                                      if params.logprobs is not None else None))
        return ChatCompletionResponse(id=stream.request_id, created=created, model=model, usage=_usage(outs),
                                      choices=choices)
    return api


def _chat_chunks(chat: Chat, created: int, model: str, include_usage: bool,
                 token_text: TokenText) -> AsyncIterator[str]:
    """With tools (chat.reply given), a choice's text is held until it ends, then sent as its content
    or as one tool_calls delta per call: a call is only known to be one once its tag closes. With a
    reasoning parser, each delta's text is split into reasoning and content as it comes."""
    stream, n, reply = chat.stream, chat.params.n, chat.reply

    def response(choices, usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=stream.request_id, created=created, model=model, choices=choices, usage=usage)

    def chunk(index: int, delta: DeltaMessage, finish_reason: str | None = None, logprobs=None) -> str:
        return _sse(response([ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                              logprobs=logprobs)]))

    async def chunks():
        for k in range(n):
            yield chunk(k, DeltaMessage(role="assistant", content=""))
        frames = _Frames(lambda i: response([ChatChunkChoice(index=i, delta=DeltaMessage(content=_SENTINEL))]))
        sent_lp: dict[int, int] = {}
        final: dict[int, RequestOutput] = {}
        splitters: dict[int, ReasoningSplitter] = {}  # per choice
        async for out in stream:
            _check_error(out)
            final[out.index] = out
            lp = _new_logprobs(out, out.index, sent_lp, _chat_logprobs, token_text)
            if reply is not None:
                if out.finished:
                    message, finish = chat.message(out)
                    calls = [ToolCallDelta(index=j, **c.model_dump()) for j, c in enumerate(message.tool_calls or [])]
                    yield chunk(out.index, DeltaMessage(content=message.content, tool_calls=calls or None,
                                                        reasoning_content=message.reasoning, reasoning=message.reasoning))
                    yield chunk(out.index, DeltaMessage(), finish)
                continue
            if chat.reasoning_parser is not None:
                r, c = _split_delta(splitters, chat.reasoning_parser, out)
                if r or c or lp:
                    yield chunk(out.index, DeltaMessage(content=c or None, reasoning_content=r or None,
                                                        reasoning=r or None), logprobs=lp)
            elif out.new_text and lp is None:
                yield frames[out.index](out.new_text)
            elif out.new_text or lp:
                yield chunk(out.index, DeltaMessage(content=out.new_text), logprobs=lp)
            if out.finished:
                yield chunk(out.index, DeltaMessage(), out.finish_reason)
        if include_usage and final:
            yield _sse(response([], _usage(list(final.values()))))
    return _stream_errors_as_events(chunks())


def _split_delta(splitters: dict[int, ReasoningSplitter], parser: str, out: RequestOutput) -> tuple[str, str]:
    """This output's new text as (reasoning, content), and what its choice's splitter held once it ends."""
    splitter = splitters.setdefault(out.index, ReasoningSplitter(parser))
    reasoning, content = splitter.feed(out.new_text)
    if out.finished:
        r, c = splitter.finish()
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def _chat_logprobs(logprobs, token_ids: list[int], token_text: TokenText) -> ChatLogprobs:
    content = []
    for lp, tid in zip(logprobs, token_ids):
        top = [TopLogprob(token=token_text.str(t), logprob=v, bytes=list(token_text.bytes(t))) for t, v in lp.top]
        content.append(ChatTokenLogprob(token=token_text.str(tid), logprob=lp.logprob,
                                        bytes=list(token_text.bytes(tid)), top_logprobs=top))
    return ChatLogprobs(content=content)

