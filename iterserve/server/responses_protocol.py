"""The Responses API's request body (the subset iterserve serves), and its mapping onto a chat request.

A response is a chat completion in other clothes: instructions become the system message, input items
become chat messages (function_call items an assistant's tool_calls, function_call_output items tool
messages), text.format becomes response_format. responses.py then runs it on the chat path.
Unknown fields are a 400 naming them, as on every route.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

_STRICT = ConfigDict(extra="forbid")


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # what an output_text handed back carries
    logprobs: list[Any] | None = None


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(BaseModel):
    """An earlier reply's reasoning, handed back with its output; chat templates drop it, and so do we."""
    model_config = _STRICT
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(v: Any) -> str:
    t = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return t if t in ("message", "function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None  # run detached from the request (responses.py); needs store
    truncation: Literal["disabled"] | None = None  # "auto" would drop turns silently: not offered

    def chat_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages (OpenAI chat shape), without the instructions."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # the reply's text, then its calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return messages

    def chat_fields(self) -> dict[str, Any]:
        """Everything but the messages, as ChatCompletionRequest fields."""
        fields: dict[str, Any] = {"model": self.model, "max_tokens": self.max_output_tokens, "user": self.user,
                                  "parallel_tool_calls": self.parallel_tool_calls}
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice in ("required", "auto", "none") and (self.tools or self.tool_choice == "required"):
            fields["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("text.format: json_schema needs its schema")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.json_schema, "description": fmt.description}}
        elif fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        return fields

    def echo(self) -> dict[str, Any]:
        """The request's settings as a response repeats them."""
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
                "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
                "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)
                         if self.text and self.text.format else {"type": "text"}},
                "previous_response_id": self.previous_response_id, "metadata": self.metadata or {},
                "store": self.store, "background": bool(self.background), "truncation": "disabled", "user": self.user,
                "reasoning": None}
