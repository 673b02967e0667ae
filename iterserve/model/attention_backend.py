"""Which attention implementation the model runs: the one place that decides.

  torch  (attention.py): plain torch, the CPU path and the reference. Its per-step plan reads host
         lists (seq_lens_list, ...) and builds tensors from them, so it must never be captured in
         a CUDA graph.
  triton (triton_attention.py): the GPU path. Reads every per-step value from device tensors, so a
         decode step through it can be captured and replayed (graph_safe).

Default: triton on a CUDA device when triton imports, torch otherwise. ITERSERVE_ATTENTION=torch|triton
overrides it, for testing and debugging only: `triton` on CPU runs the kernels in Triton's
interpreter (TRITON_INTERPRET=1 must be set before triton is first imported), which is how the CPU
test suite checks the GPU path end to end through the real model; `torch` on CUDA gives an eager
reference to compare a GPU run against.

Both backends expose prepare(meta) once per step (shared by all layers) and
attend(q, k, v, layer_cache, prepared, scale, window, softcap), which also writes this step's K/V
into the cache; window (0: none) and softcap (0: none) are the layer's, from ModelArch. `pairs`: a
bfloat16 cache is in the pair layout (attention.py), which only the torch backend's CPU kernels keep.
"""
from __future__ import annotations

import os

import torch

from iterserve.model import cpu_kernels
from iterserve.model.attention import Workspace, build_plan, paged_attention
from iterserve.model.attention_metadata import AttentionMetadata

ENV_VAR = "ITERSERVE_ATTENTION"


class TorchAttention:
    name = "torch"
    graph_safe = False

    def __init__(self, block_size: int, dtype: torch.dtype, device: torch.device, head_dim: int = 0,
                 num_heads: int = 0):
        self.block_size, self.dtype = block_size, dtype
        self.workspace = Workspace()  # the decode gather buffer, reused across layers and steps
        # decode rows read the paged cache in place through the C++ kernel, where it builds
        self.use_kernel = device.type == "cpu" and dtype in cpu_kernels.DTYPES and \
            cpu_kernels.decode_attention_kernel() is not None
        # a bfloat16 cache in the pair layout (attention.py) wherever the kernel reads it
        self.pairs = self.use_kernel and dtype == torch.bfloat16 and \
            cpu_kernels.pairs_supported(head_dim, block_size, num_heads)

    def prepare(self, meta: AttentionMetadata):
        return build_plan(meta, self.block_size, self.dtype, self.workspace, self.use_kernel, self.pairs)

    def attend(self, q, k, v, layer_cache: torch.Tensor, plan, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        return paged_attention(q, k, v, layer_cache, plan, scale, window, softcap)


class TritonAttention:
    name = "triton"
    graph_safe = True
    pairs = False

    def __init__(self) -> None:
        from iterserve.model.triton_attention import paged_attention_triton, write_kv_triton
        self.paged_attention, self.write_kv = paged_attention_triton, write_kv_triton

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta  # the kernels read the metadata tensors directly: nothing to precompute

    def attend(self, q, k, v, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        self.write_kv(k, v, layer_cache[0], layer_cache[1], meta.slot_mapping)
        return self.paged_attention(q, layer_cache[0], layer_cache[1], meta, scale, window, softcap)


def has_triton() -> bool:
    """Imported only when asked: on the CPU path importing triton costs start-up time and nothing else."""
    from iterserve.model.triton_attention import has_triton as importable
    return importable()


def backend_name(device: torch.device) -> str:
    """'triton' or 'torch' for this device, honouring the ITERSERVE_ATTENTION override."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced not in ("", "torch", "triton"):
        raise ValueError(f"{ENV_VAR} must be 'torch' or 'triton', got {forced!r}")
    if forced == "triton" and not has_triton():
        raise RuntimeError(f"{ENV_VAR}=triton but the `triton` package does not import")
    if forced:
        return forced
    return "triton" if device.type == "cuda" and has_triton() else "torch"


def attention_backend(device: torch.device, block_size: int, dtype: torch.dtype, head_dim: int = 0,
                      num_heads: int = 0):
    if backend_name(device) == "triton":
        return TritonAttention()
    return TorchAttention(block_size, dtype, device, head_dim, num_heads)
