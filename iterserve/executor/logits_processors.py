"""What changes a step's logits before sampling: a grammar's bitmask, min_tokens, logit_bias, penalties.

vLLM's semantics and order: the structured-output bitmask (executor/structured_output.py) allows
only the tokens the grammar can take, min_tokens bans the stop tokens, logit_bias adds, then repetition
(divide a positive logit, multiply a negative one, for tokens in the prompt or the output),
frequency (minus penalty x times generated) and presence (minus penalty if generated at all).
Built only from the rows that ask for one: a batch where nobody does builds nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from iterserve.scheduler.output import ScheduledRequest


@dataclass(slots=True)
class Penalties:
    rows: torch.Tensor  # [R] the batch rows with a penalty
    presence: torch.Tensor  # [R, 1]
    frequency: torch.Tensor  # [R, 1]
    repetition: torch.Tensor  # [R, 1]
    output_counts: torch.Tensor  # [R, vocab] times each token was generated
    seen: torch.Tensor | None  # [R, vocab] bool: in the prompt or the output; None: no repetition penalty


@dataclass(slots=True)
class LogitsAdjust:
    allowed: tuple[torch.Tensor, list[int]] | None  # (xgrammar token bitmask, its rows)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, bias) added
    penalties: Penalties | None


def make_adjust(reqs: list[ScheduledRequest], eos_token_ids: set[int], vocab_size: int,
                device: torch.device, allowed: tuple[torch.Tensor, list[int]] | None = None) -> LogitsAdjust | None:
    """reqs: the sampling rows, in batch order. None when no row needs any of these."""
    banned_r, banned_t, bias_r, bias_t, bias_v, pen = [], [], [], [], [], []
    for i, r in enumerate(reqs):
        p = r.sampling_params
        if r.output_len < p.min_tokens:
            stops = [t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab_size]
            banned_r += [i] * len(stops)
            banned_t += stops
        if p.logit_bias:
            bias_r += [i] * len(p.logit_bias)
            bias_t += p.logit_bias.keys()
            bias_v += p.logit_bias.values()
        if p.has_penalties:
            pen.append(i)
    if not (banned_r or bias_r or pen or allowed):
        return None
    ints = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return LogitsAdjust(
        allowed=allowed,
        banned=(ints(banned_r), ints(banned_t)) if banned_r else None,
        bias=(ints(bias_r), ints(bias_t), torch.tensor(bias_v, dtype=torch.float32, device=device)) if bias_r else None,
        penalties=_penalties([reqs[i] for i in pen], ints(pen), vocab_size, device) if pen else None)


def _penalties(reqs: list[ScheduledRequest], rows: torch.Tensor, vocab_size: int, device) -> Penalties:
    col = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)[:, None]  # noqa: E731
    params = [r.sampling_params for r in reqs]
    counts = torch.zeros(len(reqs), vocab_size, dtype=torch.float32, device=device)
    out_r, out_t = _flat([r.output_token_ids[:r.output_len] for r in reqs], device)
    counts.index_put_((out_r, out_t), torch.ones_like(out_t, dtype=torch.float32), accumulate=True)
    seen = None
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = counts > 0
        seen[_flat([r.prompt_token_ids for r in reqs], device)] = True
    return Penalties(rows, col([p.presence_penalty for p in params]), col([p.frequency_penalty for p in params]),
                     col([p.repetition_penalty for p in params]), counts, seen)


def _flat(lists: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of every row's list."""
    rows = torch.repeat_interleave(torch.arange(len(lists)), torch.tensor([len(x) for x in lists]))
    tokens = torch.tensor([t for x in lists for t in x], dtype=torch.int64)
    return rows.to(device), tokens.to(device)


def apply(logits: torch.Tensor, adjust: LogitsAdjust) -> torch.Tensor:
    """logits [S, vocab] float32, changed in place (the caller passes its own copy)."""
    if adjust.allowed is not None:
        from iterserve.executor.structured_output import apply_bitmask  # xgrammar loads only when used
        apply_bitmask(logits, *adjust.allowed)
    if adjust.banned is not None:
        logits[adjust.banned] = float("-inf")
    if adjust.bias is not None:
        rows, tokens, bias = adjust.bias
        logits.index_put_((rows, tokens), bias, accumulate=True)
    if (p := adjust.penalties) is not None:
        x = logits[p.rows]
        if p.seen is not None:
            x = torch.where(p.seen, torch.where(x > 0, x / p.repetition, x * p.repetition), x)
        x -= p.frequency * p.output_counts + p.presence * (p.output_counts > 0)
        logits[p.rows] = x
    return logits
