"""step_check: real step records turned back into step shapes and priced (no model runs here)."""
import dataclasses

import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.outputs import StepRecord
from iterserve.sampling_params import SamplingParams
from iterserve.sim.cli import make_engine
from iterserve.sim.cost_model import CostModel
from iterserve.sim.hardware import HardwareSpec, get_hardware
from iterserve.sim.model_spec import get_model_spec
from iterserve.sim.step_check import check_steps, format_check, shapes_from_records, step_kind


def _record(start, end, prefill=(), decode=(), prefill_tokens=0):
    return StepRecord(start, end, 0, 0, prefill_tokens + len(decode), 0.0, list(prefill), list(decode), [],
                      prefill_tokens)


def _cost():
    hw = HardwareSpec("cpu", memory_bytes=16 << 30, mem_bandwidth=10e9, peak_flops=100e9, reserved_bytes=0,
                      step_overhead_s=0.01, seq_overhead_s=0.001, fused_attention=False, kind="cpu")
    return CostModel(get_model_spec("smollm2-135m"), hw)


def test_shapes_replay_chunks_decodes_and_handoffs():
    prompts = {"a": 700, "b": 64, "h": 100}
    records = [
        _record(0.0, 1.0, prefill=["a"], prefill_tokens=512),
        _record(1.1, 2.0, prefill=["a", "b"], prefill_tokens=188 + 64),  # a's last chunk, then b whole
        _record(2.1, 2.2, decode=["a", "b", "h"]),  # h: a hand-off, first seen decoding
        _record(2.3, 2.4, decode=["a"]),
    ]
    shapes = shapes_from_records(records, prompts)
    assert [(s.q_lens, s.ctx_lens) for s in shapes] == [
        ([512], [512]), ([188, 64], [700, 64]), ([1, 1, 1], [701, 65, 101]), ([1], [702])]
    assert [s.kind for s in shapes] == ["prefill", "prefill", "decode", "decode"]
    assert step_kind([1, 64]) == "mixed"


def test_shapes_start_past_a_prefix_cache_hit_where_the_engine_records_it():
    """A prompt of 1,088 tokens with 1,024 cached computes 64 at context 1,088, and decodes from there;
    the engine's own record says where the chunk started."""
    engine = make_engine(EngineConfig(model=None), get_model_spec("smollm2-135m"), get_hardware("a100-80gb"))
    assert isinstance(engine, Engine)
    system = list(range(1000, 2024))
    prompts = {"a": system + [7] * 64, "b": system + [8] * 64}
    for rid, ids in prompts.items():
        engine.add_request(ids, SamplingParams(max_tokens=2, ignore_eos=True), request_id=rid)
        while engine.has_unfinished():
            engine.step()
    shapes = shapes_from_records(list(engine.step_records), {rid: len(ids) for rid, ids in prompts.items()})
    b_prefill, b_decode = shapes[-2:]
    assert (b_prefill.q_lens, b_prefill.ctx_lens) == ([64], [1088])
    assert (b_decode.q_lens, b_decode.ctx_lens) == ([1], [1089])
    older = [dataclasses.replace(r, prefill_starts=[]) for r in engine.step_records]  # records without starts
    assert shapes_from_records(older, {rid: len(ids) for rid, ids in prompts.items()})[-2].ctx_lens == [64]


def test_check_prices_each_kind_and_counts_only_busy_gaps():
    prompts = {"a": 64, "b": 64, "c": 64}
    cost = _cost()
    records = [
        _record(0.0, 0.5, prefill=["a"], prefill_tokens=64),
        _record(0.6, 0.7, decode=["a"]),  # 0.1 s after the prefill: a busy gap (a goes on)
        _record(0.8, 1.5, prefill=["b"], decode=["a"], prefill_tokens=64),  # mixed, 0.1 s gap before
        _record(5.0, 5.1, decode=["c"]),  # c shares nothing with the step before: the gap is idle
    ]
    rows = {r["kind"]: r for r in check_steps(shapes_from_records(records, prompts), cost)}
    assert rows["prefill"]["steps"] == 1 and rows["prefill"]["gap_s"] == pytest.approx(0.1)
    assert rows["decode"]["steps"] == 2 and rows["decode"]["gap_s"] == pytest.approx(0.1)
    assert rows["mixed"]["gap_s"] == 0.0  # the idle gap after it is not counted
    assert rows["mixed"]["batch"] == 2 and rows["mixed"]["tokens"] == 65
    assert rows["mixed"]["priced_s"] == pytest.approx(cost.step_time([64, 1], [64, 66]))
    assert rows["all"]["steps"] == 4
    assert rows["all"]["real_s"] == pytest.approx(0.5 + 0.1 + 0.1 + 0.1 + 0.7 + 0.1)
    assert rows["all"]["error"] == pytest.approx(rows["all"]["priced_s"] / rows["all"]["real_s"] - 1)
    text = format_check("real engine", list(rows.values()))
    assert "mixed" in text and "price err" in text
