"""A bfloat16 pool in the pair layout (model/attention.py) through the engine, against the same
model and pool kept in rows: every prompt pass reads its cached context through pairs_to_rows, so
prompt logprobs and first tokens are the rows' bit for bit; decodes (Q.K summed in another order:
outputs within a bf16 ulp) stay close; chunks, prefix-cache hits, swap and recompute read the same blocks; P/D
hand-offs travel in rows, so either layout hands off to the other.

The int8 test's tiny random Llama (head_dim 64: the decode kernel's pair path) in bfloat16."""
from __future__ import annotations

import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.kv_transfer.shm_connector import ShmConnector
from iterserve.model import cpu_kernels
from iterserve.model.attention import rows_to_pairs
from tests.engine.test_disagg import generate_pd
from tests.engine.test_greedy_reference import assert_close_all, generate
from tests.engine.test_greedy_reference import prompts  # noqa: F401  (the engine's reference prompts)
from tests.executor.test_kv_cache_dtype import prompt_logprobs
from tests.executor.test_kv_cache_dtype import tiny_model  # noqa: F401  (head_dim 64, 4 heads on 2 kv heads)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not cpu_kernels.pairs_supported(64, 16, 4),
                                                   reason="the pair layout needs the AVX-512 BF16 decode kernel")]

CONFIG = dict(dtype="bfloat16", kv_cache_memory="8MiB", swap_space="2MiB")
N = 16  # new tokens per prompt


def rows_runner(tiny_model) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=tiny_model, **CONFIG))
    runner.model.attention.pairs = False  # before its first step: the same pool, kept in rows
    return runner


@pytest.fixture(scope="module")
def runners(tiny_model):
    """(pairs, rows): the same model and pool."""
    return ModelRunner(EngineConfig(model=tiny_model, **CONFIG)), rows_runner(tiny_model)


@pytest.fixture(scope="module")
def pair_tokens(runners, prompts):
    return generate(runners[0], prompts, num_tokens=N)[0]


def test_a_bf16_pool_is_kept_in_pairs(runners):
    pairs, rows = runners
    assert pairs.kv_cache.dtype == torch.bfloat16 and pairs.model.attention.pairs and pairs.model.decode_layers
    assert not rows.model.attention.pairs


def test_prompt_passes_read_the_rows_values(runners, prompts):
    """Chunks of 48 tokens: later chunks read the earlier ones' blocks, here through pairs_to_rows."""
    pairs, rows = (prompt_logprobs(r, prompts, max_num_batched_tokens=48) for r in runners)
    assert pairs == rows


def test_decodes_stay_close_to_rows(runners, prompts, pair_tokens):
    row_tokens, _ = generate(runners[1], prompts, num_tokens=N)
    assert [t[0][0] for t in pair_tokens] == [t[0][0] for t in row_tokens]  # from the prompt pass
    assert_close_all(pair_tokens, row_tokens, n=N, max_diverged=len(prompts))


def test_chunks_prefix_hits_and_preemption_read_the_same_blocks(runners, prompts, pair_tokens):
    pairs = runners[0]
    chunked, _ = generate(pairs, prompts, num_tokens=N, max_num_batched_tokens=48)
    assert_close_all(chunked, pair_tokens, n=N)
    n = len(prompts)
    again, engine = generate(pairs, prompts + prompts, num_tokens=N, groups=[list(range(n)), list(range(n, 2 * n))])
    assert engine.scheduler.kv.num_prefix_hits > 0
    assert_close_all(again[n:], pair_tokens, n=N)
    for mode in ("swap", "recompute"):
        got, engine = generate(pairs, prompts, num_tokens=N, num_kv_blocks=20, preemption_mode=mode)
        assert engine.stats.num_preemptions > 0, "the pool was meant to force preemption"
        assert_close_all(got, pair_tokens, n=N)


def test_hand_offs_travel_in_rows_both_ways(runners, prompts, tiny_model):
    """Prefill on one layout, decode on the other: the decode side's tokens are those of an engine of
    its own layout that did both."""
    few = [prompts[i] for i in (1, 3, 5)]
    pairs, rows = runners
    for prefill_side, decode_side, colocated in ((pairs, rows_runner(tiny_model), rows),
                                                 (rows, ModelRunner(EngineConfig(model=tiny_model, **CONFIG)), pairs)):
        want, _ = generate(colocated, few, one_at_a_time=True, num_tokens=10)
        pd, _, decode = generate_pd((prefill_side, decode_side), few, ShmConnector(), one_at_a_time=True)
        assert [t for t, _ in pd] == [t for t, _ in want]
        assert decode.engine.stats.num_kv_transfers_recomputed == 0


def test_blocks_are_handed_over_in_rows(runners):
    """write_blocks takes rows and read_blocks gives them back, whatever the pool keeps."""
    pairs, rows = runners
    ids = [5, 9, 2]
    x = torch.randn(*pairs.kv_cache.shape[:2], len(ids), *pairs.kv_cache.shape[3:]).to(torch.bfloat16)
    for runner in runners:
        runner.write_blocks(ids, x)
        assert torch.equal(runner.read_blocks(ids), x)
    assert torch.equal(rows.kv_cache[:, :, ids], x)
    k, v = rows_to_pairs(x[:, 0], x[:, 1])
    assert torch.equal(pairs.kv_cache[:, 0, ids], k) and torch.equal(pairs.kv_cache[:, 1, ids], v)
