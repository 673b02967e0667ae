"""Tensor-parallel shards computed together give the whole model's logits.

The ranks here are threads and the collectives a barrier and a sum, so the sharding arithmetic is
checked in milliseconds, without processes (tests/executor/test_tp_executor.py runs real gloo ranks)."""
from __future__ import annotations

import threading

import pytest
import torch

from iterserve.model.llama import LlamaModel
from iterserve.model.loader import load_model_arch, load_weights
from iterserve.model.sharding import check_tp_size, lm_head, rank_arch, shard_weights, valid_tp_sizes
from tests.model.test_families import FAMILIES, build_checkpoint
from tests.model.test_llama import BS, metadata


class ThreadGroup:
    """A process group of threads: every rank adds its tensor in rank order, so all get the same sum."""

    def __init__(self, size: int, vocab_size: int) -> None:
        self.size, self.vocab_size = size, vocab_size
        self.barrier, self.slots = threading.Barrier(size), [None] * size

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return parts

    def rank(self, r: int):
        group = self

        class Rank:
            def all_reduce(self, x):
                return x.copy_(sum(group._exchange(r, x)))

            def gather_logits(self, logits):
                return torch.cat(group._exchange(r, logits), dim=-1)[:, : group.vocab_size]
        return Rank()


def checkpoint(tmp_path, bias: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=131, max_position_embeddings=256)  # 131: a padded vocab shard
    model = Qwen2ForCausalLM(Qwen2Config(**common)) if bias else LlamaForCausalLM(LlamaConfig(**common))
    for layer in model.model.layers if bias else []:  # random init leaves biases at zero
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias)
    model.save_pretrained(tmp_path)
    return str(tmp_path)


def forward_all(models, ids, n_cache_blocks=16):
    """Each model's logits for a prompt of len(ids) tokens, the ranks run together in threads."""
    out = [None] * len(models)

    def run(i):
        m = models[i]
        cache = torch.zeros(m.cfg.num_layers, 2, n_cache_blocks, BS, m.cfg.num_kv_heads, m.cfg.head_dim)
        t = len(ids)
        with torch.inference_mode():
            out[i] = m.forward(ids, torch.arange(t), cache, metadata([t], [t], [list(range(-(-t // BS)))]),
                               torch.arange(t))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(models))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return out


@pytest.mark.parametrize("bias,quantization", [(False, None), (True, None), (False, "int4")])
def test_two_shards_give_the_whole_models_logits(tmp_path, bias, quantization):
    """int4 groups run along K in 32s, and each row-parallel slice is whole groups: the same codes."""
    path = checkpoint(tmp_path, bias)
    arch = load_model_arch(path)
    weights = load_weights(path, arch)
    whole = LlamaModel(arch, weights, BS, quantization=quantization)
    group = ThreadGroup(2, lm_head(weights, arch).shape[0])
    shards = [LlamaModel(rank_arch(arch, 2), shard_weights(weights, arch, r, 2), BS, quantization=quantization,
                         tp=group.rank(r)) for r in range(2)]
    assert shards[0].cfg.num_heads == 2 and shards[0].cfg.num_kv_heads == 1 and shards[0].cfg.intermediate_size == 64
    ids = torch.randint(0, arch.vocab_size, (40,))
    want, = forward_all([whole], ids)
    got = forward_all(shards, ids)
    assert want.shape == got[0].shape == (40, 131)
    torch.testing.assert_close(got[0], got[1], atol=0, rtol=0)  # every rank samples from the same logits
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "olmo2"])
def test_every_family_splits_in_two(tmp_path, family):
    """Sandwich norms, soft-capping, sliding windows, q/k norms per head, multipliers folded into the
    weights, routed experts (each split like a dense MLP, the router whole): all on the reduced sums."""
    build_checkpoint(tmp_path, family)
    arch = load_model_arch(str(tmp_path))
    weights = load_weights(str(tmp_path), arch)
    group = ThreadGroup(2, lm_head(weights, arch).shape[0])
    shards = [LlamaModel(rank_arch(arch, 2), shard_weights(weights, arch, r, 2), BS, tp=group.rank(r))
              for r in range(2)]
    ids = torch.randint(0, arch.vocab_size, (40,))
    want, = forward_all([LlamaModel(arch, weights, BS)], ids)
    got = forward_all(shards, ids)
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)


def test_olmo2s_whole_qk_norm_is_refused(tmp_path):
    build_checkpoint(tmp_path, "olmo2")
    with pytest.raises(ValueError, match="cannot split olmo2's q/k norm"):
        check_tp_size(load_model_arch(str(tmp_path)), 2)


def test_sizes_that_do_not_divide_are_refused_by_name(tmp_path):
    arch = load_model_arch(checkpoint(tmp_path, False))
    assert valid_tp_sizes(arch) == [1, 2]
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 2 kv heads; "
                                         "sizes that do: 1, 2"):
        check_tp_size(arch, 4)
