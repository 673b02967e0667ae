"""A step's rows (output.ScheduledRequest): a request's full data the first time the executor sees it,
then only what was added since. Torch-free, like the scheduler that builds its plans with it."""
from __future__ import annotations

from iterserve.kv.kv_cache_manager import KVCacheManager
from iterserve.request import Request
from iterserve.scheduler.output import ScheduledRequest


class PlanRows:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv  # whose block tables the rows carry
        # (blocks, output tokens) the executor holds of each request sent whole since it last started
        # running: its next rows carry only what was added (output.ScheduledRequest)
        self.sent: dict[str, tuple[int, int]] = {}

    def row(self, request: Request, n: int, drafts: dict[str, list[int]]) -> ScheduledRequest:
        """`n` tokens of `request` from its num_computed_tokens on: those past its own tokens are its drafts."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + n
        tokens = request.token_ids
        num_drafts = max(0, end - len(tokens))
        new = tokens[start:end] if not num_drafts else tokens[start:] + drafts[request.request_id][:num_drafts]
        rid, blocks, outputs = request.request_id, self.kv.block_table(request.request_id), request.output_token_ids
        sent = self.sent.get(rid)
        self.sent[rid] = (len(blocks), len(outputs))
        if sent is None:  # new to the executor: its full data, copied (positional: built every step)
            return ScheduledRequest(rid, new, start, list(blocks), end >= len(tokens), request.sampling_params,
                                    len(outputs), list(request.prompt_token_ids), list(outputs), False, num_drafts)
        return ScheduledRequest(rid, new, start, [], end >= len(tokens), request.sampling_params, len(outputs),
                                [], [], False, num_drafts, True, blocks[sent[0]:], outputs[sent[1]:])

    def forget(self, request_id: str) -> None:
        """It left the executor (finished, or preempted: resumed, it is sent whole again)."""
        self.sent.pop(request_id, None)
