"""The executor contract: what the Engine needs from whatever runs a plan (docs/architecture.md).

Implementations: ModelRunner (the real model), the tensor-parallel executor, SimulatedExecutor
(a cost model on a virtual clock), calibrate's timing executor and the tests' fake executors.
The Engine checks the contract once, at construction: a missing attribute fails there, loudly,
instead of defaulting to something that quietly changes behaviour. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from iterserve.scheduler.output import SchedulerOutput, StepResult

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}
# A quantized pool stores each (token, kv head)'s values followed by their float32 scale
# (--kv-cache-dtype int8): head_dim + 4 int8 elements where a float pool holds head_dim.
KV_SCALE_BYTES = {"int8": 4}


def kv_head_width(head_dim: int, dtype: str) -> int:
    """Elements (of the pool's dtype) one token's K, or V, of one kv head takes in the pool."""
    return head_dim + KV_SCALE_BYTES.get(dtype, 0) // DTYPE_BYTES[dtype]


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V of every layer for block_size tokens, scales included."""
    return 2 * num_layers * block_size * num_kv_heads * kv_head_width(head_dim, dtype) * DTYPE_BYTES[dtype]


def num_blocks_for(memory_bytes: int, block_bytes: int) -> int:
    """The one KV-pool sizing rule: whole blocks in a byte budget (at least one)."""
    return max(1, int(memory_bytes // block_bytes))


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The paged KV cache an executor allocated, and what moving or rebuilding a block costs."""

    block_size: int
    num_device_blocks: int
    num_host_blocks: int  # the swap pool; 0 without one
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    # Costs that decide swap vs recompute under --preemption-mode auto: measured at start-up on the
    # real model, taken from the hardware spec in the simulator; 0.0 where not known.
    swap_bytes_per_s: float = 0.0  # device -> host -> device copy bandwidth
    recompute_tokens_per_s: float = 0.0  # prompt tokens computed per second

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KV dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("block_size", "num_device_blocks", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def head_width(self) -> int:
        """The pool's last dimension: head_dim, plus an int8 pool's scale (blocks travel with it)."""
        return kv_head_width(self.head_dim, self.dtype)


class ExecutorDeadError(RuntimeError):
    """The executor can run no further step (a tensor-parallel rank died). The Engine lets it through
    instead of failing only the step's requests; the AsyncEngine then fails every request."""


class Executor(Protocol):
    kv_cache_spec: KVCacheSpec
    max_model_len: int  # the longest sequence the model (not the pool) can take
    vocab_size: int | None  # None: prompts' token ids are not range-checked
    eos_token_ids: frozenset[int]  # generation stops on any of them (empty: no EOS)
    tokenizer: object | None  # a transformers tokenizer, or None: prompts must be token ids

    def execute(self, plan: SchedulerOutput) -> StepResult: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class KVBlockIO(Protocol):
    """An executor whose KV blocks can be read out and written in, in rows of the pool's shape (the hand-off
    of disaggregated prefill); not part of the Executor contract, which every executor meets."""

    def read_blocks(self, block_ids: list[int]): ...

    def write_blocks(self, block_ids: list[int], blocks) -> None: ...


_REQUIRED = ("kv_cache_spec", "max_model_len", "vocab_size", "eos_token_ids", "tokenizer", "execute", "shutdown")


def check_executor(executor: object) -> None:
    """Raise TypeError naming every part of the contract the executor lacks or gets wrong."""
    name = type(executor).__name__
    missing = [a for a in _REQUIRED if not hasattr(executor, a)]
    if missing:
        raise TypeError(f"{name} does not implement the Executor contract: missing {', '.join(missing)}")
    wrong = []
    if not isinstance(executor.kv_cache_spec, KVCacheSpec):
        wrong.append(f"kv_cache_spec is a {type(executor.kv_cache_spec).__name__}, not a KVCacheSpec")
    if not isinstance(executor.eos_token_ids, frozenset):
        wrong.append(f"eos_token_ids is a {type(executor.eos_token_ids).__name__}, not a frozenset")
    if not isinstance(executor.max_model_len, int) or executor.max_model_len < 2:
        wrong.append(f"max_model_len is {executor.max_model_len!r}, not an integer >= 2")
    for method, value in (("execute", executor.execute), ("shutdown", executor.shutdown)):
        if not callable(value):
            wrong.append(f"{method} is not callable")
    if wrong:
        raise TypeError(f"{name} does not implement the Executor contract: {'; '.join(wrong)}")
