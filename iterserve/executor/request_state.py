"""The executor's own state of each request, built from the plans' new-request rows and deltas.

A plan never carries the scheduler's lists (scheduler/output.py): a request's first row, and its first
after a preemption, brings its block table, prompt and output so far; later rows bring the blocks and
output tokens added since. An executor that reads more than a step's tokens (block tables, penalties,
prompt logprobs, grammar matchers) resolves each plan against its RequestStates, so the model runner in
one process and every tensor-parallel rank build the same state from the same rows. Torch-free: the
test executors keep one too.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # what the scheduler appended before the latest plan, in order
    block_table: list[int]


class RequestStates:
    def __init__(self) -> None:
        self.by_id: dict[str, RequestState] = {}

    def resolve(self, plan: SchedulerOutput) -> SchedulerOutput:
        """The plan with each row's full data (its block table, prompt and output from the state kept
        here, which a new row replaces and a cached row's deltas extend). Finished and preempted
        requests are dropped first: a request resumed in the same step comes as a new row."""
        for rid in plan.finished_ids:
            self.by_id.pop(rid, None)
        for rid in plan.preempted_ids:
            self.by_id.pop(rid, None)
        if not plan.scheduled:
            return plan
        return replace(plan, scheduled=[self._resolved(r) for r in plan.scheduled])

    def _resolved(self, r: ScheduledRequest) -> ScheduledRequest:
        if not r.cached:
            if not r.is_padding:  # a padding row's request has finished: nothing to keep
                self.by_id[r.request_id] = RequestState(list(r.prompt_token_ids), list(r.output_token_ids),
                                                        list(r.block_table))
            return r
        s = self.by_id[r.request_id]
        s.block_table += r.new_block_ids
        s.output_token_ids += r.new_token_ids
        assert len(s.output_token_ids) == r.output_len, "output deltas out of step with the plan"
        return ScheduledRequest(r.request_id, r.token_ids, r.start_pos, s.block_table, r.sample, r.sampling_params,
                                r.output_len, s.prompt_token_ids, s.output_token_ids, r.is_padding,
                                r.num_draft_tokens)
