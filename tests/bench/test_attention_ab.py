"""benchmarks/attention_ab.py end to end against HEAD: the sources fetched from git are the tree's
(on a clean tree), both builds bind, every case times both and their outputs agree exactly (the pair
layout's to a bf16 ulp)."""
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from iterserve.model import cpu_kernels
from tests.bench import load_benchmark

pytestmark = pytest.mark.slow  # builds the kernels twice

ROOT = Path(__file__).parents[2]
ab = load_benchmark("attention_ab")

needs_kernel = pytest.mark.skipif(cpu_kernels.decode_attention_kernel() is None, reason="no C++ compiler here")


def tree_matches_head() -> bool:
    names = [f"iterserve/model/{n}" for n in ab.SOURCES]
    return subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *names], cwd=ROOT).returncode == 0


@needs_kernel
def test_runs_against_head_and_both_builds_agree():
    if not tree_matches_head():
        pytest.skip("the kernels differ from HEAD in this tree")
    with tempfile.TemporaryDirectory() as tmp:
        source = ab.checkout("HEAD", Path(tmp))
        assert source.read_bytes() == Path(cpu_kernels.SOURCE).read_bytes()
        kernels = [ab.build(source), ab.build(Path(cpu_kernels.SOURCE))]
        for kv in ("bf16", "int8"):
            for q_dtype in (torch.bfloat16, torch.float32):  # float32: --q-dtype, as bf16 storage runs
                base, ours, diff = ab.decode_case(kernels, kv, batch=3, context=40, layout="scattered", repeats=1,
                                                  q_dtype=q_dtype)
                assert base > 0 and ours > 0 and diff == 0.0
        if cpu_kernels.pairs_supported(ab.HEAD_DIM, ab.BLOCK, ab.HEADS):  # rows at HEAD, pairs here
            base, ours, diff = ab.decode_case(kernels, "pairs", batch=3, context=40, layout="scattered", repeats=1,
                                              q_dtype=torch.bfloat16)
            assert base > 0 and ours > 0 and diff < 1e-2
        prompt_dtypes = [d for d in (torch.bfloat16, torch.float32) if cpu_kernels.prompt_attention_supported(d, 64)]
        for dtype in prompt_dtypes:
            base, ours, diff = ab.prompt_case(kernels, tokens=40, repeats=1, dtype=dtype)
            assert base > 0 and ours > 0 and diff == 0.0
