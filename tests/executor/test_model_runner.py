"""ModelRunner against transformers' own model of the same GGUF, driven by hand-made plans."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    # one thread: the suite shares 2 cores with other work, and oversubscribed OpenMP threads spin
    return ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=128, block_size=BS, swap_space=8 * 2**20,
                                    num_threads=1))


class Seq:
    """A request the test schedules by hand: contiguous blocks starting at `first_block`."""

    def __init__(self, rid: str, prompt: list[int], first_block: int, params: SamplingParams = GREEDY):
        self.rid, self.tokens, self.computed, self.params = rid, list(prompt), 0, params
        self.blocks = list(range(first_block, first_block + 24))
        self.prompt_len = len(prompt)

    def chunk(self, n: int | None = None) -> ScheduledRequest:
        todo = self.tokens[self.computed:][: n or None]
        end = self.computed + len(todo)
        req = ScheduledRequest(self.rid, todo, self.computed, self.blocks[: -(-end // BS)], end == len(self.tokens),
                               self.params, output_len=len(self.tokens) - self.prompt_len)
        self.computed = end
        return req


def step(runner, reqs: list[ScheduledRequest], seqs: list[Seq]) -> list[int]:
    out = runner.execute(SchedulerOutput(scheduled=reqs, block_size=BS)).sampled
    for s, r, t in zip(seqs, reqs, out):
        if r.sample:
            s.tokens.append(t)
    return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Argmax step by step with transformers' own KV cache (generate() would suppress or stop at eos)."""
    from transformers import DynamicCache
    cache, ids, out = DynamicCache(), torch.tensor([prompt]), []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(ids, past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def prompts(tokenizer) -> list[list[int]]:
    text = ("The history of the city begins with a small fishing village on the river. " * 30)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    return [[1, 504, 3458], list(chat), tokenizer.encode(text)[:300]]


@pytest.mark.slow
def test_logits_match_transformers(runner, hf_reference_model, tokenizer):
    for i, p in enumerate(prompts(tokenizer)):
        s = Seq(f"r{i}", p, 0)
        req = s.chunk()
        inputs = runner._prepare(SchedulerOutput(scheduled=[req], block_size=BS), None)
        with torch.inference_mode():
            ours = runner.model.forward(*inputs)[0]
            ref = hf_reference_model(torch.tensor([p])).logits[0, -1]
        assert torch.allclose(ours, ref, atol=2e-3, rtol=1e-3), (ours - ref).abs().max()


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.slow
def test_greedy_matches_transformers(runner, hf_reference_model, tokenizer, chunk):
    """Prefill whole or in chunks, then decode; the other prompts run alongside in the same steps."""
    ps = prompts(tokenizer)
    seqs = [Seq(f"c{chunk}-{i}", p, 24 * i) for i, p in enumerate(ps)]
    n = 8
    while any(len(s.tokens) - s.prompt_len < n for s in seqs):
        live = [s for s in seqs if len(s.tokens) - s.prompt_len < n]
        step(runner, [s.chunk(chunk) for s in live], live)
    for s, p in zip(seqs, ps):
        assert s.tokens[len(p):] == hf_greedy(hf_reference_model, p, n)


def test_padding_and_not_sampling_rows_get_minus_one(runner):
    a, b = Seq("pa", [1, 2, 3, 4, 5], 0), Seq("pb", list(range(10, 40)), 24)
    ra, rb = a.chunk(), b.chunk(8)  # b's prompt is not complete: no sample
    ra.is_padding = True
    assert runner.execute(SchedulerOutput(scheduled=[ra, rb], block_size=BS)).sampled == [-1, -1]


def test_empty_plan(runner):
    res = runner.execute(SchedulerOutput(block_size=BS, finished_ids=["nobody"]))
    assert res.sampled == [] and res.step_time < 0.05


def test_swap_out_and_in_restores_the_cache(runner):
    before = runner.kv_cache[:, :, [3, 5]].clone()
    runner.execute(SchedulerOutput(block_size=BS, swap_out=[(3, 0), (5, 1)]))
    runner.kv_cache[:, :, [3, 5]] = 0
    runner.execute(SchedulerOutput(block_size=BS, swap_in=[(0, 3), (1, 5)]))
    assert torch.equal(runner.kv_cache[:, :, [3, 5]], before)


def test_seeded_sampling_is_independent_of_the_batch(runner):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, logprobs=3)
    prompt = [1, 504, 3458, 314]

    def run(with_others: bool) -> list[int]:
        s = Seq("seeded", prompt, 0, params)
        others = [Seq("o1", list(range(100, 120)), 24, SamplingParams(temperature=0.8)),
                  Seq("o2", [5, 6], 48, GREEDY)] if with_others else []
        for _ in range(6):
            seqs = [s] + others
            step(runner, [x.chunk() for x in seqs], seqs)
        runner.execute(SchedulerOutput(block_size=BS, finished_ids=["seeded", "o1", "o2"]))
        return s.tokens[len(prompt):]

    assert run(False) == run(True)


def test_attributes(runner):
    spec = runner.kv_cache_spec
    assert spec.num_device_blocks == 128 and spec.num_host_blocks == 8 * 2**20 // spec.bytes_per_block
    assert spec.bytes_per_block == 2 * 30 * BS * 3 * 64 * 4 and spec.dtype == "float32"
    assert 2 in runner.eos_token_ids and runner.max_model_len == 8192 and runner.vocab_size == 49152
    assert runner.dtype == torch.float32 and runner.device.type == "cpu"
    assert runner.kv_cache.shape == (30, 2, 128, BS, 3, 64)


@pytest.mark.slow
def test_bf16_storage_keeps_weights_and_kv_in_bfloat16_and_computes_in_float32(runner, monkeypatch):
    """The default on a CPU without bf16 instructions (where the kernels build): half float32's bytes
    per step and per cached token, float32 arithmetic; greedy tokens as the float32 runner's here."""
    from iterserve.executor.dtypes import storage_dtype
    from iterserve.model import cpu_kernels, cpu_paths
    from iterserve.model.quant import PanelWeight
    if cpu_kernels.linear_kernel() is None:
        pytest.skip("cpu_linear.cpp not built here")
    mixed = ModelRunner(EngineConfig(dtype="bf16-storage", num_kv_blocks=128, block_size=BS, num_threads=1))
    assert mixed.dtype == torch.float32 and mixed.storage_dtype == torch.bfloat16
    assert mixed.kv_cache.dtype == torch.bfloat16 and mixed.kv_cache_spec.dtype == "bfloat16"
    assert mixed.kv_cache_spec.bytes_per_block * 2 == runner.kv_cache_spec.bytes_per_block
    qkv = mixed.model.layers[0].qkv
    assert isinstance(qkv, PanelWeight) and qkv.panels.dtype == torch.bfloat16
    cpu = torch.device("cpu")
    # auto keeps bfloat16 either way: as the arithmetic's dtype on a bf16 CPU, under float32 arithmetic elsewhere
    # (beside weight-only int8/int4 too where they run on the kernel's panels; torch's kernels and w8a8 take
    # the arithmetic's dtype)
    assert storage_dtype("auto", cpu) == torch.bfloat16
    bf16_cpu, weight_only = cpu_paths.current().bf16_arithmetic, cpu_kernels.linear_weight_only_supported()
    assert storage_dtype("auto", cpu, "int8") == (torch.bfloat16 if bf16_cpu or weight_only else torch.float32)
    assert storage_dtype("auto", cpu, "w8a8") == (torch.bfloat16 if bf16_cpu else torch.float32)
    if weight_only:
        assert storage_dtype("bf16-storage", cpu, "int4") == torch.bfloat16
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "linear_weight_only_supported", lambda flags=(): False)
        with pytest.raises(ValueError, match="quantization int4"):
            storage_dtype("bf16-storage", cpu, "int4")
    prompt = list(range(100, 140))

    def greedy(r):
        tokens, blocks = list(prompt), list(range(-(-(len(prompt) + 8) // BS)))
        for i in range(8):
            start = 0 if i == 0 else len(tokens) - 1
            plan = SchedulerOutput(block_size=BS, scheduled=[ScheduledRequest(
                "g", tokens[start:], start, blocks, True, SamplingParams(temperature=0))])
            tokens.append(r.execute(plan).sampled[0])
        return tokens[len(prompt):]

    assert greedy(mixed) == greedy(runner)


@given(st.lists(st.integers(0, 40), unique=True, max_size=20))
@settings(max_examples=60, deadline=None)
def test_blocks_move_run_by_run_as_indexing_would(block_ids):
    """gather/scatter copy runs of consecutive ids as slices; the result is pool[:, :, ids]'s."""
    from iterserve.executor.kv_pool import block_runs, gather_blocks, scatter_blocks
    pool = torch.arange(2 * 2 * 41 * 3, dtype=torch.float32).view(2, 2, 41, 3)
    runs = block_runs(block_ids)
    assert [b for _, first, n in runs for b in range(first, first + n)] == block_ids
    assert all(runs[k][1] + runs[k][2] != runs[k + 1][1] for k in range(len(runs) - 1))  # maximal runs
    assert torch.equal(gather_blocks(pool, block_ids), pool[:, :, block_ids])
    blocks = -torch.rand(2, 2, len(block_ids), 3)
    want = pool.clone()
    want[:, :, block_ids] = blocks
    scatter_blocks(pool, block_ids, blocks)
    assert torch.equal(pool, want)
