"""The executor contract: what the Engine needs from whatever runs a plan (docs/architecture.md).

Implementations: ModelRunner (the real model), the tensor-parallel executor, SimulatedExecutor
(a cost model on a virtual clock), calibrate's timing executor and the tests' fake executors.
The Engine checks the contract once, at construction: a missing attribute fails there, loudly,
instead of defaulting to something that quietly changes behaviour. Torch-free.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from iterserve.contract import members, missing_members
# kv_head_width and num_blocks_for are re-exported: model_runner.py still imports them from here.
from iterserve.kv.spec import KVCacheSpec, kv_head_width, num_blocks_for  # noqa: F401
from iterserve.scheduler.output import SchedulerOutput, StepResult

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


@runtime_checkable
class PoolingExecutor(Protocol):
    """An executor that pools prompts' hidden states into embeddings (SamplingParams.pooling, StepResult.pooled);
    not part of the Executor contract: fakes, tensor-parallel and remote executors do not."""

    supports_pooling: bool


@runtime_checkable
class DeviceExecutor(Protocol):
    """An executor that runs the model on one device of this machine (the ModelRunner); not part of the
    Executor contract: fakes, cost models and ranks in other processes do not. The diagnostics' what-if
    models a CPU one with this machine's profile (sim/server_whatif.py)."""

    device_type: str  # "cpu", "cuda"


class LoRANotFoundError(ValueError):
    """No LoRA adapter of that name is loaded (HTTP: 404)."""


@runtime_checkable
class LoRAExecutor(Protocol):
    """An executor that runs requests under LoRA adapters (SamplingParams.lora_name; model/lora.py), loaded and
    unloaded between steps; not part of the Executor contract: the ModelRunner alone does."""

    lora_adapters: dict[str, str]  # loaded name -> path

    def load_lora(self, name: str, path: str) -> None: ...

    def unload_lora(self, name: str) -> None: ...


def check_executor(executor: object) -> None:
    """Raise TypeError naming every part of the contract the executor lacks or gets wrong."""
    name = type(executor).__name__
    missing = missing_members(executor, members(Executor))
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
