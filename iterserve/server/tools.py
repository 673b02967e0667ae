"""Tool calling: tools into the prompt through the chat template, tool calls out of the reply.

The format is Hermes' (Qwen 2.5/3, Hermes, SmolLM2's function-calling data): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the reply; SmolLM2 also writes a JSON
list of calls inside one tag, which the parser takes too. A template that knows tools (it reads
`tools`) renders them itself; for one that does not (SmolLM2-135M's plain ChatML), the tool list
goes into the system message in the same format, and earlier calls and results are written as text.

tool_choice "auto" lets the model answer or call and parses the reply; "required" and a named
function constrain the reply with a JSON schema (vLLM's approach): a list of {"name",
"arguments"} objects, or the named function's arguments alone, so the call always parses and
its arguments match the function's schema. "none" leaves the tools out of the prompt.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

_SYSTEM = ("You are a function calling AI model. You may call one or more functions to assist with the "
           "user query. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function call, "
           "return a JSON object with the function name and arguments within <tool_call></tool_call> tags:\n"
           '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def template_supports_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def render_prompt(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
    """messages: OpenAI-shaped dicts (assistant tool_calls with string arguments, tool results)."""
    if template_supports_tools(tokenizer):
        msgs = [_with_dict_arguments(m) for m in messages]
        text = tokenizer.apply_chat_template(msgs, tools=tools or None, tokenize=False, add_generation_prompt=True)
    else:
        msgs = [_as_text(m) for m in messages]
        if tools:
            listing = "\n".join(json.dumps(t) for t in tools)
            system = _SYSTEM.format(tools=listing)
            if msgs[0]["role"] == "system":
                msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + system}
            else:
                msgs.insert(0, {"role": "system", "content": system})
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _with_dict_arguments(m: dict[str, Any]) -> dict[str, Any]:
    """Templates print arguments with tojson: hand them the object, not its JSON text."""
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _as_text(m: dict[str, Any]) -> dict[str, str]:
    content = m.get("content") or ""
    for c in m.get("tool_calls") or ():
        call = {"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])}
        content += f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    return {"role": m["role"], "content": content}


def _loads(arguments: str | dict) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise ValueError(f"tool call arguments must be JSON, got {arguments[:80]!r}") from None


def forced_schema(tools: list[dict], choice: str | dict, parallel: bool = True) -> dict | None:
    """The JSON schema a reply must follow for "required" or a named function; None otherwise."""
    if choice == "required":
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "arguments": t["function"].get("parameters") or {"type": "object"}}}
                 for t in tools]
        return {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if parallel else {"maxItems": 1})}
    if isinstance(choice, dict):
        return function_of(tools, choice["function"]["name"]).get("parameters") or {"type": "object"}
    return None


def function_of(tools: list[dict], name: str) -> dict:
    for t in tools:
        if t["function"]["name"] == name:
            return t["function"]
    raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")


def parse_reply(text: str, tools: list[dict], choice: str | dict, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a reply. Calls are OpenAI-shaped, arguments as JSON text."""
    if choice != "auto":  # the grammar held the reply to the schema; only max_tokens can cut it short
        try:
            if isinstance(choice, dict):
                return None, [_call(choice["function"]["name"], json.loads(text))]
            return None, [_call(c["name"], c["arguments"]) for c in json.loads(text)]
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
    calls = []
    for body in _CALL.findall(text):
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError:
            continue  # not a call after all: it stays in the content
        for c in parsed if isinstance(parsed, list) else [parsed]:
            if isinstance(c, dict) and isinstance(c.get("name"), str):
                calls.append(_call(c["name"], c.get("arguments", c.get("parameters", {}))))
    if not calls:
        return text, []
    calls = calls if parallel else calls[:1]
    content = _CALL.sub("", text).strip()
    return content or None, calls


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}
