"""Matchers follow each request's output: caught up after steps they did not see, never moved by a
sampled token until it joins the output, rebuilt when they are ahead of it; one bitmask for the
constrained rows only."""
from __future__ import annotations

import pytest
import torch

from iterserve.sampling_params import SamplingParams, StructuredOutputs
from iterserve.scheduler.output import ScheduledRequest

xgr = pytest.importorskip("xgrammar")


def allowed(matchers, req) -> set[int]:
    mask, rows = matchers.bitmask([req])
    logits = torch.zeros(1, matchers.cache.vocab_size)
    from iterserve.executor.structured_output import apply_bitmask
    apply_bitmask(logits, mask, rows)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_matchers_catch_up_and_rebuild(tokenizer):
    from iterserve.executor.structured_output import Matchers, grammar_cache
    cache = grammar_cache(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    params = SamplingParams(structured_outputs=StructuredOutputs(regex="abc|abd"))
    m = Matchers(cache)
    a, b, c, d = (tokenizer.convert_tokens_to_ids(x) for x in "abcd")
    output: list[int] = []
    req = lambda: ScheduledRequest("r", [a], 0, [0], True, params, len(output), output_token_ids=output)  # noqa: E731
    assert a in allowed(m, req()) and b not in allowed(m, req())
    output += [a, b]  # two steps the matcher never saw (as after a swap or a recompute)
    assert allowed(m, req()) >= {c, d} and a not in allowed(m, req())
    m.accept([req()], [c], [0])  # sampled, but the request is preempted before it joins the output
    assert m.by_id["r"].num_accepted == 2 and len(output) == 2
    assert allowed(m, req()) >= {c, d}  # c is allowed again
    del output[1:]  # an output shorter than the matcher has taken: rebuilt from it
    assert b in allowed(m, req()) and c not in allowed(m, req())
    output += [b]
    other = ScheduledRequest("free", [a], 0, [0], True, SamplingParams(), 0)
    mask, rows = m.bitmask([other, req()])
    assert rows == [1] and mask.shape[0] == 2
    assert m.bitmask([other]) is None
