"""--kv-cache-dtype int8 through the engine: the pool holds ~3.8x the blocks of float32 (~1.9x of
bfloat16) in the same memory; greedy tokens and prompt logprobs stay close to the float cache's on
the engine's reference prompts; batching, chunked prefill, prefix-cache hits, swap, the P/D hand-off
and TP=2 all read the same int8 blocks; the Triton path and mixed-dtype hand-offs are refused.

A tiny random Llama with head_dim 64 (the C++ kernel's AVX-512 path) and the default model's
tokenizer, so the reference prompts are the real ones."""
from __future__ import annotations

import argparse

import httpx
import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.entrypoints.args import add_engine_args
from iterserve.executor.dtypes import kv_dtype_name
from iterserve.executor.model_runner import ModelRunner
from iterserve.executor.tp_executor import TPExecutor
from iterserve.kv.spec import KVCacheSpec, num_blocks_for
from iterserve.kv_transfer.shm_connector import ShmConnector
from iterserve.sampling_params import SamplingParams
from tests.engine.test_disagg import generate_pd
from tests.engine.test_greedy_reference import assert_close_all, generate
from tests.engine.test_greedy_reference import prompts  # noqa: F401  (the engine's reference prompts)
from tests.server.conftest import metric, start_server

pytestmark = pytest.mark.slow  # real engines, side by side

CONFIG = dict(dtype="float32", kv_cache_memory="8MiB", swap_space="2MiB")
N = 16  # new tokens per prompt


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer) -> str:
    """Random weights, initializer_range 0.1: peakier logits than the default 0.02, fewer float near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    shape = dict(hidden_size=128, head_dim=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512)
    model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True, initializer_range=0.1))
    path = tmp_path_factory.mktemp("tiny-kv-int8")
    model.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def runners(tiny_model):
    """(float32 cache, int8 cache), the same model and the same KV memory."""
    return (ModelRunner(EngineConfig(model=tiny_model, **CONFIG)),
            ModelRunner(EngineConfig(model=tiny_model, kv_cache_dtype="int8", **CONFIG)))


@pytest.fixture(scope="module")
def int8_tokens(runners, prompts):
    return generate(runners[1], prompts, num_tokens=N)[0]


def test_bytes_per_block_counts_the_scales():
    f32, i8 = (KVCacheSpec(16, 1, 0, 30, 3, 64, d) for d in ("float32", "int8"))
    assert i8.bytes_per_block == 2 * 30 * 16 * 3 * (64 + 4) and i8.head_width == 68 and f32.head_width == 64
    bf16 = KVCacheSpec(16, 1, 0, 30, 3, 64, "bfloat16")
    ratio = num_blocks_for(1 << 30, i8.bytes_per_block) / num_blocks_for(1 << 30, bf16.bytes_per_block)
    assert ratio == pytest.approx(2 * 64 / 68, rel=1e-3)  # ~1.9x: "2x, a bit less for the scales"


def test_the_same_memory_holds_more_blocks(runners):
    f32, i8 = runners
    assert i8.kv_cache.dtype == torch.int8 and i8.kv_cache.shape[-1] == 64 + 4
    assert i8.kv_cache_spec.dtype == "int8" and f32.kv_cache_spec.dtype == "float32"
    nf, ni = f32.kv_cache_spec.num_device_blocks, i8.kv_cache_spec.num_device_blocks
    assert ni == (8 << 20) // (2 * 2 * 16 * 2 * 68) and nf == (8 << 20) // (2 * 2 * 16 * 2 * 64 * 4)
    assert ni / nf > 3.7  # 4 * 64 / 68
    for r in runners:  # the pool is what the spec says it is, and within the budget
        assert r.kv_cache.nbytes == r.kv_cache_spec.num_device_blocks * r.kv_cache_spec.bytes_per_block <= 8 << 20
    host = i8.host_kv_cache
    assert host.dtype == torch.int8 and host.shape[2] == i8.kv_cache_spec.num_host_blocks == (2 << 20) // 8704


def test_engine_runs_more_at_once_with_int8(runners, prompts):
    """Capacity, not just a count: the reference prompts (51 blocks with their outputs) queue on a
    float pool of 24 blocks and all run at once on an int8 pool of the same bytes (90 blocks)."""
    f32_blocks = 24
    i8_blocks = f32_blocks * runners[0].kv_cache_spec.bytes_per_block // runners[1].kv_cache_spec.bytes_per_block
    _, float_engine = generate(runners[0], prompts, num_tokens=8, num_kv_blocks=f32_blocks)
    _, int8_engine = generate(runners[1], prompts, num_tokens=8, num_kv_blocks=i8_blocks)
    peak = [max(r.num_running for r in e.step_records) for e in (float_engine, int8_engine)]
    assert peak[0] < len(prompts) == peak[1] and int8_engine.stats.num_preemptions == 0
    assert len(int8_engine.step_records) < len(float_engine.step_records)


def test_greedy_tokens_close_to_the_float_cache(runners, prompts, int8_tokens):
    """vLLM's check_logprobs_close: where the tokens first differ, each is in the other's top 5. The
    random model's logits are near-uniform (prompt logprobs ~ -11), so near-ties are common."""
    float_tokens, _ = generate(runners[0], prompts, num_tokens=N)
    assert_close_all(int8_tokens, float_tokens, n=N, max_diverged=len(prompts))
    assert sum(a[0] == b[0] for a, b in zip(int8_tokens, float_tokens)) >= 1


def prompt_logprobs(runner, prompts, **config) -> list[list[float]]:
    """Each prompt token's logprob (teacher-forced: both caches score the same tokens)."""
    engine = Engine(EngineConfig(dtype="float32", **config), executor=runner)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [[lp.logprob for lp in done[str(i)].prompt_logprobs[1:]] for i in range(len(prompts))]


def test_prompt_logprobs_close_to_the_float_cache(runners, prompts):
    """Chunks of 48 tokens: later chunks read the earlier ones' int8 blocks."""
    want = torch.tensor(sum(prompt_logprobs(runners[0], prompts, max_num_batched_tokens=48), []))
    got = torch.tensor(sum(prompt_logprobs(runners[1], prompts, max_num_batched_tokens=48), []))
    diff = (got - want).abs()  # measured: max 0.054, mean 0.0095 (SmolLM2-135M itself: 0.37, 0.024)
    assert diff.max() < 0.15 and diff.mean() < 0.03, (diff.max(), diff.mean())
    assert diff.max() > 0, "the int8 cache was meant to differ from the float one"


def test_chunks_and_prefix_hits_read_the_same_int8_values(runners, prompts, int8_tokens):
    """Quantization is per token and head, whatever the batch: the int8 runs agree with each other
    as the float cache's do."""
    i8 = runners[1]
    chunked, engine = generate(i8, prompts, num_tokens=N, max_num_batched_tokens=48)
    assert max(r.num_batched_tokens for r in engine.step_records) <= 48
    assert_close_all(chunked, int8_tokens, n=N)
    n = len(prompts)  # the second round runs after the first has freed (and cached) its blocks
    again, engine = generate(i8, prompts + prompts, num_tokens=N, groups=[list(range(n)), list(range(n, 2 * n))])
    assert engine.scheduler.kv.num_prefix_hits > 0
    assert_close_all(again[n:], int8_tokens, n=N)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_int8(runners, prompts, int8_tokens, mode):
    got, engine = generate(runners[1], prompts, num_tokens=N, num_kv_blocks=20, preemption_mode=mode)
    assert engine.stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert_close_all(got, int8_tokens, n=N)


def test_pd_hand_off_carries_the_scales(runners, prompts, tiny_model):
    """1P1D between two int8 engines: blocks leave in the pool's layout, scales inline, and the
    decode engine's tokens are the colocated int8 engine's."""
    decode_side = ModelRunner(EngineConfig(model=tiny_model, kv_cache_dtype="int8", **CONFIG))
    few = [prompts[i] for i in (1, 3, 5)]
    blocks = runners[1].read_blocks([0, 1])
    assert blocks.dtype == torch.int8 and blocks.shape[-1] == 68
    colocated, _ = generate(runners[1], few, one_at_a_time=True, num_tokens=10)
    pd, _, decode = generate_pd((runners[1], decode_side), few, ShmConnector(), one_at_a_time=True)
    assert [t for t, _ in pd] == [t for t, _ in colocated]
    assert decode.engine.stats.num_kv_transfers_recomputed == 0


def test_mixed_kv_dtypes_are_refused(runners):
    f32, i8 = runners
    with pytest.raises(ValueError, match="same --kv-cache-dtype"):
        f32.write_blocks([0], i8.read_blocks([0]))
    with pytest.raises(ValueError, match="same --kv-cache-dtype"):
        i8.write_blocks([0], f32.read_blocks([0]))


def test_triton_path_refuses_int8_at_start_up(tiny_model, monkeypatch):
    assert kv_dtype_name("auto", torch.bfloat16, "triton") == "bfloat16"
    assert kv_dtype_name("int8", torch.float32, "torch") == "int8"
    from iterserve.model.triton_attention import has_triton
    if not has_triton():
        pytest.skip("triton does not import here")
    monkeypatch.setenv("ITERSERVE_ATTENTION", "triton")  # the GPU path's backend, as a CUDA engine picks it
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 .* not by the triton kernels"):
        ModelRunner(EngineConfig(model=tiny_model, kv_cache_dtype="int8", **CONFIG))


def test_flag_is_generated_from_the_config_field():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).kv_cache_dtype == "auto"
    assert parser.parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp4"])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")


def test_metrics_report_the_cache_dtype(runners):
    server = start_server(Engine(EngineConfig(**CONFIG), executor=runners[1]))
    try:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert metric(text, "iterserve:cache_config_info", cache_dtype="int8") == 1
    finally:
        server.stop()


def test_tp2_int8(tiny_model, prompts, runners, int8_tokens):
    """Each rank holds its kv heads' int8 blocks and scales: TP=2 stays close to TP=1 on int8."""
    tp2 = TPExecutor(EngineConfig(model=tiny_model, tensor_parallel_size=2, kv_cache_dtype="int8", **CONFIG))
    try:
        assert tp2.kv_cache_spec.dtype == "int8"
        assert tp2.kv_cache_spec.bytes_per_block * 2 == runners[1].kv_cache_spec.bytes_per_block
        got, _ = generate(tp2, prompts[:4], num_tokens=N)
        assert_close_all(got, int8_tokens[:4], n=N)
    finally:
        tp2.shutdown()
