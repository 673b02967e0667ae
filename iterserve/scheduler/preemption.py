"""Whom to preempt, when the KV pool runs out or a higher-priority request waits, and how: swap its
blocks to the host pool or drop them to be recomputed. The scheduler does the preempting."""
from __future__ import annotations

from iterserve.config import SchedulerConfig
from iterserve.kv.kv_cache_manager import KVCacheManager
from iterserve.kv.spec import KVCacheSpec
from iterserve.request import Request
from iterserve.scheduler.output import SchedulerOutput


def pick_victim(candidates: list[Request], policy: str) -> Request:
    """The lowest-priority, latest-arrived of `candidates`, the requests not yet scheduled in this step."""
    if policy == "priority":
        return max(candidates, key=lambda r: (r.priority, r.arrival_seq))
    return candidates[-1]


def priority_victim(running: list[Request], request: Request, config: SchedulerConfig) -> Request | None:
    """The running request to preempt to make room for `request`: one of strictly lower priority, or None."""
    if config.scheduling_policy != "priority" or not config.priority_preemption:
        return None
    victims = [r for r in running if r.priority > request.priority
               and r.num_preemptions < config.max_priority_preemptions]
    if not victims:
        return None
    return max(victims, key=lambda r: (r.priority, r.arrival_seq))


def use_swap(request: Request, plan: SchedulerOutput, mode: str, kv: KVCacheManager, spec: KVCacheSpec) -> bool:
    """Whether `request` is swapped out rather than dropped, under --preemption-mode `mode`."""
    # Executors copy swap-outs before swap-ins: a host block freed by a swap-in in this step
    # must not be swapped out into in the same step.
    if mode == "recompute" or plan.swap_in or not kv.can_swap_out(request):
        return False
    if mode == "swap":
        return True
    # auto: copy out and back at the executor's measured bandwidth vs recomputing every cached token
    swap_s = 2 * len(kv.blocks_of(request.request_id)) * spec.bytes_per_block / spec.swap_bytes_per_s
    return swap_s < request.num_computed_tokens / spec.recompute_tokens_per_s
