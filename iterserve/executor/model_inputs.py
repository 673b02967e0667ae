"""Input preparation: a plan's requests as the flat step tensors (input_ids, positions, slot_mapping and the
attention metadata), with the layout of the logits and hidden-state rows each request gets. Loops over
requests, never tokens."""
from __future__ import annotations

import numpy as np
import torch

from iterserve.model.attention_metadata import AttentionMetadata
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput


def prepare_inputs(plan: SchedulerOutput, nrows: list[int] | None, block_size: int, kv_cache: torch.Tensor,
                   device: torch.device):
    """Flat step inputs; nrows: _logits_rows(plan.scheduled), the logits rows each request gets."""
    reqs, bs = plan.scheduled, plan.block_size
    assert bs == block_size, f"plan block_size {bs} != cache block_size {block_size}"
    q_lens = [len(r.token_ids) for r in reqs]
    seq_lens = [r.start_pos + n for r, n in zip(reqs, q_lens)]
    if max(q_lens) == 1:  # pure decode: one token per request, no concatenation needed
        ids = np.fromiter((r.token_ids[0] for r in reqs), np.int64, len(reqs))
        pos = np.asarray(seq_lens, np.int64) - 1
    else:
        ids = np.fromiter((t for r in reqs for t in r.token_ids), np.int64, sum(q_lens))
        pos = np.concatenate([np.arange(r.start_pos, s, dtype=np.int64) for r, s in zip(reqs, seq_lens)])
    max_blocks = max(len(r.block_table) for r in reqs)
    tables = np.zeros((len(reqs), max_blocks), np.int64)
    for i, r in enumerate(reqs):
        tables[i, : len(r.block_table)] = r.block_table
    starts = np.zeros(len(reqs) + 1, np.int64)
    np.cumsum(q_lens, out=starts[1:])
    row = np.repeat(np.arange(len(reqs)), q_lens)
    slots = tables[row, pos // bs] * bs + pos % bs
    att_seqs, att_q_lens, att_seq_lens = _attention_sequences(reqs, q_lens, seq_lens)
    att_starts = starts if att_seqs is None else np.concatenate([[0], np.cumsum(att_q_lens)])
    md = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=torch.from_numpy(att_starts).to(device, torch.int32),
        seq_lens=torch.tensor(att_seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(tables if att_seqs is None else tables[att_seqs]).to(device, torch.int32),
        max_query_len=max(att_q_lens), max_seq_len=max(att_seq_lens), query_lens_list=att_q_lens,
        seq_lens_list=att_seq_lens)
    # logits for every request's last token: padding seats pay for theirs too, as a padded batch would;
    # a request asking for prompt logprobs gets a row for each token of its chunk, one with drafts a row
    # for its own last token and each draft
    ends = starts[1:]
    rows = ends - 1 if nrows is None else np.concatenate([np.arange(e - k, e) for e, k in zip(ends, nrows)])
    logits_indices = torch.from_numpy(rows).to(device)
    return (torch.from_numpy(ids).to(device), torch.from_numpy(pos).to(device), kv_cache, md, logits_indices)


def _num_prompt_logprobs(r: ScheduledRequest) -> int:
    """How many prompt tokens of this chunk get a logprob (0: not asked): the token at position p + 1
    from the logits at p, for p in the chunk and before the prompt's last token."""
    if r.sampling_params.prompt_logprobs is None:
        return 0
    return max(0, min(r.seq_len, len(r.prompt_token_ids) - 1) - r.start_pos)


def _num_hidden_rows(r: ScheduledRequest) -> int:
    """Hidden-state rows a request pools from this step: mean, its whole chunk; last, its last token once
    the prompt is done; none for the rest."""
    pooling = r.sampling_params.pooling
    if pooling is None or r.is_padding:
        return 0
    return len(r.token_ids) if pooling == "mean" else int(r.sample)


def _hidden_rows(reqs: list[ScheduledRequest]) -> np.ndarray | None:
    """The step's token rows whose final-norm hidden states are pooled, in request order; None: no pooling."""
    counts = [_num_hidden_rows(r) for r in reqs]
    if not any(counts):
        return None
    ends = np.cumsum([len(r.token_ids) for r in reqs])
    return np.concatenate([np.arange(e - k, e) for e, k in zip(ends, counts) if k])


def _logits_rows(reqs: list[ScheduledRequest]) -> list[int] | None:
    """Logits rows per request: its whole chunk if it wants prompt logprobs, else its last token and its
    drafts. None when every request has one row (the common case costs nothing)."""
    drafts = any(r.num_draft_tokens for r in reqs)
    if not drafts and (all(r.sampling_params.prompt_logprobs is None for r in reqs)
                       or not any(map(_num_prompt_logprobs, reqs))):
        return None
    return [len(r.token_ids) if _num_prompt_logprobs(r) else r.num_draft_tokens + 1 for r in reqs]


def _attention_sequences(reqs: list[ScheduledRequest], q_lens: list[int], seq_lens: list[int]):
    """The sequences attention sees: (request of each, q_lens, seq_lens), or (None, q_lens, seq_lens) where
    they are the requests. A request with drafts attends as 1 + k one-token sequences over its block table,
    the i-th seeing the context up to its own token: the arithmetic its one-token steps would have done
    without speculation (the decode kernel's, not the prompt kernel's, whose sums run in another order),
    so greedy tokens come out the same with speculation on and off, and a verify step is a decode step."""
    if not any(r.num_draft_tokens for r in reqs):
        return None, q_lens, seq_lens
    seqs, att_q, att_seq = [], [], []
    for i, (r, n, s) in enumerate(zip(reqs, q_lens, seq_lens)):
        split = r.num_draft_tokens > 0
        seqs += [i] * (n if split else 1)
        att_q += [1] * n if split else [n]
        att_seq += range(s - n + 1, s + 1) if split else [s]
    return seqs, att_q, att_seq
