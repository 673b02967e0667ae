"""Structured output with xgrammar: each constraint compiled once and cached, a matcher per request
that follows the request's output tokens, one token bitmask for the step's constrained rows.

The server compiles a request's grammar in a worker thread before the request reaches the engine
(a bad schema is a 400 there), so the step loop only finds it in the cache. A matcher is checked
against the request's output before each use: tokens it has not seen are accepted, and if it is
ahead (a sampled token that never joined the output) it is rebuilt from the output, so preemption,
swaps and aborts cannot leave it out of step.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xgrammar as xgr

from iterserve.sampling_params import StructuredOutputs
from iterserve.scheduler.output import ScheduledRequest

_CACHE_SIZE = 256  # compiled grammars kept per tokenizer


class GrammarCache:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        hf = tokenizer.as_transformers() if hasattr(tokenizer, "as_transformers") else tokenizer  # xgrammar reads HF's
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[StructuredOutputs, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """ValueError if xgrammar cannot compile it (a bad schema, regex or grammar)."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured output: {e}") from None
        with self._lock:
            self._compiled[spec] = compiled
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        c = self.compiler
        if spec.json is not None:  # no free whitespace: a small model would pad with it forever
            return c.compile_json_schema(spec.json, any_whitespace=False, strict_mode=True)
        if spec.json_object:
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
        return c.compile_grammar(spec.grammar)


_CACHES: dict[tuple[int, int], GrammarCache] = {}
_CACHES_LOCK = threading.Lock()


def grammar_cache(tokenizer, vocab_size: int, eos_token_ids: set[int]) -> GrammarCache:
    """One per (tokenizer, vocabulary): the server warms it, the model runner reads it."""
    key = (id(tokenizer), vocab_size)
    with _CACHES_LOCK:
        if key not in _CACHES:
            _CACHES[key] = GrammarCache(tokenizer, vocab_size, eos_token_ids)
        return _CACHES[key]


@dataclass(slots=True)
class _Tracked:
    matcher: xgr.GrammarMatcher
    num_accepted: int = 0


class Matchers:
    """The matchers of the running constrained requests, by request id."""

    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self.by_id: dict[str, _Tracked] = {}

    def drop(self, request_id: str) -> None:
        self.by_id.pop(request_id, None)

    def bitmask(self, reqs: list[ScheduledRequest]) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed tokens of each constrained row (reqs: the sampling rows), or None if none is."""
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.structured_outputs is not None]
        if not rows:
            return None
        mask = xgr.allocate_token_bitmask(len(reqs), self.cache.vocab_size)
        for i in rows:
            self._synced(reqs[i]).matcher.fill_next_token_bitmask(mask, i)
        return mask, rows

    def accept(self, reqs: list[ScheduledRequest], tokens: list[int], rows: list[int]) -> None:
        for i in rows:
            t = self.by_id[reqs[i].request_id]
            if t.matcher.accept_token(tokens[i]):
                t.num_accepted += 1

    def _synced(self, r: ScheduledRequest) -> _Tracked:
        t = self.by_id.get(r.request_id)
        if t is None or t.num_accepted > r.output_len:
            compiled = self.cache.compile(r.sampling_params.structured_outputs)
            t = self.by_id[r.request_id] = _Tracked(xgr.GrammarMatcher(compiled))
        for token in r.output_token_ids[t.num_accepted:r.output_len]:
            if not t.matcher.accept_token(token):
                break  # the output left the grammar (it cannot, masked): stop following it
            t.num_accepted += 1
        return t


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
