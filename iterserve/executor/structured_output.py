"""Structured output with xgrammar: each constraint compiled once and cached, a matcher per request
that follows the request's output tokens, one token bitmask for the step's constrained rows.

The server compiles a request's grammar in a worker thread before the request reaches the engine
(a bad schema is a 400 there), so the step loop only finds it in the cache (a tensor-parallel rank
compiles it on first use).

One source of truth: the request's output, as the scheduler appended it. A matcher advances only on
the output tokens the executor's request state holds (executor/request_state.py: a new request's
output, then each plan's output deltas), never on a token it just sampled, which may not join the
output (a stop string, an abort, a preemption). It is a cache of (grammar, output) and is rebuilt
from the output whenever it is ahead of it. So under tensor parallelism every rank keeps its own
matchers, fed the same deltas, and all reach the same state with no traffic between them: a rank
that never sampled a request's earlier tokens (a request handed over by a prefill engine, a rank's
matcher rebuilt) replays them from its state. A driver that owned the matchers and shipped each
step's bitmask rows would keep the grammar work off the ranks, but would run the sampler's
steering (below) in another process than the sampler, and TP=1 and TP=N through different code.

Near the end of its max_tokens a request is steered to the shortest completion of its grammar
(close the string, the arrays, the objects, the required keys left), so an object that would run
out mid-value ends parsed with finish_reason "stop"; "length" only when even that did not fit.
Within _WATCH spare tokens of that completion each sampled token is checked: one that would leave
too few (a new array item, an object with required keys) is replaced by the completion's next one.
With no spare token left, the completion's next token is forced: its row's bitmask is left full and
the sampled token replaced, since xgrammar's CPU kernel pays for each token a row masks out (one
token allowed of a whole vocabulary, every row, every step) and nothing for a full row. Where not
even the completion fits (a minLength beyond max_tokens), nothing is forced: filler would end in
"length" all the same, so the model writes on, and the completion is looked at again as it does.
"""
from __future__ import annotations

import json
import string
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xgrammar as xgr

from iterserve.executor.grammar_bounds import json_grammar
from iterserve.sampling_params import StructuredOutputs
from iterserve.scheduler.output import ScheduledRequest

_CACHE_SIZE = 256  # compiled grammars kept per tokenizer
# Characters tried, in order, when a completion is not forced: closers first (a string's quote
# first inside a string, where "]" and "}" would only lengthen it), then a number's digit, then
# whatever a string or an enum may need.
_OTHERS = "," + string.digits + string.ascii_lowercase + string.ascii_uppercase + string.punctuation + " "
_TRIED_IN_STRING = '"]}' + _OTHERS
_TRIED = ']}"' + _OTHERS
_MAX_COMPLETION = 512  # characters; a grammar needing more is not steered
_WATCH = 24  # spare tokens below which each sampled token is checked (one token rarely adds more)
_RECHECK = 32  # steps between looks at the completion while far from the end
_TOKEN_BYTES = 16  # longest token tried when tokenizing a completion
_MAX_CHARS_PER_TOKEN = 8  # a completion the model's own token can shorten by at most ~this many filler tokens
_RUN = 15  # characters more at a time in a string that cannot close yet: the search's steps, not its length


class GrammarCache:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        hf = tokenizer.as_transformers() if hasattr(tokenizer, "as_transformers") else tokenizer  # xgrammar reads HF's
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(eos_token_ids)
        self._by_bytes = _short_tokens(info, set(info.special_token_ids) | eos_token_ids)
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
        if spec.json is not None or spec.json_object:
            return c.compile_grammar(json_grammar(spec.json))
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
        return c.compile_grammar(spec.grammar)

    def tokens(self, text: str) -> list[int] | None:
        """Tokens whose bytes are `text`, longest first (None: the vocabulary cannot spell it)."""
        data, out, i = text.encode(), [], 0
        while i < len(data):
            j = next((j for j in range(min(len(data), i + _TOKEN_BYTES), i, -1) if data[i:j] in self._by_bytes), None)
            if j is None:
                return None
            out.append(self._by_bytes[data[i:j]])
            i = j
        return out


def _short_tokens(info: xgr.TokenizerInfo, special: set[int]) -> dict[bytes, int]:
    """Bytes -> the first ordinary token spelling them, for tokens of at most _TOKEN_BYTES."""
    out: dict[bytes, int] = {}
    for i, b in enumerate(info.decoded_vocab):
        if i not in special and 0 < len(b) <= _TOKEN_BYTES:
            out.setdefault(b, i)
    return out


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
    check_below: float = float("inf")  # tokens left at which to look at the shortest completion again
    watching: bool = False  # near the end: each sampled token is checked against the tokens left
    plan: list[int] | None = None  # tokens of a shortest completion after num_accepted == plan_at
    plan_at: int = -1
    forced: int | None = None  # this step's token when no spare token is left; None: sampled


class Matchers:
    """The matchers of the running constrained requests, by request id."""

    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self.by_id: dict[str, _Tracked] = {}

    def drop(self, request_id: str) -> None:
        self.by_id.pop(request_id, None)

    def bitmask(self, reqs: list[ScheduledRequest]) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed tokens of each constrained row (reqs: the sampling rows), or None if none is. A
        forced row allows all: accept sets its token."""
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.structured_outputs is not None]
        if not rows:
            return None
        mask = xgr.allocate_token_bitmask(len(reqs), self.cache.vocab_size)
        for i in rows:
            t = self._synced(reqs[i])
            t.forced = self._steered(reqs[i], t)
            if t.forced is None:
                t.matcher.fill_next_token_bitmask(mask, i)
        return mask, rows

    def accept(self, reqs: list[ScheduledRequest], tokens: list[int], rows: list[int]) -> None:
        """Near the end, set in `tokens` the forced ones and replace one that leaves no room. The
        matchers take the tokens when they join the output (the next plan's deltas)."""
        for i in rows:
            t = self.by_id[reqs[i].request_id]
            if t.forced is not None:
                tokens[i] = t.forced
            if t.watching:
                tokens[i] = self._checked(reqs[i], t, tokens[i])

    def _steered(self, r: ScheduledRequest, t: _Tracked) -> int | None:
        """The one token allowed once the tokens left just fit the shortest completion and a stop
        token; None while the model is free. Looked at every _RECHECK steps, or sooner as the
        spare tokens halve: the search runs on few steps, but on every one near the end."""
        left = r.sampling_params.max_tokens - r.output_len
        if left > t.check_below:
            return None
        plan = self._plan(t)
        spare = left - (len(plan) + 1) if plan is not None else _WATCH + 2 * _RECHECK
        if spare < -1:  # not even the completion fits: forcing it would only write filler to the same "length"
            t.watching = False  # the model stays free, looked at again as soon as its tokens could have made room
            t.check_below = left - max(1, min(_RECHECK, -spare // _MAX_CHARS_PER_TOKEN))
            return None
        t.watching = spare <= _WATCH
        t.check_below = left if t.watching else left - min(_RECHECK, (spare - _WATCH + 1) // 2)
        if spare > 0:
            return None
        return plan[0] if plan else self.cache.stop_token_ids[0]

    def _checked(self, r: ScheduledRequest, t: _Tracked, token: int) -> int:
        """`token`, unless the completion after it no longer fits the tokens left after it: then the
        completion's next token (the plan of this step, which fits). A token that follows the plan
        leaves the rest of the plan, with no search."""
        if t.plan and t.plan_at == t.num_accepted and token == t.plan[0]:
            t.plan, t.plan_at = t.plan[1:], t.num_accepted + 1
            return token
        left = r.sampling_params.max_tokens - r.output_len - 1
        m = t.matcher.fork()
        after = shortest_completion(m) if m.accept_token(token) else None
        plan = self.cache.tokens(after) if after is not None else None
        if plan is not None and len(plan) + 1 <= left:
            t.plan, t.plan_at = plan, t.num_accepted + 1
            return token
        current = self._plan(t)
        if not current:  # complete (or no plan): stop here rather than run out
            return self.cache.stop_token_ids[0] if current == [] else token
        t.plan, t.plan_at = current[1:], t.num_accepted + 1
        return current[0]

    def _plan(self, t: _Tracked) -> list[int] | None:
        """The tokens of a shortest completion from the matcher's state, kept for the step they are of."""
        if t.plan_at != t.num_accepted:
            completion = shortest_completion(t.matcher)
            t.plan = self.cache.tokens(completion) if completion is not None else None
            t.plan_at = t.num_accepted
        return t.plan

    def _synced(self, r: ScheduledRequest) -> _Tracked:
        """The request's matcher, having accepted its output (r: a row resolved against the request state)."""
        t = self.by_id.get(r.request_id)
        if t is None or t.num_accepted > r.output_len:
            compiled = self.cache.compile(r.sampling_params.structured_outputs)
            t = self.by_id[r.request_id] = _Tracked(xgr.GrammarMatcher(compiled))
        for token in r.output_token_ids[t.num_accepted:r.output_len]:
            if not t.matcher.accept_token(token):
                break  # the output left the grammar (it cannot, masked): stop following it
            t.num_accepted += 1
        return t


def shortest_completion(matcher: xgr.GrammarMatcher) -> str | None:
    """A short text that completes the grammar from the matcher's state (None: none found): what
    the grammar forces, else the first character of _TRIED (_TRIED_IN_STRING) it accepts. Not always the shortest (it opens an
    object before it tries null), but short and always valid."""
    m, out, size = matcher.fork(), [], 0
    while not m.is_completed():
        if size > _MAX_COMPLETION:
            return None
        forced = m.find_jump_forward_string()
        if forced and m.accept_string(forced):
            out.append(forced)
            size += len(forced)
            continue
        in_string = _in_string(m)
        tried = next((c for c in (_TRIED_IN_STRING if in_string else _TRIED) if m.accept_string(c)), None)
        if tried is None:
            return None
        if in_string and tried != '"' and m.accept_string(tried * _RUN):
            tried *= _RUN + 1  # a string that cannot close yet (minLength) fills a run at a time
        out.append(tried)
        size += len(tried)
    return "".join(out)


def _in_string(m: xgr.GrammarMatcher) -> bool:
    """Inside a string a space is text; outside one, without free whitespace, it is refused."""
    if m.accept_string(" "):
        m.rollback(1)
        return True
    return False


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
