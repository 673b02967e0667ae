"""Prompt-lookup (n-gram) speculative decoding: the proposer, and which requests it drafts for.

After a request's token is sampled, the proposer looks for the most recent earlier occurrence of the
request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its prompt + output,
and proposes the up to k tokens that followed it there. The scheduler schedules those drafts with
the request's own token (the one rule: num_tokens + drafts - num_computed_tokens new tokens), the
model runner computes logits at every one of them and keeps the longest prefix the model agrees with
(greedy: its argmax; random: rejection sampling), plus the model's own token after it
(docs/performance.md).

Plain Python over token ids, no torch: the engine calls it between steps.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

from iterserve.sampling_params import SamplingParams

_ITEM = array("i").itemsize  # token ids as 32-bit ints: bytes.rfind then searches in C


@dataclass(slots=True, frozen=True)
class NgramProposer:
    num_speculative_tokens: int  # k: most drafts per request per step
    prompt_lookup_min: int
    prompt_lookup_max: int

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_drafts) tokens that followed the latest earlier occurrence of the
        sequence's longest matching suffix (longest n first); [] when no n-gram recurs."""
        k = self.num_speculative_tokens if max_drafts is None else min(self.num_speculative_tokens, max_drafts)
        if k <= 0 or len(token_ids) < self.prompt_lookup_min + 1:
            return []
        hay = array("i", token_ids).tobytes()
        for n in range(min(self.prompt_lookup_max, len(token_ids) - 1), self.prompt_lookup_min - 1, -1):
            start = _latest_earlier(hay, len(token_ids), n)
            if start is not None:
                return token_ids[start + n:start + n + k]
        return []


def _latest_earlier(hay: bytes, num_tokens: int, n: int) -> int | None:
    """Start of the latest occurrence of the last n tokens that ends before the last token."""
    suffix = hay[(num_tokens - n) * _ITEM:]
    end = (num_tokens - 1) * _ITEM  # the occurrence must end before the last token: a token follows it
    while True:
        at = hay.rfind(suffix, 0, end)
        if at < 0:
            return None
        if at % _ITEM == 0:
            return at // _ITEM
        end = at + len(suffix) - 1  # a match across token boundaries: look further back


def draftable(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether drafts for this request verify to what one-token decoding produces: the same tokens
    (greedy), or tokens of the same distribution (random sampling, by rejection sampling).

    Requests with per-token state are not drafted: each draft row is verified with the same logits
    processing, so anything that changes the logits from one output position to the next (penalties,
    logit_bias, min_tokens still banning stop tokens, a grammar's bitmask) or reports per token
    (logprobs, prompt logprobs) would need its own per-position bookkeeping. Nor are seeded random
    requests: how many drafts a step verifies depends on the batch (the token budget), so their draws,
    and their output, would too. These requests decode one token a step, as before."""
    return ((params.temperature == 0.0 or params.seed is None) and params.logprobs is None
            and params.prompt_logprobs is None and params.structured_outputs is None and not params.has_penalties
            and not params.logit_bias and num_output_tokens >= params.min_tokens)
