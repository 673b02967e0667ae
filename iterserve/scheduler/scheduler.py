"""Iteration-level scheduling: who computes how many tokens in the next step.

The one rule (docs/architecture.md): each scheduled request gets min(num_tokens - num_computed_tokens,
budget left) tokens. Prompts, prompt chunks, resumed requests and decodes are the same case.
Torch-free, so the simulator drives this very object.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Sequence

from iterserve.config import EngineConfig
from iterserve.kv.kv_cache_manager import KVCacheManager, cdiv
from iterserve.kv.spec import KVCacheSpec
from iterserve.request import Request, RequestStatus
from iterserve.scheduler.output import SchedulerOutput, ScheduledRequest, StepResult
from iterserve.scheduler.plan_rows import PlanRows
from iterserve.scheduler.preemption import pick_victim, priority_victim, use_swap
from iterserve.scheduler.stats import SchedulerStats


class Scheduler:
    def __init__(self, config: EngineConfig, kv_spec: KVCacheSpec, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config.scheduler_config
        self.clock = clock
        self.kv_spec = kv_spec
        self.block_size = kv_spec.block_size
        cache = config.cache_config
        self.kv = KVCacheManager(kv_spec.num_device_blocks, kv_spec.block_size, cache.enable_prefix_caching,
                                 cache.watermark, kv_spec.num_host_blocks)
        # A sequence may grow only as long as the pool can hold it alone, or it could never resume.
        self.max_model_len = min(max_model_len, self.kv.max_tokens_per_request)
        self.static = self.config.scheduling == "static"
        self.waiting: deque[Request] = deque()
        self.num_waiting_tokens = 0  # the waiting requests' num_tokens (none computed): admission reads it
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # swap-preempted, resumed before any waiting request
        self.padding: list[Request] = []  # static mode: finished requests still holding their seat
        self.requests: dict[str, Request] = {}
        self.finished_ids: list[str] = []  # since the last plan, for executors to drop state
        # Speculative decoding (engine/spec_decode.py): draft tokens proposed for a running request's
        # next step. They are scheduled like its own tokens and dropped after that step.
        self.drafts: dict[str, list[int]] = {}
        self.rows = PlanRows(self.kv)  # what the executor holds of each request: the next rows carry the rest
        self.num_preemptions = 0
        self.num_drafts = 0  # requests' steps that carried drafts, since start
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_tokens = 0  # of those, accepted
        self._arrivals = 0

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._check_new(request)
        request.arrival_seq = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.num_waiting_tokens += request.num_tokens

    def set_drafts(self, request: Request, drafts: list[int]) -> None:
        """Draft tokens for a decoding request's next step; the model keeps those it agrees with."""
        assert request.status == RequestStatus.RUNNING and request.num_tokens - request.num_computed_tokens == 1
        self.drafts[request.request_id] = drafts

    def add_computed_request(self, request: Request, hashes: list[bytes]) -> tuple[int, list[int]] | None:
        """Admit a request whose prompt was computed elsewhere (a prefill engine) and whose first token is
        already appended: a prefix-cache hit whose blocks come from outside. Local cache hits are reused;
        new blocks are allocated for the rest and `hashes` (the sender's, one per full prompt block)
        registered on them. Returns (index of the first block to fill, the block ids to fill with the
        transferred KV), or None when there is no room or seat now (ask again after a step)."""
        self._check_new(request)
        computed, num_cached = self.kv.get_computed_blocks(request)
        n = request.num_prompt_tokens
        if len(self.running) >= self.config.max_num_seqs or not self.kv.can_admit(request, n + 1, computed):
            return None
        new = self.kv.allocate_slots(request, n - num_cached, computed)
        assert new is not None
        request.num_computed_tokens = n
        self.kv.register_hashes(request, hashes)
        request.arrival_seq = self._arrivals
        self._arrivals += 1
        self.requests[request.request_id] = request
        self._start_running(request)
        return len(computed), [b.block_id for b in new]

    def prompt_blocks(self, request_id: str) -> tuple[Request, list[int], list[bytes]]:
        """A request whose prompt is computed, to hand to another engine (a prefill engine's side): it,
        the ids of the blocks holding its prompt, and the prefix hashes of its full prompt blocks that
        are in the cache (none without prefix caching)."""
        request = self.requests[request_id]
        n, bs = request.num_prompt_tokens, self.block_size
        return request, self.kv.block_table(request_id)[:cdiv(n, bs)], self.kv.cached_hashes(request)[:n // bs]

    def _check_new(self, request: Request) -> None:
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt is empty")
        if n > self.max_model_len or (n == self.max_model_len and request.sampling_params.pooling is None):
            raise ValueError(f"the prompt has {n} tokens; this engine's context holds at most "
                             f"{self.max_model_len} (prompt plus at least one generated token)")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Stop a request (aborted, stopped by a stop string, failed) and free what it holds."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.drafts.pop(request_id, None)
        self.rows.forget(request_id)
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
            self.num_waiting_tokens -= request.num_tokens
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        request.status = status
        request.times.finished = self.clock()
        if self.static and self.config.static_padding and status != RequestStatus.FINISHED_ABORTED \
                and self.kv.blocks_of(request_id):
            self.padding.append(request)  # keeps blocks and seat until the whole batch ends
        else:
            self.kv.free(request)
        if self.static and not self.running:
            self._end_static_batch()
        self.finished_ids.append(request_id)
        return request

    def stop_request(self, request: Request, stop_reason: str, keep_tokens: int) -> None:
        """A stop string ends the request after its first `keep_tokens` output tokens (the output processor
        found it): the tokens after it go (a speculative step may have accepted them in one go) and the
        request finishes stopped, also if this step had already finished it later in the run (length)."""
        extra = request.num_output_tokens - keep_tokens
        if extra > 0:
            del request.output_token_ids[keep_tokens:]
            del request.token_ids[len(request.token_ids) - extra:]
            del request.times.token_times[len(request.times.token_times) - extra:]
        request.stop_reason = stop_reason
        if request.finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput(block_size=self.block_size, finished_ids=self.finished_ids)
        self.finished_ids = []
        budget = self.config.max_num_batched_tokens
        if self.static:
            if not self.running:
                self._end_static_batch()
                self._admit_static_batch()
            budget = self._schedule_running(plan, budget)
            self._schedule_padding(plan, budget)
            return plan
        budget = self._schedule_running(plan, budget)
        if not plan.preempted_ids:  # a step that had to preempt has no room to admit anyone
            budget = self._schedule_swapped(plan, budget)
            if not self.swapped:  # swapped requests resume before anyone new is admitted
                self._schedule_waiting(plan)
        return plan

    def _schedule_running(self, plan: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self.drafts:
                n = self._num_running_tokens(request, budget, len(self.running) - i - 1)
            else:
                n = min(len(request.token_ids) - request.num_computed_tokens, budget)
            while self.kv.allocate_slots(request, n) is None:
                victim = pick_victim(self.running[i:], self.config.scheduling_policy)
                self._preempt(victim, plan)
                if victim is request:
                    break
            else:
                plan.scheduled.append(self.rows.row(request, n, self.drafts))
                budget -= n
                i += 1
                continue
            break  # the request preempted itself: nothing after it fits either
        return budget

    def _num_running_tokens(self, request: Request, budget: int, num_after: int) -> int:
        """The one rule, a request's drafts counted as its tokens. The budget cuts drafts first, and drafts
        take no block that the `num_after` requests still to schedule may need for one more token each:
        drafts do not make a decode step preempt anyone."""
        todo = request.num_tokens - request.num_computed_tokens
        n = min(todo + len(self.drafts.get(request.request_id, ())), budget)
        if n > todo:
            computed, held = request.num_computed_tokens, len(self.kv.blocks_of(request.request_id))
            new_blocks = cdiv(computed + n, self.block_size) - held
            if new_blocks > max(0, cdiv(computed + todo, self.block_size) - held) and \
                    new_blocks > self.kv.num_free_blocks - num_after:
                del self.drafts[request.request_id]
                n = min(todo, budget)
        return n

    def _schedule_swapped(self, plan: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            n = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if not self.kv.can_swap_in(request, n):
                break
            self.swapped.popleft()
            plan.swap_in.extend(self.kv.swap_in(request))
            assert self.kv.allocate_slots(request, n) is not None
            self._start_running(request)
            if n:
                plan.scheduled.append(self.rows.row(request, n, self.drafts))
                budget -= n
        return budget

    def _schedule_waiting(self, plan: SchedulerOutput) -> None:
        if self.config.scheduling_policy == "priority":
            self._sort_waiting()
        i = 0  # requests before i wait for a prefix another request is computing; others may pass them
        while i < len(self.waiting):
            budget = self.config.max_num_batched_tokens - plan.num_batched_tokens
            if budget <= 0:
                return
            request = self.waiting[i]
            computed, num_cached = self._computed_blocks(request)
            if 2 * self.kv.prefix_in_flight(request, computed) >= request.num_tokens - num_cached:
                i += 1  # most of what it would compute is being computed: reuse it next step
                continue
            # Admit only if the whole remaining prompt fits, not just its first chunk (no thrash).
            if len(self.running) >= self.config.max_num_seqs or \
                    not self.kv.can_admit(request, request.num_tokens, computed):
                if self._preempt_for_priority(request, plan):
                    continue
                return
            n = self._num_new_tokens(request, num_cached, budget)
            if self.kv.allocate_slots(request, n, computed) is None:
                return
            del self.waiting[i]
            self.num_waiting_tokens -= request.num_tokens
            self.kv.mark_computing(request, computed)
            request.num_computed_tokens = num_cached
            self._start_running(request)
            if n:
                plan.scheduled.append(self.rows.row(request, n, self.drafts))

    def _computed_blocks(self, request: Request):
        """The prefix cache's blocks for a request; none for mean pooling, which needs every prompt
        token's hidden state (a cached block holds only K/V)."""
        if request.sampling_params.pooling == "mean":
            return [], 0
        return self.kv.get_computed_blocks(request)

    @staticmethod
    def _num_new_tokens(request: Request, num_computed: int, budget: int) -> int:
        """The one rule."""
        return max(0, min(request.num_tokens - num_computed, budget))

    def _sort_waiting(self) -> None:
        """(priority, arrival) order; waiting ages a request's priority so nobody starves."""
        now, aging = self.clock(), self.config.priority_aging_s
        self.waiting = deque(sorted(
            self.waiting, key=lambda r: (r.priority - int((now - r.times.arrival) / aging), r.arrival_seq)))

    def _preempt_for_priority(self, request: Request, plan: SchedulerOutput) -> bool:
        """Make room for `request` by preempting running work of strictly lower priority."""
        victim = priority_victim(self.running, request, self.config)
        if victim is None:
            return False
        plan.scheduled = [s for s in plan.scheduled if s.request_id != victim.request_id]
        self._preempt(victim, plan)
        self._sort_waiting()
        return True

    def _admit_static_batch(self) -> None:
        """Static batching: reserve prompt + max_tokens for each member up front; nobody joins later."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            reserved = self._static_reservation(request)
            if not self.kv.can_admit(request, reserved):
                break
            self.kv.allocate_slots(request, reserved)
            self.waiting.popleft()
            self.num_waiting_tokens -= request.num_tokens
            self._start_running(request)

    def _static_reservation(self, request: Request) -> int:
        return min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.max_model_len)

    def _schedule_padding(self, plan: SchedulerOutput, budget: int) -> None:
        """A padded static batcher still computes finished rows; charge the same work."""
        if not self.config.static_padding:
            return
        for request in self.padding:
            if budget <= 0:
                return
            capacity = len(self.kv.blocks_of(request.request_id)) * self.block_size
            pos = min(request.num_computed_tokens, capacity - 1)
            request.num_computed_tokens = pos + 1
            plan.scheduled.append(ScheduledRequest(
                request.request_id, [request.token_ids[-1]], pos, list(self.kv.block_table(request.request_id)),
                sample=True, sampling_params=request.sampling_params, is_padding=True))
            budget -= 1

    def _end_static_batch(self) -> None:
        for request in self.padding:
            self.kv.free(request)
        self.padding.clear()

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        if request.times.first_scheduled is None:
            request.times.first_scheduled = self.clock()
        self.running.append(request)

    def _preempt(self, request: Request, plan: SchedulerOutput) -> None:
        """Swap its KV to the host pool, or drop it to be recomputed from the front of the queue."""
        self.running.remove(request)
        self.drafts.pop(request.request_id, None)
        self.rows.forget(request.request_id)
        request.num_preemptions += 1
        request.times.preempted.append(self.clock())
        self.num_preemptions += 1
        plan.preempted_ids.append(request.request_id)
        if use_swap(request, plan, self.config.preemption_mode, self.kv, self.kv_spec):
            plan.swap_out.extend(self.kv.swap_out(request))
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            return
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_waiting_tokens += request.num_tokens

    # ---- after the step ---------------------------------------------------------------------
    def update(self, plan: SchedulerOutput, result: StepResult) -> list[Request]:
        """Advance computed counts, append sampled tokens (and accepted drafts), stop finished requests.

        Returns the requests that got new tokens (finished ones included)."""
        now = self.clock()
        progressed = []
        requests, running = self.requests, RequestStatus.RUNNING
        for i, (scheduled, token) in enumerate(zip(plan.scheduled, result.sampled)):
            request = requests.get(scheduled.request_id)
            if request is None or scheduled.is_padding or request.status is not running:
                continue  # aborted during the step, or a padding row
            request.num_computed_tokens += len(scheduled.token_ids) - scheduled.num_draft_tokens
            self.kv.cache_full_blocks(request)
            if not scheduled.sample:
                continue
            if scheduled.sampling_params.pooling is not None:
                self._finish_pooled(request, result, i, now)
                progressed.append(request)
                continue
            if not scheduled.num_draft_tokens and not self.drafts:  # nothing drafted: one token
                self._append_tokens(request, (token,), now)
                progressed.append(request)
                continue
            accepted = self._accepted_drafts(scheduled, result, i)
            # Accepted drafts' K/V are right: each equals the token appended for its position. Rejected
            # ones' slots are overwritten by the next step's tokens.
            request.num_computed_tokens += len(accepted)
            self._append_tokens(request, [*accepted, token], now)
            progressed.append(request)
        return progressed

    def _finish_pooled(self, request: Request, result: StepResult, i: int, now: float) -> None:
        """A prompt-only request ends with its prompt: its pooled hidden state is its output, no token is
        sampled, and finishing frees its blocks (the full ones stay in the prefix cache). An executor
        that does not pool (returns no embedding) fails it."""
        request.pooled = result.pooled[i] if result.pooled else None
        request.times.first_token = now  # its result, timed as a first token (prefill time, e2e)
        request.times.token_times.append(now)
        ok = request.pooled is not None
        self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED if ok else RequestStatus.FINISHED_ERROR)

    def _accepted_drafts(self, scheduled: ScheduledRequest, result: StepResult, i: int) -> list[int]:
        self.drafts.pop(scheduled.request_id, None)  # proposed for this step only
        d = scheduled.num_draft_tokens
        if not d:
            return []
        accepted = result.accepted_drafts[i] if result.accepted_drafts is not None else []
        n = len(scheduled.token_ids) - d
        assert accepted == scheduled.token_ids[n:n + len(accepted)], "accepted tokens that were not drafted"
        self.num_drafts += 1
        self.num_draft_tokens += d
        self.num_accepted_tokens += len(accepted)
        return accepted

    def _append_tokens(self, request: Request, tokens: Sequence[int], now: float) -> None:
        """One by one, as one-token decoding would: a stop inside an accepted run drops the rest."""
        times = request.times
        for token in tokens:
            request.append_token(token)
            if times.first_token is None:
                times.first_token = now
            times.token_times.append(now)
            status = self._stop_status(request, token)
            if status is not None:
                self.finish_request(request.request_id, status)
                return

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if token in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= params.max_tokens or len(request.token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- introspection ----------------------------------------------------------------------
    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_waiting_tokens=self.num_waiting_tokens,
            num_swapped=len(self.swapped), num_preemptions=self.num_preemptions, max_model_len=self.max_model_len,
            num_spec_drafts=self.num_drafts, num_spec_draft_tokens=self.num_draft_tokens,
            num_spec_accepted_tokens=self.num_accepted_tokens, kv=self.kv.stats)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)
