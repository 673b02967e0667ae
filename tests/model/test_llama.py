"""Our model against transformers on tiny random checkpoints (fast), and paged attention on its own."""
from __future__ import annotations

import pytest
import torch

from iterserve.model import cpu_kernels
from iterserve.model.attention import build_plan, paged_attention
from iterserve.model.attention_metadata import AttentionMetadata
from iterserve.model.llama import LlamaModel
from iterserve.model.loader import load_model_arch, load_weights
from iterserve.model.quant import PanelWeight

BS = 4


def metadata(q_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    slots, starts = [], [0]
    for q, s, t in zip(q_lens, seq_lens, tables):
        slots += [t[p // BS] * BS + p % BS for p in range(s - q, s)]
        starts.append(starts[-1] + q)
    width = max(map(len, tables))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_lens_list=q_lens, seq_lens_list=seq_lens)


def reference_attention(q, k, v, scale, window=0, softcap=0.0):
    """One sequence, whole context in hand: q [Tq, H, D] at the end of k/v [Tk, Hkv, D]; window: each
    query sees only the last `window` positions; softcap: scores = softcap * tanh(scores / softcap)."""
    tq, tk, g = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = torch.tanh(s / softcap) * softcap if softcap else s
    mask = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
    if window:
        mask &= ~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq - window)
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (3, 0.0), (6, 0.0), (4, 1.5), (0, 1.5)])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_paged_attention_mixed_batch_matches_reference(window, softcap, use_kernel):
    """A decode, a fresh prompt, a later chunk and another decode in one flat batch; windowed and
    soft-capped too, through the torch gather and the C++ decode kernel."""
    if use_kernel and cpu_kernels.decode_attention_kernel() is None:
        pytest.skip("no C++ compiler here")
    torch.manual_seed(0)
    H, HKV, D = 4, 2, 8
    seq_lens, q_lens = [9, 5, 11, 3], [1, 5, 4, 1]
    tables = [[3, 0, 7], [1, 2], [4, 5, 6], [8]]
    cache = torch.zeros(2, 10, BS, HKV, D)
    full_k = [torch.randn(s, HKV, D) for s in seq_lens]
    full_v = [torch.randn(s, HKV, D) for s in seq_lens]
    for t, s, q, k, v in zip(tables, seq_lens, q_lens, full_k, full_v):  # earlier steps' K/V
        for p in range(s - q):
            cache[0, t[p // BS], p % BS], cache[1, t[p // BS], p % BS] = k[p], v[p]
    qs = [torch.randn(q, H, D) for q in q_lens]
    md = metadata(q_lens, seq_lens, tables)
    new = lambda xs: torch.cat([x[s - q:] for x, s, q in zip(xs, seq_lens, q_lens)])  # noqa: E731
    plan = build_plan(md, BS, torch.float32, use_kernel=use_kernel)
    out = paged_attention(torch.cat(qs), new(full_k), new(full_v), cache, plan, 0.3, window, softcap)
    want = torch.cat([reference_attention(q, k, v, 0.3, window, softcap) for q, k, v in zip(qs, full_k, full_v)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def tiny_checkpoint(tmp_path, kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    else:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64, "rope_theta": 10000.0} if kind == "llama3" else None
        cfg = LlamaConfig(**common, tie_word_embeddings=kind == "tied", rope_scaling=scaling)
        model = LlamaForCausalLM(cfg)
    if kind == "qwen2":  # random init leaves biases at zero: make the switch matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias)
    model.eval().save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("kind", ["llama", "tied", "llama3", "qwen2"])
def test_tiny_models_match_transformers(tmp_path, kind):
    hf = tiny_checkpoint(tmp_path, kind)
    cfg = load_model_arch(str(tmp_path))
    assert cfg.attention_bias == (kind == "qwen2")
    model = LlamaModel(cfg, load_weights(str(tmp_path), cfg), BS)
    ids = torch.randint(0, 128, (150,))
    cache = torch.zeros(cfg.num_layers, 2, 64, BS, cfg.num_kv_heads, cfg.head_dim)
    with torch.inference_mode():
        want = hf(ids[None]).logits[0]
        a = model.forward(ids[:100], torch.arange(100), cache, metadata([100], [100], [list(range(25))]),
                          torch.arange(100))  # prompt, then a chunk reading its context from the cache
        b = model.forward(ids[100:], torch.arange(100, 150), cache,
                          metadata([50], [150], [list(range(38))]), torch.arange(50))
    torch.testing.assert_close(torch.cat([a, b]), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["tied", "qwen2"])  # the LM head from the embedding; biases in float32
def test_bf16_storage_matches_transformers_on_the_rounded_weights(tmp_path, kind):
    """bfloat16 weights and cache under float32 arithmetic: transformers' float32 model on the same
    bf16-rounded weights, apart from the K/V rounding (a decode then reads what the prompt wrote)."""
    if cpu_kernels.linear_kernel() is None:
        pytest.skip("cpu_linear.cpp not built here")
    hf = tiny_checkpoint(tmp_path, kind)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    cfg = load_model_arch(str(tmp_path))
    model = LlamaModel(cfg, load_weights(str(tmp_path), cfg, torch.bfloat16), BS, dtype=torch.float32)
    assert isinstance(model.lm_head, PanelWeight) and model.lm_head.panels.dtype == torch.bfloat16
    ids = torch.randint(0, 128, (60,))
    cache = torch.zeros(cfg.num_layers, 2, 64, BS, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = hf(ids[None]).logits[0]
        a = model.forward(ids[:59], torch.arange(59), cache, metadata([59], [59], [list(range(15))]), torch.arange(59))
        b = model.forward(ids[59:], torch.tensor([59]), cache, metadata([1], [60], [list(range(15))]),
                          torch.arange(1))
    got = torch.cat([a, b])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


def test_bf16_storage_refuses_other_weight_dtypes(tmp_path):
    tiny_checkpoint(tmp_path, "llama")
    cfg = load_model_arch(str(tmp_path))
    with pytest.raises(ValueError, match="bfloat16 weights"):
        LlamaModel(cfg, load_weights(str(tmp_path), cfg, torch.float16), BS, dtype=torch.float32)
