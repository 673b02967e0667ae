"""The executor the simulator plugs into the real engine: a cost model instead of a model, and a
virtual clock that jumps by each step's modelled time instead of waiting for it."""
from __future__ import annotations

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
    """Satisfies the executor protocol. Output tokens are placeholders (token id `token_id`):
    the bench sets max_tokens to the trace's output length with ignore_eos, so requests finish
    exactly where the trace says, and no EOS or tokenizer exists here."""

    eos_token_id = None
    tokenizer = None

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, tp: int = 1, num_kv_blocks: int | None = None,
                 block_size: int = 16, gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256, num_host_blocks: int = 0, max_model_len: int | None = None,
                 clock: VirtualClock | None = None, token_id: int = 0, kv_cache_memory: int = 1 << 30):
        self.cost = CostModel(model, hardware, tp)
        self.model, self.hardware, self.tp = model, hardware, tp
        if num_kv_blocks is None and hardware.kind == "cpu":  # the CPU engine's rule: a fixed byte budget
            num_kv_blocks = max(1, kv_cache_memory // (block_size * model.kv_bytes_per_token))
        self.num_kv_blocks = num_kv_blocks or self.cost.num_kv_blocks(
            block_size, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)
        self.num_host_blocks = num_host_blocks
        self.max_model_len = max_model_len or model.max_model_len
        self.clock = clock or VirtualClock()
        self.token_id = token_id
        self.num_steps = 0
        self.busy_time = 0.0  # modelled seconds spent in steps (the rest of the clock is idle)

    def execute(self, plan: SchedulerOutput) -> StepResult:
        dt = self.cost.plan_time(plan)
        self.clock.advance(dt)
        self.num_steps += 1
        self.busy_time += dt
        tok = self.token_id
        return StepResult(sampled=[tok if s.sample else -1 for s in plan.scheduled], step_time=dt)

    # the real runner owns device state; the engine may call these, and here there is nothing to do
    def shutdown(self) -> None:
        pass


def host_blocks_for(swap_space_bytes: int, model: ModelSpec, block_size: int, tp: int = 1) -> int:
    """Host swap pool in blocks, the way --swap-space sizes it: bytes per GPU / bytes per block."""
    block_bytes = block_size * model.kv_bytes_per_token / min(tp, model.num_kv_heads)
    return int(swap_space_bytes // block_bytes)
