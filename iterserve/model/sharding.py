"""Megatron-style tensor-parallel shards of a Llama-family checkpoint, and the collectives between them.

Rank r of N keeps 1/N of every attention and MLP matrix, split so that each layer needs only two
all-reduces (after o_proj and after down_proj):
  column-parallel (output rows split): q, k, v by whole heads (rank r keeps q heads r*H/N.. and the
      kv heads those read, r*Hkv/N..), gate and up by intermediate rows;
  row-parallel (input columns split): o and down; each rank's output is a partial sum.
The embedding, the norms and the residual stream stay whole on every rank. The LM head is split by
vocabulary rows (padded to equal shards) and the logits gathered, so its weight read (a fifth of a
small model's) is divided too. Quantization and oneDNN packing run after slicing, in LlamaModel, so
int8/int4 and packed bf16 apply per rank unchanged.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from iterserve.model.loader import ModelArch

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # weight and bias rows split
_ROW = ("o_proj", "down_proj")  # weight columns split


def _split_counts(arch: ModelArch) -> dict[str, int]:
    """What each rank takes a 1/N share of, whole: heads, kv heads (never replicated), MLP rows."""
    counts = {"attention heads": arch.num_heads, "kv heads": arch.num_kv_heads,
              "intermediate size": arch.intermediate_size}
    if arch.num_experts:  # each expert is split like a dense MLP; the router stays whole
        counts["expert intermediate size"] = arch.moe_intermediate_size
    return counts


def valid_tp_sizes(arch: ModelArch, limit: int = 64) -> list[int]:
    g = math.gcd(*_split_counts(arch).values())
    return [n for n in range(1, min(g, limit) + 1) if g % n == 0]


def check_tp_size(arch: ModelArch, n: int) -> None:
    bad = [f"{v} {k}" for k, v in _split_counts(arch).items() if v % n]
    if n > 1 and arch.qk_norm == "full":
        raise ValueError(f"tensor parallelism cannot split {arch.architecture}'s q/k norm: it spans all heads")
    if bad:
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's {' and '.join(bad)}; "
                         f"sizes that do: {', '.join(map(str, valid_tp_sizes(arch)))}")


def rank_arch(arch: ModelArch, n: int) -> ModelArch:
    """The shapes one rank computes. The LM head is never tied on a rank: the shard is not the embedding."""
    check_tp_size(arch, n)
    return dataclasses.replace(arch, num_heads=arch.num_heads // n, num_kv_heads=arch.num_kv_heads // n,
                               intermediate_size=arch.intermediate_size // n,
                               moe_intermediate_size=arch.moe_intermediate_size // n, tie_word_embeddings=False)


def vocab_shard_size(vocab_size: int, n: int) -> int:
    return -(-vocab_size // n)


def shard_weights(weights: dict[str, torch.Tensor], arch: ModelArch, rank: int, n: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of full HF-named weights; slices are copies, so the full tensors can be freed."""
    check_tp_size(arch, n)
    out = {}
    for name, w in weights.items():
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if module in _COLUMN:
            out[name] = w.chunk(n, dim=0)[rank].clone()
        elif module in _ROW and name.endswith(".weight"):
            out[name] = w.chunk(n, dim=1)[rank].clone()
        elif name != "lm_head.weight":
            out[name] = w
    out["lm_head.weight"] = _vocab_shard(lm_head(weights, arch), rank, n)
    return out


def lm_head(weights: dict[str, torch.Tensor], arch: ModelArch) -> torch.Tensor:
    """The whole LM head, as LlamaModel picks it; its rows (not config.json's vocab_size, which
    may differ) are the logits' width."""
    embed = weights["model.embed_tokens.weight"]
    return embed if arch.tie_word_embeddings else weights.get("lm_head.weight", embed)


def _vocab_shard(head: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    size = vocab_shard_size(head.shape[0], n)
    shard = head[rank * size: (rank + 1) * size]
    if shard.shape[0] < size:  # the last shard: zero rows, whose logits the gather drops
        shard = torch.cat([shard, shard.new_zeros(size - shard.shape[0], head.shape[1])])
    return shard.clone()


@dataclasses.dataclass(slots=True)
class TensorParallel:
    """The two collectives LlamaModel calls on a rank (its `tp` hook); the default process group."""

    rank: int
    size: int
    vocab_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums the row-parallel partial outputs, in place."""
        dist.all_reduce(x)
        return x

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[S, V/N] on each rank -> [S, V] on every rank (every rank samples the same way)."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]
