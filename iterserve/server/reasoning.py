"""`serve --reasoning-parser deepseek_r1|qwen3`: a chat reply's `<think>...</think>` part becomes
`reasoning_content` (and `reasoning`, vLLM's newer name for it), the rest `content`.

One incremental splitter serves streamed and whole replies alike, so both split the same text the same
way. It holds back only text that may still be the start of a tag. The two parsers differ in where a
reply starts:
- deepseek_r1: in reasoning (R1's template opens `<think>` in the prompt); a leading `<think>` is
  dropped; without `</think>` the whole reply is reasoning.
- qwen3: in reasoning only if the reply opens with `<think>` (Qwen3 writes it itself; with thinking
  off its template closes an empty block in the prompt); otherwise all content.
A reply cut off inside its reasoning (max_tokens) is reasoning to its end, under either parser.
"""
from __future__ import annotations

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


class ReasoningSplitter:
    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(PARSERS)}")
        self.opens_in_reasoning = parser == "deepseek_r1"
        self.state = "start"  # -> "reasoning" -> "content", or "start" -> "content"
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) deltas of the reply's next text."""
        text, self.held = self.held + text, ""
        if self.state == "start":
            if text.startswith(START):
                text, self.state = text[len(START):], "reasoning"
            elif START.startswith(text):
                self.held = text  # may still become <think>
                return "", ""
            else:
                self.state = "reasoning" if self.opens_in_reasoning else "content"
        if self.state == "content":
            return "", text
        reasoning, found, rest = text.partition(END)
        if found:
            self.state = "content"
            return reasoning, rest
        keep = _tag_prefix_at_end(text, END)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What is still held, once the reply has ended."""
        held, self.held = self.held, ""
        in_reasoning = self.state == "reasoning" or (self.state == "start" and self.opens_in_reasoning)
        return (held, "") if in_reasoning else ("", held)


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """A whole reply as (reasoning, content); no reasoning is None, and so is an empty content after it."""
    splitter = ReasoningSplitter(parser)
    (r1, c1), (r2, c2) = splitter.feed(text), splitter.finish()
    reasoning, content = r1 + r2, c1 + c2
    return (reasoning, content or None) if reasoning else (None, content)


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[len(text) - n:]):
            return n
    return 0
