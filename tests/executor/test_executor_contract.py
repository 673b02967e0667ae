"""The executor contract: checked once at Engine construction, loudly."""
import re
from pathlib import Path

import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.executor.base import check_executor
from iterserve.kv.spec import KVCacheSpec
from tests.fake_executor import FakeExecutor


class _Mistyped:
    """What an executor written before the contract looked like: probed attributes, no spec."""

    num_kv_blocks = 64
    max_model_len = 512
    tokenizer = None
    eos_token_ids = {2}  # a set, not a frozenset

    def execute(self, plan):
        raise AssertionError("never reached")


def test_a_mistyped_executor_fails_at_construction_naming_what_is_missing():
    with pytest.raises(TypeError, match="_Mistyped does not implement the Executor contract: "
                                        "missing kv_cache_spec, vocab_size, shutdown"):
        Engine(EngineConfig(), executor=_Mistyped())


def test_wrong_types_are_named_too():
    ex = FakeExecutor()
    ex.eos_token_ids = {2}
    ex.kv_cache_spec = {"block_size": 16}
    with pytest.raises(TypeError) as info:
        check_executor(ex)
    assert "kv_cache_spec is a dict, not a KVCacheSpec" in str(info.value)
    assert "eos_token_ids is a set, not a frozenset" in str(info.value)


def test_auto_preemption_needs_costs_from_the_executor():
    ex = FakeExecutor(num_host_blocks=8, swap_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="reports no cost"):
        Engine(EngineConfig(preemption_mode="auto"), executor=ex)
    Engine(EngineConfig(preemption_mode="swap"), executor=ex)  # swap and recompute need no prices


def test_kv_cache_spec_checks_itself():
    spec = KVCacheSpec(16, 100, 0, 30, 3, 64, "bfloat16")
    assert spec.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 2
    with pytest.raises(ValueError, match="KV dtype"):
        KVCacheSpec(16, 100, 0, 30, 3, 64, "fp64")
    with pytest.raises(ValueError, match="num_device_blocks must be >= 1"):
        KVCacheSpec(16, 0, 0, 30, 3, 64, "bfloat16")


def test_no_getattr_probe_of_an_executor_remains():
    """The contract replaced `getattr(executor, name, default)` probes; none may come back."""
    root = Path(__file__).resolve().parents[2] / "iterserve"
    probes = [f"{p}:{i}" for p in root.rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"getattr\(.*executor", line)]
    assert not probes, probes
