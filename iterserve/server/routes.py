"""What the routers share (chat.py, completions.py, embeddings.py, info.py): the engine client, the
served model, and the steps every generating route takes before its request reaches the engine."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import Callable

from iterserve.outputs import RequestOutput
from iterserve.sampling_params import StructuredOutputs
from iterserve.server import lora_routes, tools
from iterserve.server.async_engine import EngineDeadError, QueueFullError, ShuttingDownError
from iterserve.server.engine_client import EngineClient
from iterserve.server.errors import ApiError
from iterserve.server.protocol import ChatCompletionRequest, ResponseMessage, ToolCall
from iterserve.server.reasoning import split as reasoning_split
from iterserve.server.request_stream import RequestStream
from iterserve.server.streams import _new_id
from iterserve.server.token_text import TokenText


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


class Routes:
    """`model`: the served model name; `reasoning_parser`: how chat replies' reasoning is split off
    (server/reasoning.py)."""

    def __init__(self, engine: EngineClient, model: str, reasoning_parser: str | None = None) -> None:
        self.engine, self.model, self.reasoning_parser = engine, model, reasoning_parser
        self.tokenizer = engine.tokenizer
        self.token_text = TokenText(self.tokenizer)
        self.max_model_len = engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model and name not in lora_routes.adapters(self.engine):
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model!r}",
                           "not_found_error", "model")

    def chat_prompt(self, messages, tool_list: list[dict] | None = None) -> list[int]:
        from iterserve.llm import apply_chat_template, check_messages
        msgs = [m.as_template_message() for m in messages]
        if tool_list or any(m.get("tool_calls") for m in msgs):
            check_messages(msgs)
            return tools.render_prompt(self.tokenizer, msgs, tool_list)
        return apply_chat_template(self.tokenizer, msgs)

    def check_context(self, prompt: list[int], params) -> None:
        """A max_tokens the context cannot hold is refused, as OpenAI and vLLM do, not cut short."""
        max_model_len = self.max_model_len
        if len(prompt) < max_model_len and len(prompt) + params.max_tokens > max_model_len:
            raise ApiError(400, f"max_tokens is {params.max_tokens} and the prompt has {len(prompt)} tokens, "
                                f"but this model's context holds {max_model_len} tokens", param="max_tokens")

    async def compile_grammar(self, spec) -> None:
        """In a worker thread, before the request reaches the engine: the step loop then finds the
        grammar compiled in the cache, and a schema xgrammar refuses is a 400 here."""
        if self.tokenizer is None:
            raise ApiError(400, "structured output needs the model's tokenizer")
        from iterserve.executor.structured_output import grammar_cache
        cache = grammar_cache(self.tokenizer, self.engine.vocab_size, self.engine.eos_token_ids)
        try:
            await asyncio.to_thread(cache.compile, spec)
        except ValueError as e:
            raise ApiError(400, str(e)) from e

    async def start(self, prompt: str | list[int], params, priority: int = 0,
                    cache_salt: str | None = None) -> RequestStream:
        if params.structured_outputs is not None:
            await self.compile_grammar(params.structured_outputs)
        try:
            return await self.engine.add_request(prompt, params, request_id=_new_id(),
                                                 priority=priority, cache_salt=cache_salt)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        except QueueFullError as e:  # and QueuedTokensError: 429
            raise ApiError(e.status, str(e), e.type, headers={"Retry-After": "1"}) from e
        except (EngineDeadError, ShuttingDownError) as e:
            raise ApiError(e.status, str(e), e.type) from e

    async def start_chat(self, body: ChatCompletionRequest) -> Chat:
        self.check_model(body.model)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template")
        try:
            tool_list, choice = body.tool_mode()
            prompt = self.chat_prompt(body.messages, tool_list)
            # Chat's default: generate until the context is full (max(1): the engine reports the
            # prompt as too long, rather than max_tokens as invalid).
            params = body.sampling_params(max(1, self.max_model_len - len(prompt)), body.num_logprobs())
            params.lora_name = lora_routes.lora_name(self.engine, body.model, self.model)
            if tool_list and (forced := tools.forced_schema(tool_list, choice, body.parallel_tool_calls)) is not None:
                params = replace(params, structured_outputs=StructuredOutputs(json=json.dumps(forced)))
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        self.check_context(prompt, params)
        stream = await self.start(prompt, params, body.priority, body.cache_salt)
        reply = (lambda out, text: _tool_reply(text, out, tool_list, choice, body.parallel_tool_calls)) \
            if tool_list else None
        # a grammar holds from the first token, so a constrained reply has no reasoning to split off
        return Chat(stream, prompt, params, reply, self.reasoning_parser if params.structured_outputs is None else None)


def _tool_reply(text: str | None, out: RequestOutput, tool_list: list[dict], choice,
                parallel: bool) -> tuple[ResponseMessage, str | None]:
    """The reply's text as content and parsed tool calls; finish_reason tool_calls when there are calls."""
    content, calls = tools.parse_reply(text or "", tool_list, choice, parallel)
    if not calls:
        return ResponseMessage(content=content), out.finish_reason
    return ResponseMessage(content=content, tool_calls=[ToolCall(**c) for c in calls]), "tool_calls"
