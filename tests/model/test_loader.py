from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from iterserve.model.loader import (ModelArch, gguf_to_hf_name, load_model_arch, load_tokenizer,
                                    load_weights, unpermute_qk)

H, HEADS, KV, D, FF, VOCAB, LAYERS = 64, 4, 2, 16, 128, 96, 2


def hf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute, which the loader must undo."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, qtype: Q) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF with random weights in `qtype`; returns what each HF tensor should load as."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    for key, val in [("block_count", LAYERS), ("context_length", 256), ("embedding_length", H),
                     ("feed_forward_length", FF), ("attention.head_count", HEADS),
                     ("attention.head_count_kv", KV), ("rope.freq_base", 5e4), ("vocab_size", VOCAB)]:
        (w.add_float32 if isinstance(val, float) else w.add_uint32)(f"llama.{key}", val)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32("tokenizer.ggml.eos_token_id", 5)
    expected = {}

    def add(gname: str, hf_w: np.ndarray, perm_heads: int = 0, quant: bool = True):
        stored = hf_permute(hf_w, perm_heads) if perm_heads else hf_w
        q = qtype if quant and stored.ndim == 2 else Q.F32
        data = quantize(stored, q) if q != Q.F32 else stored
        w.add_tensor(gname, data, raw_dtype=q)
        deq = dequantize(data, q).reshape(stored.shape)
        expected[gguf_to_hf_name(gname)] = unpermute_qk(deq, perm_heads) if perm_heads else deq

    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    add("token_embd.weight", f32(VOCAB, H))
    add("output_norm.weight", f32(H))
    for i in range(LAYERS):
        add(f"blk.{i}.attn_q.weight", f32(HEADS * D, H), HEADS)
        add(f"blk.{i}.attn_k.weight", f32(KV * D, H), KV)
        add(f"blk.{i}.attn_v.weight", f32(KV * D, H))
        add(f"blk.{i}.attn_output.weight", f32(H, HEADS * D))
        add(f"blk.{i}.ffn_gate.weight", f32(FF, H))
        add(f"blk.{i}.ffn_up.weight", f32(FF, H))
        add(f"blk.{i}.ffn_down.weight", f32(H, FF))
        add(f"blk.{i}.attn_norm.weight", f32(H))
        add(f"blk.{i}.ffn_norm.weight", f32(H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_unpermute_inverts_the_converter_permute():
    x = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_qk(hf_permute(x, 8), 8), x)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_weights_dequantize_and_unpermute(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, qtype)
    cfg = load_model_arch(str(path))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (LAYERS, H, HEADS, KV, D)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [5] and cfg.rope_theta == 5e4 and cfg.vocab_size == VOCAB
    weights = load_weights(str(path), cfg)
    assert set(weights) == set(expected)
    for name, want in expected.items():
        torch.testing.assert_close(weights[name], torch.from_numpy(want.astype(np.float32)), rtol=0, atol=0)


def test_default_model_config(default_model_path):
    cfg = load_model_arch(default_model_path)
    assert isinstance(cfg, ModelArch)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2] and cfg.architecture == "llama"


def test_tokenizer_has_chat_template(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_unknown_path_is_a_clear_error(tmp_path):
    for bad in (str(tmp_path / "nope.gguf"), str(tmp_path)):
        with pytest.raises(ValueError, match="cannot load a model"):
            load_model_arch(bad)
        with pytest.raises(ValueError, match="cannot load a model"):
            load_tokenizer(bad)
