"""The OpenAI-compatible HTTP API over an AsyncEngine: FastAPI routes, SSE streams, errors.

Every error leaves as an OpenAI error object; FastAPI's 422 for a malformed body becomes a 400.
A client that goes away (mid-stream or while waiting for a non-streamed answer) has its
request aborted, which frees its KV blocks at the next step boundary.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import iterserve
from iterserve.engine import Engine
from iterserve.engine.diagnostics import Diagnostics
from iterserve.outputs import RequestOutput
from iterserve.server.async_engine import (
    AsyncEngine, EngineDeadError, QueueFullError, RequestStream, RequestTimeoutError, ShuttingDownError,
)
from iterserve.server.dashboard import mount as mount_dashboard
from iterserve.server.engine_client import EngineClient, check_engine_client
from iterserve.server.metrics import ServerMetrics
from iterserve.server.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatLogprobs, ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, DeltaMessage, DetokenizeRequest, DetokenizeResponse, ErrorResponse, ModelCard,
    ModelList, PromptLogprob, ResponseMessage, TokenizeRequest, TokenizeResponse, ToolCall, ToolCallDelta,
    TopLogprob, Usage,
)
from iterserve.sampling_params import StructuredOutputs
from iterserve.server import lora_routes, tools
from iterserve.server.reasoning import ReasoningSplitter, split as reasoning_split
from iterserve.server.token_text import TokenText

logger = logging.getLogger("iterserve.server")

_UNSUPPORTED = "this field is not supported by iterserve (see docs/api.md)"

# What can end a stream early besides the request's own outputs; each carries its HTTP status and type.
_STREAM_ERRORS = (EngineDeadError, RequestTimeoutError)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers


def error_response(status: int, message: str, type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorResponse.of(message, type, status, param), status_code=status, headers=headers)


@dataclass
class Chat:
    """A chat request on its way: its engine stream, prompt, sampling parameters, how a finished
    output's text becomes a reply (None: plain content) and the reasoning parser that splits it first."""
    stream: RequestStream
    prompt: list[int]
    params: object
    reply: Callable | None  # (output, text) -> (ResponseMessage, finish_reason)
    reasoning_parser: str | None = None

    def message(self, out: RequestOutput) -> tuple[ResponseMessage, str | None]:
        """The reply: its reasoning split off first, then tool calls parsed from the rest (the content)."""
        reasoning, text = reasoning_split(self.reasoning_parser, out.text) if self.reasoning_parser else (None, out.text)
        message, finish = self.reply(out, text) if self.reply else (ResponseMessage(content=text), out.finish_reason)
        if reasoning is not None:
            message.reasoning_content = message.reasoning = reasoning
        return message, finish


@dataclass
class Routes:
    """What build_app's routes share with the routers mounted beside them (embeddings.py, messages.py)."""
    engine: EngineClient
    model: str  # the served model name
    check_model: Callable[[str | None], None]
    start: Callable  # async (prompt, params, priority=0, cache_salt=None) -> RequestStream, errors as ApiError
    chat_prompt: Callable  # (messages, tools) -> prompt token ids
    start_chat: Callable  # async (ChatCompletionRequest) -> Chat


def build_app(async_engine: EngineClient, served_model_name: str, api_key: str | None = None,
              max_request_bytes: int = 1 << 20, metrics=None,
              allowed_origins: list[str] | None = None, diagnostics: Diagnostics | None = None,
              pooling: str = "last", reasoning_parser: str | None = None,
              runtime_lora_updating: bool = False) -> FastAPI:
    """The OpenAI app over an engine client (server/engine_client.py), checked here. `metrics`: what
    /metrics renders; by default a ServerMetrics fed by the client's on_step. A caller that passes its
    own (the Ray ingress: ClusterMetrics) feeds it itself. `pooling`: how /v1/embeddings pools;
    `reasoning_parser`: how chat replies' reasoning is split off (server/reasoning.py); `runtime_lora_updating`:
    mount the LoRA load/unload routes (server/lora_routes.py)."""
    check_engine_client(async_engine)
    if metrics is None:
        metrics = ServerMetrics(served_model_name)
        async_engine.on_step = metrics.on_step
    tokenizer = async_engine.tokenizer
    token_text = TokenText(tokenizer)
    max_model_len = async_engine.max_model_len

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="iterserve", version=iterserve.__version__, lifespan=lifespan)
    app.state.async_engine, app.state.metrics = async_engine, metrics

    # ---- errors -------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        return error_response(e.status, e.message, e.type, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: "
                            f"{_UNSUPPORTED if err.get('type') == 'extra_forbidden' else err.get('msg')}"
                            for err in errors[:5])
        return error_response(400, message or "invalid request body", "invalid_request_error",
                              ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None))

    # ---- info routes ------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if async_engine.dead is not None:
            return error_response(503, f"the engine loop has died: {async_engine.dead!r}", "engine_dead")
        if async_engine.draining:  # load balancers stop sending here while the open requests finish
            return error_response(503, "the server is shutting down", ShuttingDownError.type)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": iterserve.__version__}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=max_model_len),
                               *lora_routes.model_cards(async_engine, served_model_name, max_model_len)])

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str):
        check_model(model_id)
        cards = lora_routes.model_cards(async_engine, served_model_name, max_model_len)
        return next((c for c in cards if c.id == model_id), ModelCard(id=served_model_name, max_model_len=max_model_len))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send exactly one of prompt and messages")
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        try:
            ids = chat_prompt(body.messages) if body.messages is not None else \
                list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        try:
            ids = async_engine.encode(body.tokens) if body.tokens else []
        except ValueError as e:
            raise ApiError(400, str(e), param="tokens") from e
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        return DetokenizeResponse(prompt=tokenizer.decode(ids))

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- generation ---------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name and name not in lora_routes.adapters(async_engine):
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {served_model_name!r}",
                           "not_found_error", "model")

    def chat_prompt(messages, tool_list: list[dict] | None = None) -> list[int]:
        from iterserve.llm import apply_chat_template, check_messages
        msgs = [m.as_template_message() for m in messages]
        if tool_list or any(m.get("tool_calls") for m in msgs):
            check_messages(msgs)
            return tools.render_prompt(tokenizer, msgs, tool_list)
        return apply_chat_template(tokenizer, msgs)

    def check_context(prompt: list[int], params) -> None:
        """A max_tokens the context cannot hold is refused, as OpenAI and vLLM do, not cut short."""
        if len(prompt) < max_model_len and len(prompt) + params.max_tokens > max_model_len:
            raise ApiError(400, f"max_tokens is {params.max_tokens} and the prompt has {len(prompt)} tokens, "
                                f"but this model's context holds {max_model_len} tokens", param="max_tokens")

    async def compile_grammar(spec) -> None:
        """In a worker thread, before the request reaches the engine: the step loop then finds the
        grammar compiled in the cache, and a schema xgrammar refuses is a 400 here."""
        if tokenizer is None:
            raise ApiError(400, "structured output needs the model's tokenizer")
        from iterserve.executor.structured_output import grammar_cache
        cache = grammar_cache(tokenizer, async_engine.vocab_size, async_engine.eos_token_ids)
        try:
            await asyncio.to_thread(cache.compile, spec)
        except ValueError as e:
            raise ApiError(400, str(e)) from e

    async def start(prompt: str | list[int], params, priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        if params.structured_outputs is not None:
            await compile_grammar(params.structured_outputs)
        try:
            return await async_engine.add_request(prompt, params, request_id=_new_id(),
                                                  priority=priority, cache_salt=cache_salt)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        except QueueFullError as e:
            raise ApiError(503, str(e), "server_overloaded", headers={"Retry-After": "1"}) from e
        except (EngineDeadError, ShuttingDownError) as e:
            raise ApiError(e.status, str(e), e.type) from e

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        try:
            texts = body.prompt_list()
            prompts = [async_engine.encode(p) for p in texts]
            params = body.completion_params()
            params.lora_name = lora_routes.lora_name(async_engine, body.model, served_model_name)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        for p in prompts:
            check_context(p, params)
        streams: list[RequestStream] = []
        try:
            for p in prompts:
                streams.append(await start(p, params, body.priority, body.cache_salt))
        except ApiError:
            for s in streams:
                s.engine.abort(s.request_id)
            raise
        created, model = int(time.time()), params.lora_name or served_model_name
        if body.stream:
            return _SSEResponse(streams, _completion_chunks(streams, params.n, created, model, body.include_usage,
                                                            token_text))
        groups = await _collect(streams, request)
        echoed = [t if isinstance(t, str) else tokenizer.decode(t) if body.echo and tokenizer else "" for t in texts]
        choices = [_completion_choice(i * params.n + out.index, out, body, echoed[i], token_text)
                   for i, outs in enumerate(groups) for out in outs]
        return CompletionResponse(id=streams[0].request_id, created=created, model=model, choices=choices,
                                  usage=_total_usage(groups, count_completion=not body.echo_only))

    async def start_chat(body: ChatCompletionRequest) -> Chat:
        check_model(body.model)
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template")
        try:
            tool_list, choice = body.tool_mode()
            prompt = chat_prompt(body.messages, tool_list)
            # Chat's default: generate until the context is full (max(1): the engine reports the
            # prompt as too long, rather than max_tokens as invalid).
            params = body.sampling_params(max(1, max_model_len - len(prompt)), body.num_logprobs())
            params.lora_name = lora_routes.lora_name(async_engine, body.model, served_model_name)
            if tool_list and (forced := tools.forced_schema(tool_list, choice, body.parallel_tool_calls)) is not None:
                params = replace(params, structured_outputs=StructuredOutputs(json=json.dumps(forced)))
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        check_context(prompt, params)
        stream = await start(prompt, params, body.priority, body.cache_salt)
        reply = (lambda out, text: _tool_reply(text, out, tool_list, choice, body.parallel_tool_calls)) \
            if tool_list else None
        # a grammar holds from the first token, so a constrained reply has no reasoning to split off
        return Chat(stream, prompt, params, reply, reasoning_parser if params.structured_outputs is None else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        chat = await start_chat(body)
        stream, params = chat.stream, chat.params
        created, model = int(time.time()), params.lora_name or served_model_name
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

    from iterserve.server import embeddings  # here: the routers' modules import this one
    routes = Routes(async_engine, served_model_name, check_model, start, chat_prompt, start_chat)
    app.include_router(embeddings.router(routes, pooling))
    if runtime_lora_updating:  # off by default: its requests name files on this machine
        app.include_router(lora_routes.router(routes))

    if isinstance(async_engine, AsyncEngine) and isinstance(async_engine.engine, Engine):  # they read its scheduler
        mount_dashboard(app, async_engine, metrics, diagnostics)  # /dashboard, /v1/dashboard, /v1/diagnostics
    app.add_middleware(_Guard, api_key=api_key, max_request_bytes=max_request_bytes)
    if allowed_origins:  # off by default; outside the guard, so preflights need no API key
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app


# ---- responses ------------------------------------------------------------------------------

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


def _total_usage(groups: list[list[RequestOutput]], count_completion: bool = True) -> Usage:
    """Each prompt once, however many choices share it; every choice's completion tokens."""
    usages = [_usage(outs) for outs in groups if outs]
    return Usage.of(sum(u.prompt_tokens for u in usages),
                    sum(u.completion_tokens for u in usages) if count_completion else 0)


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


def _tool_reply(text: str | None, out: RequestOutput, tool_list: list[dict], choice,
                parallel: bool) -> tuple[ResponseMessage, str | None]:
    """The reply's text as content and parsed tool calls; finish_reason tool_calls when there are calls."""
    content, calls = tools.parse_reply(text or "", tool_list, choice, parallel)
    if not calls:
        return ResponseMessage(content=content), out.finish_reason
    return ResponseMessage(content=content, tool_calls=[ToolCall(**c) for c in calls]), "tool_calls"


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


def _chat_logprobs(logprobs, token_ids: list[int], token_text: TokenText) -> ChatLogprobs:
    content = []
    for lp, tid in zip(logprobs, token_ids):
        top = [TopLogprob(token=token_text.str(t), logprob=v, bytes=list(token_text.bytes(t))) for t, v in lp.top]
        content.append(ChatTokenLogprob(token=token_text.str(tid), logprob=lp.logprob,
                                        bytes=list(token_text.bytes(tid)), top_logprobs=top))
    return ChatLogprobs(content=content)


# ---- the outer guard: API key and body size, before any routing or parsing -----------------------

_GUARDED = ("/v1/", "/tokenize", "/detokenize")  # paths that need the API key, when one is set


class _Guard:
    """Plain ASGI middleware (no per-request task, unlike BaseHTTPMiddleware): checks the API key
    on /v1/ routes in constant time and refuses bodies over max_request_bytes with a 413."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith(_GUARDED):
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            # the scheme is case-insensitive (RFC 7235): clients send "bearer" too
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.api_key):
                return await error_response(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                            "authentication_error")(scope, receive, send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            too_big = error_response(413, f"the request body is over {self.max_request_bytes} bytes",
                                     "invalid_request_error")
            try:
                if int(headers.get(b"content-length", b"0")) > self.max_request_bytes:
                    return await too_big(scope, receive, send)
            except ValueError:
                return await error_response(400, "bad Content-Length", "invalid_request_error")(scope, receive, send)
            body = await _read_body(receive, self.max_request_bytes)
            if body is None:
                return await too_big(scope, receive, send)
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` (chunked bodies carry no Content-Length)."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts)
        size += len(message.get("body", b""))
        if size > limit:
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then the real channel: http.disconnect
    return replay
