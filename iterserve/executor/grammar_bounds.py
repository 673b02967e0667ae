"""JSON grammars whose numbers cannot run away: a small model greedy-decoding `"population": 1`
repeats the digit until max_tokens, since JSON puts no limit on a number's length.

Integers get at most 18 digits (any such value fits an int64), numbers 15 integer digits, 15
fraction digits and a 3-digit exponent. xgrammar bounds a number itself when the schema gives both
`minimum` and `maximum` (or the exclusive forms), but not when it gives one: the other side is
filled in. Unbounded ones use xgrammar's shared `basic_integer` / `basic_number` rules, which are
rewritten in the grammar's EBNF. There is no free whitespace (any_whitespace=False), and
`maxLength` / `maxItems` / `minimum` / `maximum` are xgrammar's own.
"""
from __future__ import annotations

import json
import re

import xgrammar as xgr

INT_LIMIT = 10**18 - 1
NUMBER_LIMIT = 1e15
_RULES = {
    "basic_integer": '"0" | "-"? [1-9] [0-9]{0,17}',
    "basic_number": '"-"? ("0" | [1-9] [0-9]{0,14}) ("." [0-9]{1,15})? ([eE] [+-]? [0-9]{1,3})?',
}
_RULE_LINE = re.compile(r"^(basic_integer|basic_number) ::= .*$", re.MULTILINE)
_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples"})  # values, never subschemas


def json_grammar(schema: str | None) -> xgr.Grammar:
    """The grammar of a JSON schema (None: any JSON object), its numbers bounded."""
    text = json.dumps(_bounded(json.loads(schema))) if schema is not None else '{"type": "object"}'
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    return xgr.Grammar.from_ebnf(_RULE_LINE.sub(lambda m: f"{m[1]} ::= {_RULES[m[1]]}", str(grammar)))


def _bounded(node):
    """The schema with every one-sided integer or number bound made two-sided."""
    if isinstance(node, list):
        return [_bounded(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _NOT_SCHEMAS else _bounded(v) for k, v in node.items()}
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    limit = INT_LIMIT if "integer" in types else NUMBER_LIMIT if "number" in types else None
    if limit is not None:
        _fill(out, "minimum", "maximum", -limit)
        _fill(out, "maximum", "minimum", limit)
    return out


def _fill(schema: dict, side: str, other: str, limit: float) -> None:
    """Give `side` the limit when only the other side is bounded, and the limit leaves a range."""
    given = [schema[k] for k in (other, "exclusive" + other.title()) if isinstance(schema.get(k), (int, float))]
    if side in schema or "exclusive" + side.title() in schema or not given:
        return
    if all(abs(g) <= abs(limit) for g in given):
        schema[side] = limit
