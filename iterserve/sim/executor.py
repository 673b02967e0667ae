"""The executor the simulator plugs into the real engine: a cost model instead of a model, and a
virtual clock that jumps by each step's modelled time instead of waiting for it."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from iterserve.config import CPU_KV_CACHE_MEMORY
from iterserve.kv.spec import DTYPE_BYTES, KVCacheSpec, bytes_per_block, num_blocks_for
from iterserve.scheduler.output import SchedulerOutput, StepResult
from iterserve.sim.cost_model import CostModel
from iterserve.sim.hardware import HardwareSpec
from iterserve.sim.model_spec import ModelSpec


class VirtualClock:
    """Seconds since the simulation began. The engine reads it for every timestamp; the executor
    moves it forward by each step's modelled time; the trace driver jumps it over idle gaps."""

    __slots__ = ("t",)

    def __init__(self, start: float = 0.0):
        self.t = start

    def __call__(self) -> float:
        return self.t

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        assert dt >= 0, dt
        self.t += dt

    def advance_to(self, t: float) -> None:
        """Never backwards: an arrival already in the past leaves the clock where it is."""
        if t > self.t:
            self.t = t


class SimulatedExecutor:
    """Satisfies the executor contract. Output tokens are placeholders (token id `token_id`):
    the bench sets max_tokens to the trace's output length with ignore_eos, so requests finish
    exactly where the trace says, and no EOS or tokenizer exists here."""

    eos_token_ids = frozenset()
    tokenizer = None
    vocab_size = None

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, tp: int = 1, num_kv_blocks: int | None = None,
                 block_size: int = 16, gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256, swap_space: int = 0, max_model_len: int | None = None,
                 clock: VirtualClock | None = None, token_id: int = 0,
                 kv_cache_memory: int = CPU_KV_CACHE_MEMORY):
        self.cost = CostModel(model, hardware, tp)
        self.model, self.hardware, self.tp = model, hardware, tp
        # Per device: under TP each GPU holds (and swaps) its share of the KV heads.
        kv_heads = -(-model.num_kv_heads // min(tp, model.num_kv_heads))
        block_bytes = bytes_per_block(model.num_layers, block_size, kv_heads, model.head_dim, model.kv_pool_dtype)
        if num_kv_blocks is None and hardware.kind == "cpu":  # the CPU engine's rule: a fixed byte budget
            num_kv_blocks = num_blocks_for(kv_cache_memory, block_bytes)
        num_kv_blocks = num_kv_blocks or self.cost.num_kv_blocks(
            block_size, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)
        # Recompute is priced at the modelled speed of one prompt chunk of the step budget.
        chunk = min(max_num_batched_tokens, 2048)
        self.kv_cache_spec = KVCacheSpec(
            block_size, num_kv_blocks, int(swap_space // block_bytes), model.num_layers, kv_heads,
            model.head_dim, model.kv_pool_dtype, swap_bytes_per_s=hardware.host_link_bandwidth,
            recompute_tokens_per_s=chunk / self.cost.prefill_time(chunk))
        self.max_model_len = max_model_len or model.max_model_len
        self.clock = clock or VirtualClock()
        self.token_id = token_id
        self.num_steps = 0
        self.busy_time = 0.0  # modelled seconds spent in steps (the rest of the clock is idle)
        # > 1 while the engine shares its cores with more work than they hold (sim/cluster.py SharedHost)
        self.time_scale = 1.0

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_spec.num_device_blocks

    def execute(self, plan: SchedulerOutput) -> StepResult:
        dt = self.cost.plan_time(plan) * self.time_scale
        self.clock.advance(dt)
        self.num_steps += 1
        self.busy_time += dt
        tok = self.token_id
        return StepResult(sampled=[tok if s.sample else -1 for s in plan.scheduled], step_time=dt)

    def shutdown(self) -> None:
        """No device state to release."""

    # P/D hand-off (sim/disagg.py): only the blocks' shape, hence their bytes, is modelled; the engine
    # waits for its copies, so they move its clock (they fall between its steps, as they do for real)
    def read_blocks(self, block_ids: list[int]) -> "SimulatedBlocks":
        s = self.kv_cache_spec
        blocks = SimulatedBlocks((s.num_layers, 2, len(block_ids), s.block_size, s.num_kv_heads, s.head_width),
                                 DTYPE_BYTES[s.dtype])
        if self.hardware.kv_send_bandwidth:
            self.clock.advance(blocks.nbytes / self.hardware.kv_send_bandwidth)
        return blocks

    def write_blocks(self, block_ids: list[int], blocks: "SimulatedBlocks") -> None:
        assert blocks.shape[2] == len(block_ids), (blocks.shape, len(block_ids))
        if self.hardware.kv_receive_bandwidth:
            self.clock.advance(blocks.nbytes / self.hardware.kv_receive_bandwidth)


@dataclass(frozen=True, slots=True)
class SimulatedBlocks:
    """Stands in for a request's KV blocks in [layers, 2, blocks, block_size, kv_heads, head width]
    (head_dim, or head_dim + 4 int8 elements with an int8 pool's scale)."""

    shape: tuple[int, ...]
    dtype_bytes: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype_bytes

    def __getitem__(self, key: tuple) -> "SimulatedBlocks":
        """Only the engine's blocks[:, :, first:] is used: a slice along the block axis."""
        return replace(self, shape=(*self.shape[:2], len(range(self.shape[2])[key[2]]), *self.shape[3:]))
