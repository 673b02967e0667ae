"""CUDA-graph bucketing and padding on CPU; capture and replay only where CUDA is present."""
from __future__ import annotations

import pytest
import torch

from iterserve.executor.cuda_graphs import (CudaGraphRunner, DecodeInputs, capture_sizes, decode_metadata,
                                            fill_padded, pad_decode_inputs, pick_bucket)


def decode_inputs(batch: int, width: int = 3, device: str = "cpu") -> DecodeInputs:
    return DecodeInputs(input_ids=torch.arange(batch, dtype=torch.int64, device=device) + 100,
                        positions=torch.arange(batch, dtype=torch.int64, device=device) + 10,
                        slot_mapping=torch.arange(batch, dtype=torch.int64, device=device) * 16 + 5,
                        seq_lens=torch.arange(batch, dtype=torch.int32, device=device) + 11,
                        block_tables=torch.arange(batch * width, dtype=torch.int32, device=device).view(batch, width) + 1)


def test_capture_sizes_default_and_small():
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64] + list(range(80, 257, 16))
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64)[-1] == 64 and capture_sizes(100)[-2:] == [96, 100]


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 37, 64, 65, 100, 512])
def test_capture_sizes_are_sorted_unique_and_cover_every_batch(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
    for b in range(1, max_num_seqs + 1):
        n = pick_bucket(b, sizes)
        assert n is not None and b <= n and n - b <= (7 if b <= 64 else 15)


def test_pick_bucket():
    sizes = [1, 2, 4, 8, 16]
    assert [pick_bucket(b, sizes) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert pick_bucket(17, sizes) is None


def test_pad_decode_inputs_pads_with_harmless_rows():
    src = decode_inputs(3, width=2)
    out = pad_decode_inputs(src, 8, max_blocks=5)
    assert out.batch_size == 8 and out.block_tables.shape == (8, 5)
    assert torch.equal(out.input_ids[:3], src.input_ids) and torch.equal(out.block_tables[:3, :2], src.block_tables)
    assert out.slot_mapping[3:].eq(-1).all()  # padding writes no K/V
    assert out.seq_lens[3:].eq(0).all()  # and reads none
    assert out.input_ids[3:].eq(0).all() and out.positions[3:].eq(0).all() and out.block_tables[3:].eq(0).all()
    assert all(getattr(out, f).dtype == getattr(src, f).dtype for f in ("input_ids", "slot_mapping", "seq_lens"))


def test_fill_padded_reuses_buffers_and_clears_stale_rows():
    static = pad_decode_inputs(decode_inputs(8, width=4), 8)  # a previous, larger batch left real rows
    ptr = static.slot_mapping.data_ptr()
    fill_padded(static, decode_inputs(2, width=4))
    assert static.slot_mapping.data_ptr() == ptr
    assert static.slot_mapping.tolist() == [5, 21] + [-1] * 6
    assert static.seq_lens.tolist() == [11, 12] + [0] * 6


def test_decode_metadata_over_static_rows():
    static = pad_decode_inputs(decode_inputs(3), 4)
    qsl = torch.arange(9, dtype=torch.int32)
    meta = decode_metadata(static, qsl, max_seq_len=64)
    assert meta.is_pure_decode and meta.num_seqs == 4
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens.data_ptr() == static.seq_lens.data_ptr()  # views, not copies: graphs see new data


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturing CUDA graphs needs a CUDA device")
def test_runner_replays_like_eager_on_cuda():
    torch.manual_seed(0)
    vocab, hidden = 32, 8
    emb = torch.randn(vocab, hidden, device="cuda")
    head = torch.randn(hidden, vocab, device="cuda")
    kv_cache = torch.zeros(1, 2, 4, 16, 1, hidden, device="cuda")

    def forward(input_ids, positions, kv, meta, logits_indices):
        # depends on every input tensor, so a stale static buffer would show in the logits
        x = emb[input_ids] + positions[:, None] + meta.seq_lens[:, None] + meta.block_tables[:, :1]
        return (x[logits_indices] @ head).float()

    runner = CudaGraphRunner(forward, kv_cache, max_num_seqs=8, max_model_len=48, block_size=16)
    runner.capture()
    for batch in (1, 3, 8):
        inputs = decode_inputs(batch, width=3, device="cuda")
        meta = decode_metadata(inputs, torch.arange(batch + 1, dtype=torch.int32, device="cuda"), 48)
        want = forward(inputs.input_ids, inputs.positions, kv_cache, meta, torch.arange(batch, device="cuda"))
        torch.testing.assert_close(runner.run(inputs), want)
    assert runner.bucket(9) is None
