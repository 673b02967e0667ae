"""CUDA graphs for decode steps: capture the whole forward once per batch-size bucket, then replay.

A decode step of a small model launches hundreds of small kernels; on a GPU the Python and launch
overhead of issuing them can exceed the kernels' own time. A captured graph replays them all with
one launch. A graph is frozen: same tensor addresses, same shapes, same grid. So:
  - inputs are copied into static buffers the graph was captured on (one set, sized for the largest
    bucket; a bucket of n uses the first n rows of each);
  - a batch of B is padded up to the smallest captured size >= B with harmless rows: slot -1 (its
    K/V is not written), seq_len 0 (the attention kernel reads no context and outputs zeros);
  - the forward must read every per-step value from these tensors (never .item()/.tolist(), never a
    Python int derived from them) — the Triton attention path does; the torch CPU path does not and
    is never captured.
Only pure-decode batches (one new token per request) are captured; anything else, or a batch above
the largest bucket, runs eagerly. Bucket choice and padding are plain torch and tested on CPU;
capture and replay need CUDA.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch

from iterserve.model.attention_metadata import AttentionMetadata

# forward(input_ids[T], positions[T], kv_cache, meta, logits_indices[B]) -> logits[B, vocab]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16 up to max_num_seqs (always included).

    A decode step's cost is mostly reading the weights once, which does not depend on the batch
    size, and a padding row reads no K/V (seq_len 0), so running a few extra rows costs little: at
    most 7 rows up to 64 and 15 beyond. Finer steps would only add captures (each costs capture time
    at start-up and a little graph memory) for no measurable gain; powers of two below 8 keep the
    lightly loaded case (one or two requests) exact.
    """
    assert max_num_seqs >= 1
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def pick_bucket(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds the batch; None if none does (run eagerly)."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


@dataclass(slots=True)
class DecodeInputs:
    """The flat per-step tensors of a pure-decode batch: one new token per request, so T == B."""
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, n: int) -> DecodeInputs:
        """Views of the first n rows (a bucket's share of the static buffers)."""
        return DecodeInputs(self.input_ids[:n], self.positions[:n], self.slot_mapping[:n],
                            self.seq_lens[:n], self.block_tables[:n])


# What a padding row holds: slot -1 writes no K/V, seq_len 0 reads none, block 0 is never touched.
PAD_VALUES = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 0, "block_tables": 0}


def fill_padded(dst: DecodeInputs, src: DecodeInputs) -> None:
    """Copy src into dst's first rows and padding into the rest, in place (no allocation).

    Block-table columns past src's width are left as they are: no kernel reads past seq_len.
    """
    n = src.batch_size
    assert n <= dst.batch_size and src.block_tables.shape[1] <= dst.block_tables.shape[1]
    for name, pad in PAD_VALUES.items():
        d, s = getattr(dst, name), getattr(src, name)
        if s.dim() == 2:
            d[:n, : s.shape[1]].copy_(s)
        else:
            d[:n].copy_(s)
        d[n:].fill_(pad)


def pad_decode_inputs(src: DecodeInputs, size: int, max_blocks: int | None = None) -> DecodeInputs:
    """A new DecodeInputs of `size` rows (and `max_blocks` block-table columns): src, then padding."""
    width = src.block_tables.shape[1] if max_blocks is None else max_blocks
    dst = DecodeInputs(*(torch.full((size, width) if name == "block_tables" else (size,), pad,
                                    dtype=getattr(src, name).dtype, device=getattr(src, name).device)
                         for name, pad in PAD_VALUES.items()))
    fill_padded(dst, src)
    return dst


def decode_metadata(inputs: DecodeInputs, query_start_loc: torch.Tensor, max_seq_len: int) -> AttentionMetadata:
    """Metadata over (static) decode tensors. The host-side lists are placeholders: a captured
    forward runs for every later batch of this size, so it must not read them."""
    n = inputs.batch_size
    return AttentionMetadata(slot_mapping=inputs.slot_mapping, query_start_loc=query_start_loc[: n + 1],
                             seq_lens=inputs.seq_lens, block_tables=inputs.block_tables,
                             max_query_len=1, max_seq_len=max_seq_len,
                             query_lens_list=[1] * n, seq_lens_list=[max_seq_len] * n)


class CudaGraphRunner:
    """Captures `forward` for each bucket size on static buffers and replays it for decode batches.

    kv_cache is captured by address: it must be the tensor the model runner keeps using (re-create
    the runner if the cache is re-allocated). The returned logits are a view of graph-owned memory
    that the next run overwrites: consume (sample) before the next step.
    """

    def __init__(self, forward: ForwardFn, kv_cache: torch.Tensor, max_num_seqs: int, max_model_len: int,
                 block_size: int, sizes: list[int] | None = None, num_warmups: int = 2):
        self.forward = forward
        self.kv_cache = kv_cache
        self.sizes = sorted(sizes) if sizes else capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.num_warmups = num_warmups
        n, dev = self.sizes[-1], kv_cache.device
        max_blocks = -(-max_model_len // block_size)
        self.static = pad_decode_inputs(
            DecodeInputs(torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, dtype=torch.int64, device=dev),
                         torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, dtype=torch.int32, device=dev),
                         torch.zeros(0, max_blocks, dtype=torch.int32, device=dev)), n)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # one token per request
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, n: int) -> torch.Tensor:
        inputs = self.static.rows(n)
        meta = decode_metadata(inputs, self.query_start_loc, self.max_model_len)
        return self.forward(inputs.input_ids, inputs.positions, self.kv_cache, meta, self.logits_indices[:n])

    @torch.inference_mode()
    def capture(self) -> None:
        assert self.kv_cache.is_cuda, "CUDA graphs need the model and KV cache on a CUDA device"
        # All rows padding during capture: the warm-up and captured runs write no K/V and read none.
        fill_padded(self.static, self.static.rows(0))
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):  # largest first: smaller graphs then fit in its pool memory
            side = torch.cuda.Stream()  # warm up (Triton compiles, cuBLAS picks kernels) off the capture stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.num_warmups):
                    self._forward(n)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[n] = self._forward(n)
            self.graphs[n] = graph
        torch.cuda.synchronize()

    def bucket(self, batch_size: int) -> int | None:
        """The captured size this batch would run in, or None: run it eagerly."""
        n = pick_bucket(batch_size, self.sizes)
        return n if n in self.graphs else None

    def run_padded_eager(self, inputs: DecodeInputs) -> torch.Tensor:
        """What a replay computes, run without a graph (any device): to check padding and debug replays."""
        n = pick_bucket(inputs.batch_size, self.sizes)
        assert n is not None, f"no bucket holds a batch of {inputs.batch_size}"
        fill_padded(self.static.rows(n), inputs)
        return self._forward(n)[: inputs.batch_size]

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """Replay for a pure-decode batch: logits [B, vocab] (a view; see the class docstring)."""
        n = self.bucket(inputs.batch_size)
        assert n is not None, f"no captured graph holds a batch of {inputs.batch_size}; run it eagerly"
        fill_padded(self.static.rows(n), inputs)
        self.graphs[n].replay()
        return self.outputs[n][: inputs.batch_size]
