"""benchmarks/decode_attention.py: its cases count the bytes a step reads, time every kernel and the
plain read, and two builds of the same kernel agree exactly, over every cache and both layouts."""
import time
from pathlib import Path

import pytest
import torch

from iterserve.model import cpu_kernels
from tests.bench import load_benchmark

bench = load_benchmark("decode_attention")

needs_kernel = pytest.mark.skipif(cpu_kernels.decode_attention_kernel() is None, reason="no C++ compiler here")


@needs_kernel
@pytest.mark.parametrize("cached", [False, True])
def test_cases_count_bytes_and_agree(cached):
    kernels = [bench.build(Path(cpu_kernels.SOURCE))] * 2
    pairs = cpu_kernels.pairs_supported(bench.HEAD_DIM, bench.BLOCK, bench.HEADS)
    caches = ["bf16", "int8", *(["pairs"] if pairs else [])]
    with torch.inference_mode():
        for kv in caches:
            r = bench.case(kernels, kv, batch=3, context=40, repeats=1, clock=time.process_time, cached=cached)
            width = bench.HEAD_DIM + (4 if kv == "int8" else 0)  # an int8 row's float32 scale
            element = 1 if kv == "int8" else 2
            assert r["bytes"] == bench.LAYERS * 2 * bench.KV_HEADS * width * element * 3 * 41
            assert r["read_bytes"] == bench.LAYERS * 2 * bench.KV_HEADS * width * element * 3 * 48  # whole blocks
            assert len(r["seconds"]) == 2 and min(r["seconds"]) >= 0 and r["read_seconds"] >= 0
            assert r["diff"] == 0.0
