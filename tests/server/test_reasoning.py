"""--reasoning-parser: the splitter on token streams (every token's text, and every character apart), then
a round trip through the openai client against the real server on a tiny checkpoint whose tokenizer has
<think>/</think> added, its output forced by a script (streamed and not, and tools parsed from the
content part only)."""
from __future__ import annotations

import copy
import json

import openai
import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.executor.model_runner import ModelRunner
from iterserve.executor.request_state import RequestStates
from iterserve.server.reasoning import ReasoningSplitter, split
from tests.server.conftest import MODEL, no_leaks, start_server

REPLY = "<think>The user greets me. I greet back.</think>Hello there!"
TOOL_REPLY = ('<think>Weather: call the tool.</think><tool_call>{"name": "get_weather", '
              '"arguments": {"city": "Paris"}}</tool_call>')
CASES = {  # text -> {parser: (reasoning, content)}
    REPLY: {"deepseek_r1": ("The user greets me. I greet back.", "Hello there!"),
            "qwen3": ("The user greets me. I greet back.", "Hello there!")},
    "I think.</think>Answer": {"deepseek_r1": ("I think.", "Answer"), "qwen3": (None, "I think.</think>Answer")},
    "Just an answer <thin": {"deepseek_r1": ("Just an answer <thin", None), "qwen3": (None, "Just an answer <thin")},
    "<think>cut off mid-thought </thi": {"deepseek_r1": ("cut off mid-thought </thi", None),
                                         "qwen3": ("cut off mid-thought </thi", None)},
    "<thi": {"deepseek_r1": ("<thi", None), "qwen3": (None, "<thi")},
    "": {"deepseek_r1": (None, ""), "qwen3": (None, "")},
}


@pytest.fixture(scope="module")
def think_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<think>", "</think>"])  # not special: they stay in the text, as Qwen3's do
    return tok


def streamed(parser: str, pieces: list[str]) -> tuple[str, str]:
    splitter, reasoning, content = ReasoningSplitter(parser), "", ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_streamed_pieces_split_as_the_whole_text(parser, think_tokenizer):
    for text, expected in CASES.items():
        assert split(parser, text) == expected[parser], (parser, text)
        whole = tuple(x or "" for x in expected[parser])
        tokens = think_tokenizer.encode(text, add_special_tokens=False)
        assert think_tokenizer.decode(tokens) == text
        by_token = [think_tokenizer.decode(tokens[:i + 1])[len(think_tokenizer.decode(tokens[:i])):]
                    for i in range(len(tokens))]
        assert streamed(parser, by_token) == whole, (parser, text)
        assert streamed(parser, list(text)) == whole, (parser, text)


class Scripted:
    """The real runner, each sampled token replaced by the script's token at that output position (the
    tool script when the prompt lists tools), then EOS: the model's own choice with the text forced."""

    def __init__(self, runner: ModelRunner, tokenizer) -> None:
        self.runner, self.tokenizer = runner, tokenizer
        self.states = RequestStates()  # the plans carry a request's prompt once: kept here
        self.scripts = {False: tokenizer.encode(REPLY, add_special_tokens=False),
                        True: tokenizer.encode(TOOL_REPLY, add_special_tokens=False)}

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, plan):
        result = self.runner.execute(plan)
        for i, (s, token) in enumerate(zip(self.states.resolve(plan).scheduled, result.sampled)):
            if token >= 0:
                script = self.scripts["<tools>" in self.tokenizer.decode(s.prompt_token_ids)]
                result.sampled[i] = script[s.output_len] if s.output_len < len(script) else self.tokenizer.eos_token_id
        return result


@pytest.fixture(scope="module")
def server(tmp_path_factory, think_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("tiny-think")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(think_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=think_tokenizer.eos_token_id)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    think_tokenizer.save_pretrained(path)
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=128)
    runner = ModelRunner(config)
    s = start_server(Engine(config, Scripted(runner, runner.tokenizer)), reasoning_parser="deepseek_r1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


HI = [{"role": "user", "content": "Hi!"}]


@pytest.mark.slow
def test_reasoning_content_whole_and_streamed(client, server):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=64)
    m = r.choices[0].message
    assert m.content == "Hello there!" and r.choices[0].finish_reason == "stop"
    assert m.reasoning_content == m.reasoning == "The user greets me. I greet back."
    reasoning = content = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=HI, max_tokens=64, stream=True):
        delta = chunk.choices[0].delta
        assert getattr(delta, "reasoning", None) == getattr(delta, "reasoning_content", None)
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == ("The user greets me. I greet back.", "Hello there!")
    assert no_leaks(server)


@pytest.mark.slow
def test_tool_calls_come_from_the_content_part(client):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=HI, tools=[tool], max_tokens=64, stream=stream)
        if stream:
            deltas = [c.choices[0].delta for c in r if c.choices and c.choices[0].delta]
            calls = [c for d in deltas for c in d.tool_calls or []]
            reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        else:
            calls, reasoning = r.choices[0].message.tool_calls, r.choices[0].message.reasoning_content
            assert r.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in calls] == ["get_weather"], stream
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
        assert reasoning == "Weather: call the tool."


@pytest.mark.slow
def test_responses_reasoning_item_whole_and_streamed(client):
    r = client.responses.create(model=MODEL, input="Hi!", max_output_tokens=64)
    assert [i.type for i in r.output] == ["reasoning", "message"] and r.output_text == "Hello there!"
    assert r.output[0].content[0].text == "The user greets me. I greet back."
    with client.responses.stream(model=MODEL, input="Hi!", max_output_tokens=64) as stream:
        reasoning = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert reasoning == final.output[0].content[0].text == "The user greets me. I greet back."
    assert final.output_text == "Hello there!"


@pytest.mark.slow
def test_messages_thinking_block(server):
    import anthropic
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    blocks = lambda m: [(b.type, getattr(b, "thinking", None) or b.text) for b in m.content]  # noqa: E731
    m = client.messages.create(model=MODEL, max_tokens=64, messages=HI)
    assert blocks(m) == [("thinking", "The user greets me. I greet back."), ("text", "Hello there!")]
    with client.messages.stream(model=MODEL, max_tokens=64, messages=HI) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(m) and final.stop_reason == m.stop_reason == "end_turn"
