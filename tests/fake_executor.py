"""A deterministic executor for scheduler and engine tests: no model, checks the plan it gets."""
from __future__ import annotations

from iterserve.executor.request_state import RequestStates
from iterserve.kv.spec import KVCacheSpec
from iterserve.scheduler.output import SchedulerOutput, StepResult


class FakeExecutor:
    """Next token = (last token * 31 + position) % vocab: a pure function of the sequence so far,
    so outputs are identical however requests are batched, chunked or preempted."""

    def __init__(self, num_kv_blocks: int = 64, max_model_len: int = 4096, vocab_size: int = 1000,
                 eos_token_ids: frozenset[int] = frozenset(), block_size: int = 16, num_host_blocks: int = 0,
                 swap_bytes_per_s: float = 1e9, recompute_tokens_per_s: float = 1000.0) -> None:
        # One layer, one head of one int8 value: a block is 2 * block_size bytes; only the costs matter.
        self.kv_cache_spec = KVCacheSpec(block_size, num_kv_blocks, num_host_blocks, 1, 1, 1, "int8",
                                         swap_bytes_per_s, recompute_tokens_per_s)
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = None
        self.block_size = block_size
        self.plans: list[SchedulerOutput] = []
        # slot -> token id written there: tests read a request's context back through its block table
        self.cache: dict[int, int] = {}
        self.host_cache: dict[int, int] = {}
        self.states = RequestStates()  # block tables from the plans' new rows and deltas

    def execute(self, plan: SchedulerOutput) -> StepResult:
        plan = self.states.resolve(plan)  # kept resolved: tests read the block tables
        self.plans.append(plan)
        assert not (plan.swap_out and plan.swap_in), "one step never swaps both ways"
        self._copy(plan.swap_out, self.cache, self.host_cache)
        self._copy(plan.swap_in, self.host_cache, self.cache)
        sampled = []
        for s in plan.scheduled:
            slots = s.slot_mapping(plan.block_size)
            assert len(set(slots)) == len(slots)
            for slot, tok in zip(slots, s.token_ids):
                assert 0 <= slot < self.num_kv_blocks * plan.block_size
                self.cache[slot] = tok
            last = s.token_ids[-1]
            sampled.append((last * 31 + s.seq_len) % self.vocab_size if s.sample and not s.is_padding else -1)
        return StepResult(sampled=sampled, step_time=0.0)

    def shutdown(self) -> None:
        """Nothing to release."""

    def read_context(self, block_table: list[int], num_tokens: int) -> list[int | None]:
        bs = self.block_size
        return [self.cache.get(block_table[p // bs] * bs + p % bs) for p in range(num_tokens)]

    def _copy(self, pairs: list[tuple[int, int]], src: dict[int, int], dst: dict[int, int]) -> None:
        bs = self.block_size
        moved = {d * bs + o: src.get(s * bs + o) for s, d in pairs for o in range(bs)}
        for slot, tok in moved.items():
            if tok is None:
                dst.pop(slot, None)
            else:
                dst[slot] = tok
