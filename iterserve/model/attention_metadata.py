"""What attention needs to see sequence boundaries in a flat, unpadded batch.

The batch is all scheduled tokens of all requests concatenated: request b owns rows
query_start_loc[b]:query_start_loc[b+1] of q. Its context is seq_lens[b] tokens long, the last
q_len_b of which are this step's new tokens, so new token i sits at position
seq_lens[b] - q_len_b + i and attends causally to positions <= that, read from the paged cache
through block_tables[b] (position p lives in block block_tables[b, p // block_size], offset
p % block_size).

KV cache layout, one tensor for the whole model (so a swap or copy of block ids moves every layer):
    kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = K, V)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (block_id * block_size + offset); -1 = skip
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # host-side copies, so the CPU path never syncs to read them
    query_lens_list: list[int]
    seq_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
