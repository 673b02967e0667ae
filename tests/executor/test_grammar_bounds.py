"""JSON grammars bound what a number can be, and a request near the end of its max_tokens is steered
to the shortest completion: a model that would repeat a digit or a letter forever still ends parsed."""
from __future__ import annotations

import json

import pytest

from iterserve.sampling_params import SamplingParams, StructuredOutputs
from iterserve.scheduler.output import ScheduledRequest

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def cache(tokenizer):
    from iterserve.executor.structured_output import grammar_cache
    return grammar_cache(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


def matcher(cache, schema: dict | None, prefix: str = ""):
    """A matcher of the schema (None: any object) that has accepted `prefix`."""
    spec = StructuredOutputs(json=json.dumps(schema)) if schema is not None else StructuredOutputs(json_object=True)
    m = xgr.GrammarMatcher(cache.compile(spec))
    assert m.accept_string(prefix), prefix
    return m


def accepts(cache, schema: dict | None, text: str) -> bool:
    m = matcher(cache, schema)
    return m.accept_string(text) and m.is_completed()


INT = {"type": "integer"}
NUM = {"type": "number"}


def test_integers_have_at_most_18_digits_bounded_or_not(cache):
    for schema in (INT, {"type": "integer", "minimum": 0}, {"type": "integer", "exclusiveMaximum": 7},
                   {"type": ["integer", "null"]}):
        assert not accepts(cache, schema, "1" * 19), schema
    assert accepts(cache, INT, "-" + "9" * 18) and accepts(cache, INT, "0") and not accepts(cache, INT, "01")
    assert accepts(cache, {"type": "integer", "minimum": 0}, "9" * 18)
    assert not accepts(cache, {"type": "integer", "minimum": 0}, "-1")
    assert accepts(cache, {"type": "integer", "exclusiveMaximum": 7}, "-" + "9" * 18)


def test_numbers_have_bounded_digits_and_exponent(cache):
    assert accepts(cache, NUM, "-" + "9" * 15 + "." + "1" * 15 + "e+123")
    for too_long in ("1" * 16, "1." + "1" * 16, "1e1234"):
        assert not accepts(cache, NUM, too_long), too_long
    assert not accepts(cache, {"type": "number", "minimum": 0}, "1" * 17)
    assert accepts(cache, None, '{"x": [1.5e3, -2]}') and not accepts(cache, None, '{"x": ' + "1" * 16 + "}")


def test_maximum_max_items_max_length_and_no_free_whitespace(cache):
    assert accepts(cache, {"type": "integer", "maximum": 100, "minimum": 0}, "100")
    assert not accepts(cache, {"type": "integer", "maximum": 100}, "101")
    assert not accepts(cache, {"type": "number", "maximum": 100}, "100.5")
    items = {"type": "array", "items": INT, "maxItems": 3}
    assert accepts(cache, items, "[1, 2, 3]") and not accepts(cache, items, "[1, 2, 3, 4]")
    text = {"type": "string", "maxLength": 5}
    assert accepts(cache, text, '"abcde"') and not accepts(cache, text, '"abcdef"')
    assert not accepts(cache, None, '{ "a": 1}') and not accepts(cache, {"type": "array", "items": INT}, "[1,  2]")


CITY = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "kind", "population", "area"],
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                       "kind": {"enum": ["capital", "town"]}, "population": INT, "area": NUM,
                       "note": {"type": "string"}}}


@pytest.mark.parametrize("prefix", ["", '{"name": "Pa', '{"name": "P", "tags": ["a", "b', '{"name": "P", "tags": [',
                                    '{"name": "P", "tags": [], "kind": "ca', '{"name": "P", "tags": [], "kind": "town", '
                                    '"population": 12', '{"name": "P", "tags": [], "kind": "town", "population": 1, '
                                    '"area": 1.'])
def test_shortest_completion_completes_the_object(cache, prefix):
    from iterserve.executor.structured_output import shortest_completion
    completion = shortest_completion(matcher(cache, CITY, prefix))
    obj = json.loads(prefix + completion)
    assert set(obj) == {"name", "tags", "kind", "population", "area"} and obj["kind"] in ("capital", "town")
    assert "note" not in completion and '""]' not in completion  # optional keys and array items left out


def test_shortest_completion_of_any_object(cache):
    from iterserve.executor.structured_output import shortest_completion
    prefix = '{"a": [{"b": "x'
    assert json.loads(prefix + shortest_completion(matcher(cache, None, prefix))) == {"a": [{"b": "x"}]}


def runaway_choice(allowed: set[int], prefer: list[int]) -> int:
    """An adversarial model: the first of `prefer` it may take (more digits, more letters, more items)."""
    return next((t for t in prefer if t in allowed), min(allowed))


@pytest.mark.parametrize("max_tokens", [40, 64, 200])
@pytest.mark.parametrize("spec", [StructuredOutputs(json=json.dumps(CITY)), StructuredOutputs(json_object=True)])
@pytest.mark.parametrize("habit", [("1", "a", '",', "{", "["),  # longer values
                                   ("[", "{", ",", '",', '"', "1", "a")])  # more items, keys, nesting
def test_a_runaway_model_is_steered_to_a_parsed_object(cache, tokenizer, spec, max_tokens, habit):
    from tests.executor.test_structured_output import allowed
    from iterserve.executor.structured_output import Matchers
    m = Matchers(cache)
    params = SamplingParams(max_tokens=max_tokens, structured_outputs=spec)
    prefer = [tokenizer.convert_tokens_to_ids(t) for t in habit]
    output: list[int] = []
    while len(output) < max_tokens and tokenizer.eos_token_id not in output:
        req = ScheduledRequest("r", [0], 0, [0], True, params, len(output), output_token_ids=output)
        tokens = [runaway_choice(allowed(m, req), prefer)]
        m.accept([req], tokens, [0])  # may replace the token with one that leaves room to finish
        output.append(tokens[0])
    assert output[-1] == tokenizer.eos_token_id, tokenizer.decode(output)
    assert isinstance(json.loads(tokenizer.decode(output[:-1])), dict)


def test_a_forced_row_keeps_a_full_mask_and_gets_its_token_in_accept(cache, tokenizer):
    """No spare token left: the completion's next token is forced, not masked (xgrammar's CPU kernel pays
    for each masked-out token, nothing for a full row); a free row in the same step is masked as usual."""
    from iterserve.executor.structured_output import Matchers, shortest_completion
    m = Matchers(cache)
    prefix = '{"name": "Paris'
    output = cache.tokens(prefix)
    plan = cache.tokens(shortest_completion(matcher(cache, CITY, prefix)))
    spec = StructuredOutputs(json=json.dumps(CITY))
    tight = SamplingParams(max_tokens=len(output) + len(plan) + 1, structured_outputs=spec)  # plan + stop
    roomy = SamplingParams(max_tokens=len(output) + len(plan) + 60, structured_outputs=spec)
    reqs = [ScheduledRequest(rid, [0], 0, [0], True, p, len(output), output_token_ids=output)
            for rid, p in (("tight", tight), ("roomy", roomy))]
    mask, rows = m.bitmask(reqs)
    assert rows == [0, 1] and bool((mask[0] == -1).all()) and not bool((mask[1] == -1).all())
    x = tokenizer.convert_tokens_to_ids("x")  # what a sampler drew from the full row
    tokens = [x, x]
    m.accept(reqs, tokens, rows)
    assert tokens == [plan[0], x]


def test_a_completion_that_cannot_fit_leaves_the_model_free(cache, tokenizer):
    """A completion longer than the tokens left: forcing it would write filler to the same "length", so
    the row is masked by the grammar alone and its sampled token kept; with room again it is steered."""
    from iterserve.executor.structured_output import Matchers, shortest_completion
    prefix = '{"name": "Paris'
    output = cache.tokens(prefix)
    plan = cache.tokens(shortest_completion(matcher(cache, CITY, prefix)))
    spec = StructuredOutputs(json=json.dumps(CITY))
    for extra, forced in ((-2, False), (-1, False), (0, True), (1, True)):  # max_tokens - output - plan
        m = Matchers(cache)
        params = SamplingParams(max_tokens=len(output) + len(plan) + extra, structured_outputs=spec)
        reqs = [ScheduledRequest("r", [0], 0, [0], True, params, len(output), output_token_ids=output)]
        mask, rows = m.bitmask(reqs)
        assert bool((mask[0] == -1).all()) == forced, extra
        x = tokenizer.convert_tokens_to_ids("x")  # allowed inside the open string
        tokens = [x]
        m.accept(reqs, tokens, rows)
        assert tokens == ([plan[0]] if forced else [x]), extra
