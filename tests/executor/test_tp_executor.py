"""Tensor parallelism on CPU (gloo): TP=2 gives TP=1's greedy tokens, through the Engine, `LLM` and
the server, with int8 weights, prefix-cache hits and swap preemption; bad sizes and ports fail at
start-up with nothing left running; a rank that dies fails the executor and takes the others down.

The default model has 9 heads and 3 kv heads, so TP=2 runs on a tiny random Llama with 4 and 2
(the default model's tokenizer saved beside it, so text prompts and the server work)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap

import httpx
import openai
import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.executor.base import ExecutorDeadError
from iterserve.executor.model_runner import ModelRunner
from iterserve.executor.tp_executor import TPExecutor
from iterserve.llm import LLM
from iterserve.sampling_params import SamplingParams
from tests.engine.test_greedy_reference import PROMPT_LENS, TEXT, assert_close_all, generate
from tests.model.test_cpu_linear import needs_int8
from tests.server.conftest import MODEL, start_server, wait_for

pytestmark = pytest.mark.slow  # every test starts rank processes

CACHE = dict(dtype="float32", num_kv_blocks=128, swap_space="4MiB")
TEXTS = ["The capital of France is", "One, two, three, four,", "Once upon a time"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("tiny-tp")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                      initializer_range=0.1)  # peakier logits than the default 0.02: fewer float near-ties
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """The engine's reference prompts (tests/engine/test_greedy_reference.py)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return [ids[7 * i: 7 * i + n] for i, n in enumerate(PROMPT_LENS)]


def executors(model: str, **config):
    tp1 = ModelRunner(EngineConfig(model=model, **CACHE, **config))
    tp2 = TPExecutor(EngineConfig(model=model, tensor_parallel_size=2, **CACHE, **config))
    return tp1, tp2


@pytest.fixture(scope="module")
def float_pair(tiny_model):
    tp1, tp2 = executors(tiny_model)
    yield tp1, tp2
    tp2.shutdown()


def test_kv_per_rank_is_a_share_of_the_whole(float_pair):
    tp1, tp2 = float_pair
    assert tp2.kv_cache_spec.num_kv_heads == tp1.kv_cache_spec.num_kv_heads // 2
    assert tp2.kv_cache_spec.bytes_per_block * 2 == tp1.kv_cache_spec.bytes_per_block
    assert tp2.eos_token_ids == tp1.eos_token_ids and tp2.vocab_size == tp1.vocab_size


def test_tp2_matches_tp1_batched_and_chunked(float_pair, prompts):
    tp1, tp2 = float_pair
    want, _ = generate(tp1, prompts)
    got, _ = generate(tp2, prompts)
    assert_close_all(got, want)
    chunked, engine = generate(tp2, prompts, max_num_batched_tokens=48)
    assert max(r.num_batched_tokens for r in engine.step_records) <= 48
    assert_close_all(chunked, want)


def test_tp2_prefix_cache_hits(float_pair, prompts):
    tp1, tp2 = float_pair
    want, _ = generate(tp1, prompts)
    n = len(prompts)  # the second round runs after the first has freed (and cached) its blocks
    got, engine = generate(tp2, prompts + prompts, groups=[list(range(n)), list(range(n, 2 * n))])
    assert engine.stats.num_prefix_hits > 0
    assert_close_all(got[n:], want)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tp2_preempted(float_pair, prompts, mode):
    tp1, tp2 = float_pair
    want, _ = generate(tp1, prompts)
    got, engine = generate(tp2, prompts, num_kv_blocks=24, preemption_mode=mode)
    assert engine.stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert_close_all(got, want)


def test_tp2_penalties_and_prompt_logprobs_next_to_plain_requests(float_pair, prompts):
    """Each rank keeps every request's token history from the plans' data and deltas: requests whose
    sampler reads it (penalties, prompt logprobs), batched with requests that do not, sample as under TP=1."""
    tp1, tp2 = float_pair
    asks = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5),
            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5, repetition_penalty=1.5,
                           presence_penalty=0.5, frequency_penalty=0.3),
            SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=3)]

    def outputs(executor):
        engine = Engine(EngineConfig(dtype="float32"), executor=executor)
        for i, params in enumerate(asks):
            engine.add_request(prompts[4], params, request_id=str(i))
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return [done[str(i)] for i in range(len(asks))]
    want, got = outputs(tp1), outputs(tp2)
    assert want[0].token_ids != want[1].token_ids, "the penalties were meant to change the tokens"
    assert_close_all([(o.token_ids, [{t for t, _ in lp.top} for lp in o.logprobs]) for o in got],
                     [(o.token_ids, [{t for t, _ in lp.top} for lp in o.logprobs]) for o in want], n=4, max_diverged=0)
    ours, theirs = got[2].prompt_logprobs[1:], want[2].prompt_logprobs[1:]
    assert len(ours) == len(prompts[4]) - 1
    assert [a.logprob for a in ours] == pytest.approx([b.logprob for b in theirs], abs=1e-3)


def test_tp2_structured_output_after_a_handover(float_pair, prompts):
    """A request handed over by a prefill engine whose blocks did not arrive is recomputed here with its
    first token already in its output: every rank's matcher must start from that token, which no rank
    sampled. TP=2 gives TP=1's tokens, and the reply parses against its JSON schema."""
    import json

    from iterserve.kv_transfer.connector import HandoffMeta, KVTransfer
    from iterserve.sampling_params import StructuredOutputs
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=5,
                            structured_outputs=StructuredOutputs(json=json.dumps(schema)))
    tp1, tp2 = float_pair

    def run(executor, first_token=None):
        engine = Engine(EngineConfig(dtype="float32"), executor=executor)
        if first_token is None:
            engine.add_request(prompts[2], params, request_id="h")
        else:
            meta = HandoffMeta(prompts[2], first_token, params, arrival_time=0.0, first_token_time=0.0)
            assert engine.add_computed_request(KVTransfer("h", None, [], meta, error="lost"))
        while engine.has_unfinished():
            done = [o for o in engine.step() if o.finished]
        return done[0]
    whole = run(tp1)
    want, got = run(tp1, whole.token_ids[0]), run(tp2, whole.token_ids[0])
    assert want.token_ids == whole.token_ids
    assert set(json.loads(got.text)) == {"n", "ok"}
    tops = lambda o: [{t for t, _ in lp.top} for lp in o.logprobs]  # noqa: E731
    assert_close_all([(got.token_ids[1:], tops(got))], [(want.token_ids[1:], tops(want))],
                     n=len(want.token_ids) - 1, max_diverged=0)


@pytest.mark.parametrize("mode", ["int8", pytest.param("w8a8", marks=needs_int8)])
def test_tp2_int8(tiny_model, float_pair, prompts, mode):
    """int8 scales are per output row, so the row-parallel o/down slices get their own (each over
    fewer weights): TP=2 int8 is a slightly different quantization from TP=1 int8 (and w8a8's
    activation groups fall differently on a slice). Every prompt must stay logprob-close to it, and to
    float32, where a wrong shard would be off from the first token."""
    tp1, tp2 = executors(tiny_model, quantization=mode)
    try:
        want, _ = generate(tp1, prompts)
        got, _ = generate(tp2, prompts)
        assert_close_all(got, want, max_diverged=len(prompts))
        assert_close_all(got, generate(float_pair[0], prompts)[0], max_diverged=len(prompts))
    finally:
        tp2.shutdown()


def test_tp2_bfloat16(tiny_model, prompts):
    """gloo sums bf16 partials (rounded once more than TP=1's single accumulation): close, not equal."""
    tp1 = ModelRunner(EngineConfig(model=tiny_model, **{**CACHE, "dtype": "bfloat16"}))
    tp2 = TPExecutor(EngineConfig(model=tiny_model, tensor_parallel_size=2, **{**CACHE, "dtype": "bfloat16"}))
    try:
        want, _ = generate(tp1, prompts[:4], num_tokens=16)
        got, _ = generate(tp2, prompts[:4], num_tokens=16)
        assert_close_all(got, want, n=16, max_diverged=4)
    finally:
        tp2.shutdown()


def test_llm_and_server_tp2_match_tp1(tiny_model):
    """One TP=2 engine, first through LLM.generate, then behind the HTTP server, until a rank is
    killed: the next request fails naming it, /health says the engine is dead, no rank is left."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.text for o in LLM(tiny_model, **CACHE).generate(TEXTS, params)]
    llm = LLM(tiny_model, tensor_parallel_size=2, **CACHE)
    engine = llm.engine
    try:
        assert [o.text for o in llm.generate(TEXTS, params)] == want
        server = start_server(engine)
    except BaseException:
        engine.shutdown()
        raise
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        for text, expected in zip(TEXTS, want):
            r = client.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == expected
            streamed = client.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in streamed) == expected
        os.kill(engine.executor.pids[1], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="rank 1 .* was killed by SIGKILL"):
            client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=4)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "rank 1" in health.text
    finally:
        server.stop()
        engine.shutdown()
    assert not any(_alive(pid) for pid in engine.executor.pids)


# ---------------------------------------------------------------- start-up errors, deaths, shutdown

def test_default_model_tp2_is_a_clear_error(default_model_path):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the model's 9 attention heads "
                                         r"and 3 kv heads; sizes that do: 1, 3"):
        TPExecutor(EngineConfig(model=default_model_path, tensor_parallel_size=2))
    assert set(multiprocessing.active_children()) <= before


def test_more_ranks_than_cuda_devices(tiny_model, monkeypatch):
    """One CUDA device, as this torch reports it (patched: the check runs before any device is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 CUDA devices, this machine has 1"):
        TPExecutor(EngineConfig(model=tiny_model, device="cuda", tensor_parallel_size=2))
    assert set(multiprocessing.active_children()) <= before


def test_port_in_use_is_a_clear_error(tiny_model):
    before = set(multiprocessing.active_children())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            TPExecutor(EngineConfig(model=tiny_model, tensor_parallel_size=2, distributed_port=port))
    assert set(multiprocessing.active_children()) <= before
    with pytest.raises(ValueError, match="distributed_port"):
        EngineConfig(tensor_parallel_size=2, distributed_port=70000)


def test_a_bad_value_found_in_the_ranks_is_a_value_error(tiny_model):
    """max_model_len beyond the model's context is found where the model loads: in every rank."""
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="rank [01] failed: ValueError: max_model_len 1000 exceeds the model's context"):
        TPExecutor(EngineConfig(model=tiny_model, tensor_parallel_size=2, max_model_len=1000, **CACHE))
    assert set(multiprocessing.active_children()) <= before


def test_ranks_exit_when_the_engine_process_is_killed(tiny_model):
    script = textwrap.dedent(f"""
        import os, sys
        from iterserve.config import EngineConfig
        from iterserve.executor.tp_executor import TPExecutor
        ex = TPExecutor(EngineConfig(model={tiny_model!r}, tensor_parallel_size=2, dtype="float32", num_kv_blocks=16))
        print(*ex.pids, flush=True)
        sys.stdin.read()  # until the test kills us
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.kill()
        proc.wait(10)
        wait_for(lambda: not any(_alive(p) for p in pids), 30, "ranks outlived their engine")
    finally:
        proc.kill()


def test_a_rank_that_dies_fails_the_executor_and_stops_the_others(float_pair, prompts):
    """Last in the module: it kills the shared TP=2 executor."""
    tp2 = float_pair[1]
    try:
        engine = Engine(EngineConfig(dtype="float32"), executor=tp2)
        engine.add_request(prompts[0], SamplingParams(max_tokens=4, temperature=0))
        engine.step()
        os.kill(tp2.pids[1], signal.SIGKILL)
        with pytest.raises(ExecutorDeadError, match=r"tensor-parallel rank 1 \(pid \d+\) was killed by SIGKILL"):
            engine.step()
        wait_for(lambda: not any(_alive(pid) for pid in tp2.pids), 20, "rank 0 outlived the failure")
        with pytest.raises(ExecutorDeadError, match="rank 1"):  # and it stays dead, saying why
            tp2.execute(engine.scheduler.schedule())
    finally:
        tp2.shutdown()


def _alive(pid: int) -> bool:
    """Running, and not a zombie left for init to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif((os.cpu_count() or 1) < 3, reason="3 ranks on fewer cores: minutes (passed in 177 s on 2)")
def test_default_model_tp3_matches_tp1(default_model_path, prompts):
    """The default model's 9 heads and 3 kv heads split in three (3 ranks on however many cores)."""
    config = dict(model=default_model_path, dtype="float32", num_kv_blocks=64)
    want, _ = generate(ModelRunner(EngineConfig(**config)), prompts[:3], num_tokens=16)
    tp3 = TPExecutor(EngineConfig(tensor_parallel_size=3, num_threads=1, **config))
    try:
        got, _ = generate(tp3, prompts[:3], num_tokens=16)
    finally:
        tp3.shutdown()
    assert_close_all(got, want, n=16)


