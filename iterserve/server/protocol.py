"""OpenAI API request and response bodies (the subset iterserve serves), as pydantic models.

Requests map onto SamplingParams; SamplingParams does the range checks so the rules live in one
place, and its ValueError becomes a 400 in app.py.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from iterserve.sampling_params import SamplingParams, StructuredOutputs


# A field this server does not implement is refused with a 400 naming it, never silently ignored
# (OpenAI's own API refuses unknown fields too); app.py words pydantic's extra_forbidden error.
_STRICT = ConfigDict(extra="forbid")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced (additional properties refused)


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_spec: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def _schema_text(schema: dict[str, Any] | str) -> str:
    return json.dumps(schema if isinstance(schema, dict) else json.loads(schema))  # property order kept: it steers generation


class _SamplingRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # JSON keys are strings: token ids as text
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    user: str | None = None  # an end-user id for abuse tracking: nothing to do with generation
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputs | None:
        """The one output constraint asked for, if any (ValueError if several, or a bad schema)."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutputs(json_object=True))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format: json_schema needs its json_schema.schema")
            found.append(StructuredOutputs(json=_schema_text(rf.json_schema.json_schema)))
        so = self.structured_outputs
        if so is not None:
            found.append(StructuredOutputs(
                json=None if so.json_spec is None else _schema_text(so.json_spec), json_object=bool(so.json_object),
                regex=so.regex, choice=None if so.choice is None else tuple(so.choice), grammar=so.grammar))
        if self.guided_json is not None:
            found.append(StructuredOutputs(json=_schema_text(self.guided_json)))
        if self.guided_regex is not None:
            found.append(StructuredOutputs(regex=self.guided_regex))
        if self.guided_choice is not None:
            found.append(StructuredOutputs(choice=tuple(self.guided_choice)))
        if self.guided_grammar is not None:
            found.append(StructuredOutputs(grammar=self.guided_grammar))
        if len(found) > 1:
            raise ValueError("ask for one output constraint: response_format, structured_outputs or one guided_* field")
        return found[0] if found else None

    def sampling_params(self, default_max_tokens: int, num_logprobs: int | None) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=num_logprobs, n=self.n, skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=_token_keys(self.logit_bias),
            min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise ValueError("logit_bias: keys must be token ids") from None


MAX_PROMPTS = 256  # prompts in one /v1/completions request


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's: per prompt token, in each choice
    best_of: int | None = None
    suffix: str | None = None

    def prompt_list(self) -> list[str | list[int]]:
        """One prompt, or a batch of them: each is its own engine request."""
        p = self.prompt
        if (self.best_of or 1) > 1 or self.suffix:
            raise ValueError("best_of > 1 and suffix are not supported")
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream: true")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) > MAX_PROMPTS:
                raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts in one request")
            return list(p)
        return [p]

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: score the prompt, generate nothing (one token is made, then dropped)."""
        return self.echo and self.max_tokens == 0

    def completion_params(self) -> SamplingParams:
        params = self.sampling_params(16, self.logprobs) if not self.echo_only else \
            self.model_copy(update={"max_tokens": 1, "min_tokens": 0}).sampling_params(16, self.logprobs)
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return replace(params, prompt_logprobs=max(wanted)) if wanted else params


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # OpenAI's newer name for the system role; chat templates know only "system"
        m: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            m["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # required / named calls always follow the schema


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # False: at most one call per reply

    def tool_mode(self) -> tuple[list[dict] | None, str | dict]:
        """(tools as dicts, or None when they are off; the choice: auto, required or a named function)."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if choice == "none":
            return None, "none"
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(choice, NamedToolChoice):
            choice = choice.model_dump()
            if choice["function"]["name"] not in {t["function"]["name"] for t in tools}:
                raise ValueError(f"tool_choice names {choice['function']['name']!r}, which is not one of the tools")
        if choice != "auto" and self.structured() is not None:
            raise ValueError("tool_choice required or named already constrains the reply: drop response_format")
        return tools, choice

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses ------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's shape: per prompt token, {token id: its logprob} for the token and the top N (first: None)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class _Reasoning(BaseModel):
    """A reply's reasoning (serve --reasoning-parser), under vLLM's older and newer names; left out of the
    body when there is none, so a server without a parser answers as before."""
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_no_reasoning(self, handler):
        data = handler(self)
        if data.get("reasoning_content") is None and data.get("reasoning") is None:
            data.pop("reasoning_content", None)
            data.pop("reasoning", None)
        return data


class ResponseMessage(_Reasoning):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(ToolCall):
    index: int


class DeltaMessage(_Reasoning):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "iterserve"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's path
    parent: str | None = None  # a LoRA adapter's base model


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt (a chat template adds its own)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

    @classmethod
    def of(cls, message: str, type: str, code: int, param: str | None = None) -> dict[str, Any]:
        return cls(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()
