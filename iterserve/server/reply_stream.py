"""One chat reply (n = 1) as a stream of typed deltas, for the APIs that stream content blocks rather than
chat chunks: the Responses API (responses.py) and Anthropic's Messages API (messages.py).

Built on the chat path's Chat (app.py start_chat): its reasoning parser splits text as it comes, the same
incremental splitter the chat stream uses. With tools the reply is held until it ends, as on the chat
stream (a call is only known to be one once its tag closes), then given as its reasoning, its content and
its parsed calls. Either way a consumer sees Text deltas, then one Done.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Literal

from iterserve.outputs import RequestOutput
from iterserve.server.streams import _check_error
from iterserve.server.protocol import ResponseMessage
from iterserve.server.reasoning import ReasoningSplitter

if TYPE_CHECKING:
    from iterserve.server.routes import Chat


@dataclass(slots=True)
class Text:
    kind: Literal["reasoning", "content"]
    text: str


@dataclass(slots=True)
class Done:
    out: RequestOutput  # the final output: usage, stop_reason
    message: ResponseMessage  # the whole reply: reasoning, content, tool_calls
    finish_reason: str | None  # "stop", "length" or "tool_calls"


async def reply_events(chat: Chat) -> AsyncIterator[Text | Done]:
    splitter = ReasoningSplitter(chat.reasoning_parser) if chat.reasoning_parser else None
    async for out in chat.stream:
        _check_error(out)
        if chat.reply is None:
            reasoning, content = splitter.feed(out.new_text) if splitter else ("", out.new_text)
            if out.finished and splitter:
                r, c = splitter.finish()
                reasoning, content = reasoning + r, content + c
            if reasoning:
                yield Text("reasoning", reasoning)
            if content:
                yield Text("content", content)
        if out.finished:
            message, finish = chat.message(out)
            if chat.reply is not None:
                if message.reasoning:
                    yield Text("reasoning", message.reasoning)
                if message.content:
                    yield Text("content", message.content)
            yield Done(out, message, finish)
            return
