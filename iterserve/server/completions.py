"""POST /v1/completions: one request per prompt, n choices each, streamed or whole; echo and logprobs."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import APIRouter, Request

from iterserve.outputs import RequestOutput
from iterserve.server import lora_routes
from iterserve.server.errors import ApiError
from iterserve.server.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptLogprob,
)
from iterserve.server.request_stream import RequestStream
from iterserve.server.streams import (
    _SENTINEL, _check_error, _collect, _Frames, _merged, _new_logprobs, _sse, _SSEResponse, _stream_errors_as_events,
    _total_usage,
)
from iterserve.server.token_text import TokenText

if TYPE_CHECKING:
    from iterserve.server.routes import Routes


def router(routes: Routes) -> APIRouter:
    api = APIRouter()
    tokenizer, token_text = routes.tokenizer, routes.token_text

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        routes.check_model(body.model)
        try:
            texts = body.prompt_list()
            prompts = [routes.engine.encode(p) for p in texts]
            params = body.completion_params()
            params.lora_name = lora_routes.lora_name(routes.engine, body.model, routes.model)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        for p in prompts:
            routes.check_context(p, params)
        streams: list[RequestStream] = []
        try:
            for p in prompts:
                streams.append(await routes.start(p, params, body.priority, body.cache_salt))
        except ApiError:
            for s in streams:
                s.engine.abort(s.request_id)
            raise
        created, model = int(time.time()), params.lora_name or routes.model
        if body.stream:
            return _SSEResponse(streams, _completion_chunks(streams, params.n, created, model, body.include_usage,
                                                            token_text))
        groups = await _collect(streams, request)
        echoed = [t if isinstance(t, str) else tokenizer.decode(t) if body.echo and tokenizer else "" for t in texts]
        choices = [_completion_choice(i * params.n + out.index, out, body, echoed[i], token_text)
                   for i, outs in enumerate(groups) for out in outs]
        return CompletionResponse(id=streams[0].request_id, created=created, model=model, choices=choices,
                                  usage=_total_usage(groups, count_completion=not body.echo_only))
    return api


def _completion_chunks(streams: list[RequestStream], n: int, created: int, model: str, include_usage: bool,
                       token_text: TokenText) -> AsyncIterator[str]:
    """Choice i * n + k is sequence k of prompt i, as OpenAI numbers a batch of prompts."""
    def response(choices, usage=None) -> CompletionResponse:
        return CompletionResponse(id=streams[0].request_id, created=created, model=model, choices=choices,
                                  usage=usage)

    async def chunks():
        frames = _Frames(lambda i: response([CompletionChoice(index=i, text=_SENTINEL)]))
        sent_lp: dict[int, int] = {}
        final: dict[int, list[RequestOutput]] = {}
        async for i, out in _merged(streams):
            _check_error(out)
            index = i * n + out.index
            final.setdefault(i, [None] * n)[out.index] = out
            lp = _new_logprobs(out, index, sent_lp, _completion_logprobs, token_text)
            if out.new_text and lp is None and not out.finished:
                yield frames[index](out.new_text)
            elif out.new_text or lp or out.finished:
                yield _sse(response([CompletionChoice(index=index, text=out.new_text, logprobs=lp,
                                                      finish_reason=out.finish_reason if out.finished else None)]))
        if include_usage and final:
            groups = [[o for o in outs if o is not None] for outs in final.values()]
            yield _sse(response([], _total_usage(groups)))
    return _stream_errors_as_events(chunks())


def _completion_choice(index: int, out: RequestOutput, body: CompletionRequest, prompt_text: str,
                       token_text: TokenText) -> CompletionChoice:
    """echo puts the prompt (its text, and its tokens' logprobs) before the completion; with
    max_tokens 0 the one token made to get there is dropped."""
    token_ids, logprobs, text = out.token_ids, out.logprobs, out.text
    if body.echo_only:
        token_ids, logprobs, text = [], [], ""
    lp = None
    if body.logprobs is not None:
        lp = _completion_logprobs(logprobs, token_ids, token_text)
        if body.echo:
            head = _completion_logprobs(out.prompt_logprobs or [], out.prompt_token_ids, token_text)
            lp = CompletionLogprobs(tokens=head.tokens + lp.tokens, token_logprobs=head.token_logprobs + lp.token_logprobs,
                                    top_logprobs=head.top_logprobs + lp.top_logprobs,
                                    text_offset=head.text_offset + [len(prompt_text) + o for o in lp.text_offset])
    plp = None
    if body.prompt_logprobs is not None and out.prompt_logprobs is not None:
        plp = [None if p is None else {str(t): PromptLogprob(logprob=v, decoded_token=token_text.str(t))
                                       for t, v in [(tid, p.logprob), *p.top]}
               for tid, p in zip(out.prompt_token_ids, out.prompt_logprobs)]
    return CompletionChoice(index=index, text=prompt_text + text if body.echo else text, logprobs=lp,
                            finish_reason="length" if body.echo_only else out.finish_reason, prompt_logprobs=plp)


def _completion_logprobs(logprobs, token_ids: list[int], token_text: TokenText) -> CompletionLogprobs:
    """Each top dict also holds the token itself, as OpenAI and vLLM report it; a prompt's first
    token (echo) has no logprob."""
    out = CompletionLogprobs()
    offset = 0
    for lp, tid in zip(logprobs, token_ids):
        text = token_text.str(tid)
        out.tokens.append(text)
        out.token_logprobs.append(None if lp is None else lp.logprob)
        out.top_logprobs.append(None if lp is None else
                                {token_text.str(t): v for t, v in [*lp.top, (tid, lp.logprob)]})
        out.text_offset.append(offset)
        offset += len(token_text.bytes(tid).decode("utf-8", "ignore"))
    return out

