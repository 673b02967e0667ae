"""What the scheduler reports of itself (Scheduler.stats): plain data, read by the engine's stats."""
from __future__ import annotations

from dataclasses import dataclass

from iterserve.kv.kv_cache_manager import KVCacheStats


@dataclass(slots=True, frozen=True)
class SchedulerStats:
    """The scheduler's and its KV manager's counters, handed to the engine's stats (engine/stats.py)."""

    num_running: int
    num_waiting: int  # waiting and recompute-preempted requests
    num_waiting_tokens: int  # their tokens (none computed): admission by --max-num-queued-tokens reads it
    num_swapped: int  # swap-preempted requests
    num_preemptions: int  # since start
    max_model_len: int
    num_spec_drafts: int  # speculative decoding, since start: requests' steps that carried drafts,
    num_spec_draft_tokens: int  # the drafts verified,
    num_spec_accepted_tokens: int  # and of those the ones accepted
    kv: KVCacheStats
