"""A snapshot of the engine's state, handed to consumers (server metrics, status line, bench) after each
step, so none of them reaches into the scheduler or the KV manager."""
from __future__ import annotations

from dataclasses import dataclass

from iterserve.outputs import StepRecord


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int  # waiting and recompute-preempted requests
    num_swapped: int  # swap-preempted requests, resumed before anyone new
    kv_usage: float  # fraction of device KV blocks in use
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions: int  # since start
    num_prefix_queries: int  # prompt tokens looked up in the prefix cache, since start
    num_prefix_hits: int  # of those, tokens found cached
    num_steps: int
    max_model_len: int
    last_step: StepRecord | None  # the latest step's record (batch, tokens, timing)
    num_kv_transfers_recomputed: int = 0  # P/D decode side: handed-off prompts recomputed (transfer failed)
    # speculative decoding (engine/spec_decode.py), since start: requests' steps that carried drafts,
    # the drafts verified, and of those the ones the model accepted
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_queued_tokens: int = 0  # tokens the waiting requests must compute before their next token

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / verified drafts; None before any draft."""
        return self.num_spec_accepted_tokens / self.num_spec_draft_tokens if self.num_spec_draft_tokens else None

    @property
    def spec_mean_accepted_len(self) -> float | None:
        """Tokens a drafted step gives a request on average: its accepted drafts plus the model's own."""
        return 1 + self.num_spec_accepted_tokens / self.num_spec_drafts if self.num_spec_drafts else None

    @property
    def num_queued(self) -> int:
        """Everyone not running: what a queue-length limit counts."""
        return self.num_waiting + self.num_swapped
