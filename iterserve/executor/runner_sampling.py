"""The sampling side of a step, as plain functions over the logits rows: which rows each request samples
from, prompt logprobs, and checking speculative drafts (greedy: against the argmax; random: by rejection
sampling). ModelRunner._sample puts them together with the per-request generators and grammars."""
from __future__ import annotations

import numpy as np
import torch

from iterserve.executor.model_inputs import _num_prompt_logprobs
from iterserve.executor.sampler import prompt_logprobs, verify_random_drafts
from iterserve.scheduler.output import ScheduledRequest


def _sampling_rows(reqs: list[ScheduledRequest], nrows: list[int]) -> np.ndarray:
    """Of the _logits_rows layout, each request's last 1 + num_draft_tokens rows."""
    ends = np.cumsum(nrows)
    return np.concatenate([np.arange(e - r.num_draft_tokens - 1, e) for e, r in zip(ends, reqs)])


def _row_index(widths: list[int], rows: list[int]) -> list[int] | None:
    """The logits rows of the sampling requests `rows` (widths: rows per request); None: all of them."""
    if len(rows) == len(widths):
        return None
    starts = np.cumsum([0, *widths[:-1]]).tolist()
    return [starts[i] + k for i in rows for k in range(widths[i])]


def _drafts(r: ScheduledRequest) -> list[int]:
    return r.token_ids[len(r.token_ids) - r.num_draft_tokens:]


def _verify_greedy(drafts: list[int], targets: list[int]) -> tuple[int, int]:
    """(drafts accepted, the model's own token after them): the drafts up to the first that differs from
    the argmax there (`targets`: each row's one-token sample; one row without drafts), then that argmax."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a, targets[a]


def _verify_random(scheduled: list[ScheduledRequest], rows: list[int], widths: list[int],
                   sel: torch.Tensor) -> dict[int, tuple[int, int]]:
    """Drafted requests that sample at temperature > 0: rejection sampling over their rows of `sel`, all
    in one batch, so each token has the distribution a one-token step would draw it from."""
    offsets = np.cumsum([0] + [widths[i] for i in rows]).tolist()
    pick = [(i, o) for i, o in zip(rows, offsets) if widths[i] > 1 and scheduled[i].sampling_params.temperature]
    if not pick:
        return {}
    index = torch.tensor([o + k for i, o in pick for k in range(widths[i])], device=sel.device)
    params = [scheduled[i].sampling_params for i, _ in pick for _ in range(widths[i])]
    results = verify_random_drafts(sel[index], params, [_drafts(scheduled[i]) for i, _ in pick])
    return {i: r for (i, _), r in zip(pick, results)}


def _prompt_logprobs(reqs: list[ScheduledRequest], nrows: list[int], logits: torch.Tensor):
    out: list = [None] * len(reqs)
    offset = 0
    for i, (r, k) in enumerate(zip(reqs, nrows)):
        if n := _num_prompt_logprobs(r):
            targets = torch.tensor(r.prompt_token_ids[r.start_pos + 1:r.start_pos + 1 + n], device=logits.device)
            out[i] = prompt_logprobs(logits[offset:offset + n], targets, r.sampling_params.prompt_logprobs)
        offset += k
    return out
