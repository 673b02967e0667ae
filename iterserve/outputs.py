"""What the engine hands back to callers after each step, and the per-step record for plots."""
from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.request import RequestTimes
from iterserve.scheduler.output import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far (the request's own list: copy it to keep a snapshot)
    text: str  # all output text so far (stop strings cut off)
    new_token_ids: list[int]  # tokens added by this step
    new_text: str  # text added by this step (held back while it could be part of a stop string)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    times: RequestTimes
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: int | str | None = None
    error: str | None = None
    index: int = 0  # which of the request's n sequences (n > 1: request_id is "<parent>#<index>")
    parent_id: str | None = None  # the id add_request returned
    n: int = 1  # how many sequences its request asked for (metrics count the request once)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (the first: None); None: not asked
    embedding: list[float] | None = None  # a pooling request's (SamplingParams.pooling), on its one output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class StepRecord:
    """One engine step, for batch-size / KV-usage plots and the batch timeline."""

    start: float
    end: float
    num_running: int
    num_waiting: int
    num_batched_tokens: int
    kv_usage: float  # fraction of device blocks in use after the step
    prefill_ids: list[str]  # requests that computed prompt tokens this step
    decode_ids: list[str]  # requests that decoded this step (padding rows excluded)
    preempted_ids: list[str]
    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens computed this step; the rest are decodes
    # per prefill id, the prompt tokens it had computed before this step (a prefix-cache hit starts past 0)
    prefill_starts: list[int] = field(default_factory=list)
