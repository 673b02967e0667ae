"""Speculative decoding and text: stop strings inside an accepted run cut exactly where one-token decoding
cuts, streamed deltas carry several tokens a step, and /metrics counts drafts (fake model, real tokenizer)."""
from __future__ import annotations

import httpx
import openai
import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.sampling_params import SamplingParams
from tests.loop_executor import LoopExecutor
from tests.server.conftest import MODEL, metric, no_leaks, start_server, wait_for

WORDS = " the cat sat on a mat and then it ran far away".split(" ")[1:]
SPEC = dict(speculative_method="ngram", num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=3)


class WordLoopExecutor(LoopExecutor):
    """Says the words of WORDS in a loop: after a word, the next one; after anything else, the first."""

    def __init__(self, tokenizer, **kwargs) -> None:
        super().__init__(vocab_size=len(tokenizer), num_kv_blocks=512, **kwargs)
        self.tokenizer = tokenizer
        self.words = [tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in WORDS]

    def next_token(self, last: int, pos: int) -> int:
        return self.words[(self.words.index(last) + 1) % len(self.words)] if last in self.words else self.words[0]


def engine(tokenizer, spec: bool) -> Engine:
    return Engine(EngineConfig(max_num_batched_tokens=4096, **(SPEC if spec else {})), WordLoopExecutor(tokenizer))


def generate(engine: Engine, prompt: str, params: SamplingParams):
    """The final output and what the stream carried: concatenated new_text and new_token_ids."""
    rid = engine.add_request(prompt, params)
    text, tokens, steps = "", [], 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            text += out.new_text
            tokens += out.new_token_ids
            final = out
        steps += 1
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    return final, text, tokens, steps


PROMPT = "the cat sat on a mat and then it ran far away the cat sat on"


@pytest.mark.parametrize("params", [
    dict(stop=["ran far"]), dict(stop=["ran far"], include_stop_str_in_output=True), dict(stop=["then it"]),
    dict(stop=["it ran"], max_tokens=12),
    dict(stop=["it ran"], max_tokens=7),  # the run also reaches max_tokens: the stop string still wins
    dict(stop=["away"], min_tokens=14), dict(max_tokens=9), dict(stop=["never said"], max_tokens=25)])
def test_stop_strings_and_max_tokens_inside_an_accepted_run(tokenizer, params):
    params = {"max_tokens": 40, "temperature": 0, **params}
    want, _, _, plain_steps = generate(engine(tokenizer, False), PROMPT, SamplingParams(**params))
    spec_engine = engine(tokenizer, True)
    got, streamed_text, streamed_tokens, steps = generate(spec_engine, PROMPT, SamplingParams(**params))
    assert got.token_ids == want.token_ids and got.text == want.text
    assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
    assert streamed_text == got.text and streamed_tokens == got.token_ids
    assert len(got.times.token_times) == len(got.token_ids)
    assert spec_engine.stats.num_spec_accepted_tokens > 0 and steps < plain_steps


def test_server_streams_several_tokens_a_step_and_counts_drafts(tokenizer):
    server = start_server(engine(tokenizer, True))
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        params = SamplingParams(max_tokens=30, temperature=0, stop=["far"])
        want = generate(engine(tokenizer, False), PROMPT, params)[0]
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=["far"])
        assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == len(want.token_ids)
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                                stop=["far"], stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        text = httpx.get(server.url + "/metrics").text
        drafted = metric(text, "iterserve:spec_decode_num_draft_tokens_total")
        accepted = metric(text, "iterserve:spec_decode_num_accepted_tokens_total")
        assert drafted >= accepted > 0 and metric(text, "iterserve:spec_decode_num_drafts_total") > 0
        assert metric(text, "iterserve:generation_tokens_total") == 2 * len(want.token_ids)
        wait_for(lambda: no_leaks(server), 10, "the server still holds request state")
    finally:
        server.stop()


def test_the_status_line_shows_the_acceptance(tokenizer, caplog):
    from iterserve.server.status_log import _StatusLine
    spec_engine = engine(tokenizer, True)
    generate(spec_engine, PROMPT, SamplingParams(max_tokens=20, temperature=0))
    stats, line = spec_engine.stats, _StatusLine(interval=0.0)
    with caplog.at_level("INFO", logger="iterserve"):
        line.maybe_log(stats, [])
        line.maybe_log(stats, [])
    rate = 100 * stats.num_spec_accepted_tokens / stats.num_spec_draft_tokens
    assert f"drafts accepted {rate:.1f}% ({stats.spec_mean_accepted_len:.2f} tokens a drafted step)" in caplog.text
