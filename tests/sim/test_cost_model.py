"""The cost model against published measurements and against its own first principles."""
import math
from dataclasses import replace

import pytest

from iterserve.sim.cost_model import CostModel
from iterserve.sim.hardware import PRESETS, HardwareSpec, get_hardware
from iterserve.sim.model_spec import MODEL_PRESETS, get_model_spec

# lmdeploy's measured per-token decode latency, Llama-2-7B fp16 on one A100-80GB
# (batch size, context length per request, measured ms). Acceptance: within 15%.
LMDEPLOY_A100_80GB_LLAMA2_7B = [
    (1, 128, 9.5),
    (32, 256, 11.5),
    (32, 1100, 21.0),
    (32, 3000, 40.0),
]


@pytest.mark.parametrize("batch,context,measured_ms", LMDEPLOY_A100_80GB_LLAMA2_7B)
def test_decode_step_matches_lmdeploy(batch, context, measured_ms):
    cm = CostModel(get_model_spec("llama-2-7b"), get_hardware("a100-80gb"))
    modelled_ms = cm.decode_step_time(batch, context) * 1e3
    assert abs(modelled_ms - measured_ms) / measured_ms < 0.15, (modelled_ms, measured_ms)


def test_presets_have_published_parameter_counts():
    counts = {"llama-2-7b": 6.74e9, "llama-3-8b": 8.03e9, "llama-3-70b": 70.55e9, "mistral-7b": 7.24e9,
              "opt-13b": 12.85e9, "smollm2-135m": 0.135e9}
    for name, n in counts.items():
        assert get_model_spec(name).num_params == pytest.approx(n, rel=0.02), name


def test_kv_bytes_per_token():
    # 2 (K, V) * layers * kv_heads * head_dim * dtype bytes
    assert get_model_spec("llama-2-7b").kv_bytes_per_token == 2 * 32 * 32 * 128 * 2
    assert get_model_spec("llama-3-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_a_checkpoint_is_read_by_the_engine_loader(tmp_path):
    """One config.json parser: the simulator reads a directory through the engine's own loader."""
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
        "max_position_embeddings": 512}))
    spec = get_model_spec(str(tmp_path / "config.json"), dtype_bytes=4)
    assert (spec.head_dim, spec.num_kv_heads, spec.dtype_bytes, spec.gated_mlp, spec.max_model_len) == \
        (16, 2, 4, True, 512)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 64}))
    with pytest.raises(ValueError, match="mamba"):
        get_model_spec(str(tmp_path))
    opt = MODEL_PRESETS["opt-13b"]
    assert not opt.gated_mlp and opt.tie_word_embeddings and opt.intermediate_size == 20480


def test_decode_is_memory_bound_and_prefill_compute_bound():
    cm = CostModel(get_model_spec("llama-2-7b"), get_hardware("a100-80gb"))
    d = cm.breakdown([1], [128])
    assert d.linear_s == pytest.approx(cm.weight_bytes_per_step / cm.mem_bw, rel=0.01)
    p = cm.breakdown([2048], [2048])
    flops = 2048 * cm.flops_per_token + cm.flops_per_logit_row
    assert p.linear_s == pytest.approx(flops / cm.linear_flops_rate)


def test_prefill_attention_is_quadratic_in_chunk_length():
    cm = CostModel(get_model_spec("llama-2-7b"), get_hardware("a100-80gb"))
    a1 = cm.breakdown([4096], [4096]).attention_s
    a2 = cm.breakdown([8192], [8192]).attention_s
    assert 3.8 < a2 / a1 < 4.2


def test_chunked_prefill_sees_earlier_chunks():
    cm = CostModel(get_model_spec("llama-2-7b"), get_hardware("a100-80gb"))
    first = cm.breakdown([512], [512]).attention_s
    second = cm.breakdown([512], [1024]).attention_s
    assert second > first


def test_tensor_parallel_splits_weights_and_adds_allreduce():
    spec, hw = get_model_spec("llama-3-70b"), get_hardware("h100-sxm")
    one, four = CostModel(spec, hw, tp=1), CostModel(spec, hw, tp=4)
    assert four.weight_bytes_per_step == pytest.approx(one.weight_bytes_per_step / 4)
    b = four.breakdown([1] * 8, [512] * 8)
    assert b.allreduce_s > 0 and one.breakdown([1] * 8, [512] * 8).allreduce_s == 0
    assert four.decode_step_time(8, 512) < one.decode_step_time(8, 512) / 2
    with pytest.raises(ValueError):
        CostModel(spec, hw, tp=3)


def test_swap_priced_at_host_link_bandwidth():
    cm = CostModel(get_model_spec("llama-2-7b"), get_hardware("a100-80gb"))
    block_bytes = 16 * cm.kv_bytes_per_token
    assert cm.transfer_time(10, 16) == pytest.approx(10 * block_bytes / cm.hw.host_link_bandwidth)


def test_kv_pool_size_like_a_gpu_engine():
    spec, hw = get_model_spec("llama-2-7b"), get_hardware("a100-80gb")
    cm = CostModel(spec, hw)
    blocks = cm.num_kv_blocks(block_size=16, gpu_memory_utilization=0.9)
    free = hw.memory_bytes * 0.9 - spec.weight_bytes - cm.activation_bytes(2048, 256) - hw.reserved_bytes
    assert blocks == math.floor(free / (16 * spec.kv_bytes_per_token))
    assert 6000 < blocks < 8000  # ~ 55 GB of KV: vLLM reports ~7k blocks for this pairing
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(get_model_spec("llama-3-70b"), get_hardware("a100-40gb")).num_kv_blocks()


def test_hardware_round_trips_through_json():
    hw = PRESETS["h200"]
    assert HardwareSpec.from_json(hw.to_json()) == hw
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu-v9")


def test_plan_time_fast_path_agrees_with_breakdown():
    from iterserve.sampling_params import SamplingParams
    from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput
    p = SamplingParams()
    for tp, model, hw, fused in [(1, "llama-2-7b", "a100-80gb", True), (4, "llama-3-70b", "h100-sxm", True),
                                 (1, "llama-2-7b", "a100-80gb", False)]:
        cm = CostModel(get_model_spec(model), replace(get_hardware(hw), fused_attention=fused), tp)
        reqs = [ScheduledRequest("a", [1] * 300, 256, [], False, p), ScheduledRequest("b", [1], 999, [], True, p),
                ScheduledRequest("c", [1] * 64, 0, [], True, p)]
        plan = SchedulerOutput(reqs, 16, swap_out=[(1, 2)] * 3, swap_in=[(4, 5)] * 2)
        expected = cm.breakdown([300, 1, 64], [556, 1000, 64], swap_blocks=5, block_size=16).total_s
        assert cm.plan_time(plan) == pytest.approx(expected)
        assert cm.plan_time(SchedulerOutput([], 16, swap_in=[(0, 1)])) == pytest.approx(cm.transfer_time(1, 16))


def test_separate_attention_kernels_cost_the_sum_of_their_rooflines():
    """The CPU path runs decode rows and prompt chunks through two kernels, one after the other."""
    model, hw = get_model_spec("llama-2-7b"), get_hardware("a100-80gb")
    fused, split = CostModel(model, hw), CostModel(model, replace(hw, fused_attention=False))
    decode_only, prompt_only = ([1] * 8, [2048] * 8), ([512], [1024])
    mixed = ([1] * 8 + [512], [2048] * 8 + [1024])
    for cm in (fused, split):  # one kind of row: the same price either way
        assert cm.breakdown(*decode_only).attention_s == pytest.approx(fused.breakdown(*decode_only).attention_s)
    parts = split.breakdown(*decode_only).attention_s + split.breakdown(*prompt_only).attention_s
    assert split.breakdown(*mixed).attention_s == pytest.approx(parts)
    assert fused.breakdown(*mixed).attention_s < parts


def test_mixed_step_overheads_price_only_steps_with_both_kinds():
    from iterserve.sampling_params import SamplingParams
    from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput
    model, hw = get_model_spec("smollm2-135m"), replace(get_hardware("a100-80gb"), fused_attention=False)
    plain = CostModel(model, hw)
    cm = CostModel(model, replace(hw, mixed_step_overhead_s=0.01, mixed_seq_overhead_s=0.002))
    decode_only, prompt_only = ([1] * 8, [100] * 8), ([512], [1024])
    mixed = ([1] * 8 + [512], [100] * 8 + [1024])
    assert cm.step_time(*decode_only) == plain.step_time(*decode_only)
    assert cm.step_time(*prompt_only) == plain.step_time(*prompt_only)
    assert cm.step_time(*mixed) == pytest.approx(plain.step_time(*mixed) + 0.01 + 8 * 0.002)
    p = SamplingParams()
    plan = SchedulerOutput([ScheduledRequest(f"d{i}", [1], 99, [], True, p) for i in range(8)]
                           + [ScheduledRequest("p", [1] * 512, 512, [], True, p)], 16)
    assert cm.plan_time(plan) == pytest.approx(cm.step_time(*mixed))


def test_specs_without_the_later_fields_write_the_json_they_always_did():
    """A GPU preset or an old profile has the mixed-step overheads at 0: its JSON has no such keys."""
    for hw in PRESETS.values():
        assert not {"mixed_step_overhead_s", "mixed_seq_overhead_s"} & set(hw.to_json())
        assert HardwareSpec.from_json(hw.to_json()) == hw
    hw = replace(PRESETS["h200"], mixed_seq_overhead_s=0.001)
    assert hw.to_json()["mixed_seq_overhead_s"] == 0.001 and HardwareSpec.from_json(hw.to_json()) == hw
