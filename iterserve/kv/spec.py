"""What an executor's paged KV cache is: its shape, dtype and sizing rule (docs/architecture.md).

It lives in kv/ because the scheduler and the KV manager read it and must not import the executor
layer; executors build one and hand it up. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}
# A quantized pool stores each (token, kv head)'s values followed by their float32 scale
# (--kv-cache-dtype int8): head_dim + 4 int8 elements where a float pool holds head_dim.
KV_SCALE_BYTES = {"int8": 4}


def kv_head_width(head_dim: int, dtype: str) -> int:
    """Elements (of the pool's dtype) one token's K, or V, of one kv head takes in the pool."""
    return head_dim + KV_SCALE_BYTES.get(dtype, 0) // DTYPE_BYTES[dtype]


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V of every layer for block_size tokens, scales included."""
    return 2 * num_layers * block_size * num_kv_heads * kv_head_width(head_dim, dtype) * DTYPE_BYTES[dtype]


def num_blocks_for(memory_bytes: int, block_bytes: int) -> int:
    """The one KV-pool sizing rule: whole blocks in a byte budget (at least one)."""
    return max(1, int(memory_bytes // block_bytes))


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The paged KV cache an executor allocated, and what moving or rebuilding a block costs."""

    block_size: int
    num_device_blocks: int
    num_host_blocks: int  # the swap pool; 0 without one
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    # Costs that decide swap vs recompute under --preemption-mode auto: measured at start-up on the
    # real model, taken from the hardware spec in the simulator; 0.0 where not known.
    swap_bytes_per_s: float = 0.0  # device -> host -> device copy bandwidth
    recompute_tokens_per_s: float = 0.0  # prompt tokens computed per second

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KV dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("block_size", "num_device_blocks", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def head_width(self) -> int:
        """The pool's last dimension: head_dim, plus an int8 pool's scale (blocks travel with it)."""
        return kv_head_width(self.head_dim, self.dtype)
