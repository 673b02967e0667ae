"""The plan of one step (scheduler -> executor) and what the executor returns. Plain data, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute K/V for `token_ids` at positions start_pos.. and,
    if `sample`, sample its next token from the logits of the last one. With drafts (speculative
    decoding), the last num_draft_tokens of token_ids are guesses: logits come from the request's
    last own token and every draft, and the executor keeps the drafts the model agrees with.

    A row carries a new request's full data or a cached request's deltas (vLLM V1's NewRequestData
    and CachedRequestData), never the scheduler's own lists. New (`cached` False: the first step a
    request is scheduled, and its first after a preemption): its whole block table and copies of its
    prompt and of the tokens it has generated. Cached: the blocks and the output tokens added since
    its last step, which the executor appends to the state it keeps (executor/request_state.py)."""

    request_id: str
    token_ids: list[int]  # the new tokens of this step (a prompt chunk, or the one decode token)
    start_pos: int  # == num_computed_tokens before the step; positions are start_pos + i
    block_table: list[int]  # new: all blocks of the request, in order; covers start_pos + len(token_ids)
    sample: bool  # the prompt is complete after this step, so a token is sampled
    sampling_params: SamplingParams
    output_len: int = 0  # tokens generated so far (seeded sampling offsets by it)
    prompt_token_ids: list[int] = field(default_factory=list)  # new only
    output_token_ids: list[int] = field(default_factory=list)  # new only: the output_len tokens so far
    is_padding: bool = False  # static mode: a finished request computing its seat as padding
    num_draft_tokens: int = 0  # speculative tokens at the end of token_ids (engine/spec_decode.py)
    cached: bool = False  # the executor holds this request's state: the fields below are its deltas
    new_block_ids: list[int] = field(default_factory=list)  # cached: blocks added since its last step
    new_token_ids: list[int] = field(default_factory=list)  # cached: output tokens added since its last step

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.token_ids)

    def slot_mapping(self, block_size: int) -> list[int]:
        """Cache slot (block_id * block_size + offset) of each new token (of a new row, or of one
        resolved against the executor's state: a cached row has no block table)."""
        bt = self.block_table
        return [bt[p // block_size] * block_size + p % block_size for p in range(self.start_pos, self.seq_len)]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_size: int = 16
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # left since the last step: executors drop their state
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block), before the step
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block), before the step

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in and not self.finished_ids


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: list[tuple[int, float]]  # top-N (token id, logprob), best first


@dataclass(slots=True)
class StepResult:
    """sampled[i] is the token for plan.scheduled[i], or -1 where nothing was sampled."""

    sampled: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    # per scheduled request with drafts: the drafts the model accepted, which come before sampled[i]
    # (then the request's new tokens are accepted_drafts[i] + [sampled[i]]); None: no request had drafts
    accepted_drafts: list[list[int]] | None = None
    # per scheduled request, when it asked for prompt logprobs: those of the prompt tokens at
    # positions start_pos + 1 .. of this step's chunk (each from the logits of the token before it)
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None
    # per scheduled request, for a pooling request whose prompt this step completed: its embedding
    pooled: list[list[float] | None] | None = None
    step_time: float = 0.0  # seconds the executor spent (real or modelled)
