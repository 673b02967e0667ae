"""Every supported family against transformers, on a tiny random checkpoint made here (no downloads).

Each checkpoint is built with transformers (`from_config`, hidden 64, 2-3 layers, every norm weight
and bias randomized so each switch matters, a window of 8 positions so the prompts cross it) and
saved as safetensors. iterserve loads it through load_model_arch / load_weights and runs 4 prompts
x 16 greedy tokens through the engine (batched: prompts and decodes share steps, blocks of 4
positions so a window spans whole blocks). transformers' own model is teacher-forced on our tokens:
float32 greedy tokens must be equal at every position (which is equality with its greedy generate),
bfloat16 logprob-close (vLLM's check_logprobs_close). The same weights written as GGUF, as
llama.cpp's converter lays them out, must give the float32 tokens again.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.model.loader import load_model_arch, load_weights
from tests.engine.test_greedy_reference import close, generate, teacher_forced_view
from tests.model.test_loader import hf_permute

WINDOW, BLOCK, NEW_TOKENS, VOCAB = 8, 4, 16, 256
PROMPT_LENS = [3, 9, 17, 30]
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1, tie_word_embeddings=False)
LAYERS3 = ["sliding_attention", "sliding_attention", "full_attention"]
FAMILIES = {
    "llama": dict(model_type="llama"),
    "llama3.2": dict(model_type="llama", tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 5e5}),
    "mistral": dict(model_type="mistral", sliding_window=WINDOW),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3"),
    "gemma2": dict(model_type="gemma2", head_dim=64, num_hidden_layers=3, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                   tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", head_dim=64, num_hidden_layers=3, sliding_window=WINDOW,
                   layer_types=LAYERS3, query_pre_attn_scalar=24, tie_word_embeddings=True, rope_parameters={
                       "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "phi3": dict(model_type="phi3", max_position_embeddings=512, original_max_position_embeddings=256,
                 sliding_window=WINDOW, rope_parameters={
                     "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 1.0,
                     "short_factor": [1.0 + 0.3 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}),
    "olmo2": dict(model_type="olmo2"),
    "granite": dict(model_type="granite", embedding_multiplier=6.0, residual_multiplier=0.4,
                    attention_multiplier=0.2, logits_scaling=4.0),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
}


def build_checkpoint(path, family: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    kwargs = {**COMMON, **FAMILIES[family]}
    cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves norms at 1 (Gemma: 0) and biases at 0: make them matter
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "bias" in name or "gemma" in family else 1.0))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def run(path: str, dtype: str, prompts):
    arch = load_model_arch(path)
    config = EngineConfig(dtype=dtype, num_kv_blocks=64, block_size=BLOCK, num_threads=1)
    runner = ModelRunner(config, arch, load_weights(path, arch, getattr(torch, dtype)))
    return generate(runner, prompts, num_tokens=NEW_TOKENS, block_size=BLOCK, num_kv_blocks=64)[0]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow
def test_family_matches_transformers(tmp_path, family, prompts):
    hf = build_checkpoint(tmp_path / "hf", family)
    ours = run(str(tmp_path / "hf"), "float32", prompts)
    for i, (mine, (theirs, _)) in enumerate(zip(ours, teacher_forced_view(hf, prompts)(ours))):
        assert mine[0] == theirs, f"{family} prompt {i} ({PROMPT_LENS[i]} tokens): {mine[0]} vs transformers {theirs}"

    ours_bf16 = run(str(tmp_path / "hf"), "bfloat16", prompts)
    theirs_bf16 = teacher_forced_view(copy.deepcopy(hf).to(torch.bfloat16), prompts)(ours_bf16)
    for i, (a, b) in enumerate(zip(ours_bf16, theirs_bf16)):
        assert close(a, b, NEW_TOKENS), f"{family} bf16 prompt {i}: {a[0]} vs transformers {b[0]}"

    gguf_path = tmp_path / f"{family}.gguf"
    write_gguf(gguf_path, hf, tmp_path / "hf")
    assert [t for t, _ in run(str(gguf_path), "float32", prompts)] == [t for t, _ in ours]


# ---------------------------------------------------------------- the same checkpoint as GGUF

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3_text": "gemma3", "phi3": "phi3", "olmo2": "olmo2", "granite": "granite", "qwen3_moe": "qwen3moe",
             "mixtral": "llama"}


def write_gguf(path, hf, hf_dir) -> None:
    """What llama.cpp's convert_hf_to_gguf writes for the checkpoint in hf_dir, as far as the loader reads it:
    llama.cpp's tensor names, Q/K rows permuted for Llama and Granite, Gemma's norms with the 1 added,
    Phi-3's longrope factors as tensors."""
    import gguf
    c = hf.config
    arch = GGUF_ARCH[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    n = c.num_hidden_layers
    for key, val in [("block_count", n), ("context_length", c.max_position_embeddings),
                     ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                     ("attention.head_count", c.num_attention_heads), ("attention.head_count_kv", c.num_key_value_heads),
                     ("attention.key_length", c.head_dim), ("attention.value_length", c.head_dim),
                     ("vocab_size", c.vocab_size)]:
        w.add_uint32(f"{arch}.{key}", val)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_uint32("tokenizer.ggml.eos_token_id", c.eos_token_id)
    if getattr(c, "sliding_window", None):
        w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
        if getattr(c, "layer_types", None):
            w.add_array(f"{arch}.attention.sliding_window_pattern", [t == "sliding_attention" for t in c.layer_types])
    gemma = c.model_type.startswith("gemma")
    if gemma:
        w.add_float32(f"{arch}.attention.scale", c.query_pre_attn_scalar ** -0.5)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, key, None):
            w.add_float32(f"{arch}.{key}", getattr(c, key))
    if c.model_type == "gemma3_text":
        w.add_float32(f"{arch}.rope.freq_base_swa", c.rope_parameters["sliding_attention"]["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    if c.model_type == "granite":
        for key, val in [("embedding_scale", c.embedding_multiplier), ("residual_scale", c.residual_multiplier),
                         ("attention.scale", c.attention_multiplier), ("logit_scale", c.logits_scaling)]:
            w.add_float32(f"{arch}.{key}", val)
    from safetensors.numpy import load_file
    state = {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if experts:  # llama.cpp stacks each layer's experts into one [experts, out, in] tensor per projection
        w.add_uint32(f"{arch}.expert_count", experts)
        w.add_uint32(f"{arch}.expert_used_count", c.num_experts_per_tok)
        w.add_uint32(f"{arch}.expert_feed_forward_length", getattr(c, "moe_intermediate_size", c.intermediate_size))
        state = stack_experts(state, experts)
    if rope.get("rope_type") == "llama3":  # llama.cpp stores llama3 scaling as per-frequency divisors
        from iterserve.model.llama import _llama3_scale
        base = rope["rope_theta"] ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        w.add_tensor("rope_freqs.weight", ((1 / base) / _llama3_scale(1 / base, rope)).float().numpy())
    if rope.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        factor = c.max_position_embeddings / rope["original_max_position_embeddings"]
        w.add_float32(f"{arch}.rope.scaling.attn_factor",
                      float(np.sqrt(1 + np.log(factor) / np.log(rope["original_max_position_embeddings"]))))
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n)
    for name, t in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        stem, suffix = name.rsplit(".", 1)
        if ".experts." in stem or stem.endswith(("mlp.gate", "block_sparse_moe.gate")):
            layer, what = stem.split(".")[2], stem.rsplit(".", 1)[1]
            stem = f"blk.{layer}.ffn_{'gate_inp' if what == 'gate' else what[:-5] + '_exps'}"
            w.add_tensor(f"{stem}.{suffix}", np.ascontiguousarray(t))
            continue
        if arch in ("llama", "granite") and stem.endswith(("q_proj", "k_proj")):
            t = hf_permute(t, c.num_attention_heads if stem.endswith("q_proj") else c.num_key_value_heads)
        if gemma and stem.endswith("norm"):
            t = t + 1
        w.add_tensor(f"{names.get_name(stem)}.{suffix}", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def stack_experts(state: dict[str, np.ndarray], experts: int) -> dict[str, np.ndarray]:
    """HF's per-expert tensors (Mixtral's w1/w3/w2 named as Qwen3-MoE's) as one stacked tensor per layer."""
    renames = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    out, stacks = {}, {}
    for name, t in state.items():
        parts = [renames.get(x, x) for x in name.split(".")]
        if "experts" in parts:
            i = parts.index("experts")
            stacks.setdefault(".".join(parts[:i + 1] + parts[i + 2:]), {})[int(parts[i + 1])] = t
        else:
            out[".".join(parts)] = t
    for name, per_expert in stacks.items():
        out[name] = np.stack([per_expert[j] for j in range(experts)])
    return out


# ---------------------------------------------------------------- what is refused, and EOS ids

def test_unknown_model_type_is_refused_by_name(tmp_path):
    build_checkpoint(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    with pytest.raises(ValueError, match=r"unsupported model_type 'mamba': iterserve implements llama, mistral.*gemma2"):
        load_model_arch(str(tmp_path))


def test_unknown_rope_type_is_refused_by_name(tmp_path):
    build_checkpoint(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported rope type 'yarn': iterserve implements default, linear, llama3"):
        load_model_arch(str(tmp_path))


def test_unknown_gguf_architecture_and_tensor_are_refused_by_name(tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_uint32("mamba.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'mamba': iterserve implements llama, qwen2"):
        load_model_arch(str(tmp_path / "m.gguf"))

    hf = build_checkpoint(tmp_path / "hf", "llama")
    write_gguf(tmp_path / "llama.gguf", hf, tmp_path / "hf")
    from gguf import GGUFReader, GGUFWriter
    src = GGUFReader(str(tmp_path / "llama.gguf"))
    w = GGUFWriter(str(tmp_path / "extra.gguf"), "llama")
    for f in src.fields.values():
        if f.name.startswith("llama.") or f.name.startswith("tokenizer."):
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in src.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape([int(d) for d in reversed(t.shape)]))
    w.add_tensor("blk.0.ssm_conv1d.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = str(tmp_path / "extra.gguf")
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor 'blk.0.ssm_conv1d.weight' in a llama model"):
        load_weights(path, load_model_arch(path))


def test_every_eos_id_is_read(tmp_path):
    build_checkpoint(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [7, 9]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 11]}))
    assert load_model_arch(str(tmp_path)).eos_token_ids == [7, 9, 11]


def test_a_checkpoint_with_two_eos_ids_stops_on_the_second(tmp_path, prompts):
    """eos_token_id [a, b]: generation stops at the first b, as it would at a."""
    from iterserve.engine import Engine
    from iterserve.sampling_params import SamplingParams
    build_checkpoint(tmp_path, "llama")
    free = run(str(tmp_path), "float32", prompts[:1])[0][0]  # EOS ignored: where b falls unhindered
    b = free[5]
    a = next(t for t in range(3, VOCAB) if t not in free)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [a, b]}))
    arch = load_model_arch(str(tmp_path))
    config = EngineConfig(dtype="float32", num_kv_blocks=64, block_size=BLOCK, num_threads=1)
    engine = Engine(config, executor=ModelRunner(config, arch, load_weights(str(tmp_path), arch)))
    engine.add_request(prompts[0], SamplingParams(max_tokens=NEW_TOKENS, temperature=0), request_id="r")
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].token_ids == free[: free.index(b) + 1] and outputs[0].finish_reason == "stop"
