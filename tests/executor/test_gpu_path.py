"""The GPU path end to end, on CPU: the real default model (its first 10 layers) through the Engine
with the Triton attention backend (run by Triton's interpreter) and the decode-graph path
(CudaGraphRunner's padded buckets, run eagerly: capture needs CUDA), against the torch backend on the
same weights.

The batch mixes a chunked prompt, fresh prompts finishing with it, and decodes; a request finishing
early shrinks the decode batch from 4 to 3, so a bucket of 4 runs with a padding row (slot -1,
seq_len 0). Greedy tokens must be equal.

TRITON_INTERPRET=1 must be set before triton is first imported, so the check runs in a child
process (run this file as a script to do it by hand); ITERSERVE_ATTENTION=triton is the documented
override that selects the Triton backend on a CPU device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BS = 16
PROMPTS = ["Once upon a time, in a small village at the edge of a dark forest, there lived",
           "The capital of France is", "def fibonacci(n):", "Hi"]
LAYERS = 10
MAX_TOKENS = [6, 6, 6, 3]  # the last leaves early: the decode batch drops from 4 to 3 (padded to 4)


def generate(runner, prompts: list[list[int]]) -> list[list[int]]:
    from iterserve.config import EngineConfig
    from iterserve.engine import Engine
    from iterserve.sampling_params import SamplingParams
    # a 16-token budget: the long prompt is chunked, then joins the short ones as they prefill
    engine = Engine(EngineConfig(dtype="float32", block_size=BS, max_num_seqs=4, max_num_batched_tokens=16,
                                 num_kv_blocks=runner.kv_cache_spec.num_device_blocks), executor=runner)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
           for p, n in zip(prompts, MAX_TOKENS)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length", out.error
                done[out.request_id] = list(out.token_ids)
    return [done[i] for i in ids]


def child() -> dict:
    from iterserve.config import EngineConfig
    from iterserve.executor.cuda_graphs import CudaGraphRunner, pick_bucket
    from iterserve.executor.model_runner import ModelRunner
    from iterserve.model.attention_backend import TorchAttention

    class EagerGraphs(CudaGraphRunner):
        """What replay computes (static buffers, padding, placeholder host lists), without a graph."""
        calls: list[tuple[int, int]] = []

        def bucket(self, batch_size: int) -> int | None:
            return pick_bucket(batch_size, self.sizes)

        def run(self, inputs):
            self.calls.append((inputs.batch_size, self.bucket(inputs.batch_size)))
            return self.run_padded_eager(inputs)

    runner = ModelRunner(EngineConfig(dtype="float32", block_size=BS, num_kv_blocks=32, swap_space=0, num_threads=1))
    triton_backend = runner.model.attention
    assert triton_backend.name == "triton" and runner.graphs is None  # graphs are captured only on CUDA
    # The first 10 of the 30 real layers: every code path, at a third of the interpreter's time (it was
    # the suite's slowest part on a 2-core Zen 3). Both runs use the same truncated model.
    runner.model.layers = runner.model.layers[:LAYERS]
    prompts = [list(runner.tokenizer.encode(p)) for p in PROMPTS]
    runner.model.attention = TorchAttention(BS, runner.dtype, runner.device)  # the reference: same weights, torch attention
    want = generate(runner, prompts)
    runner.model.attention = triton_backend
    runner.graphs = EagerGraphs(runner.model.forward, runner.kv_cache, 4, runner.max_model_len, BS)
    got = generate(runner, prompts)
    return {"prompt_lens": [len(p) for p in prompts], "want": want, "got": got, "graph_calls": EagerGraphs.calls}


@pytest.fixture(scope="module")
def report(default_model_path) -> dict:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "ITERSERVE_ATTENTION": "triton"}
    proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_triton_backend_greedy_equals_torch(report):
    assert max(report["prompt_lens"]) > 16, "the long prompt must be chunked"
    assert report["got"] == report["want"]
    assert [len(t) for t in report["got"]] == MAX_TOKENS


@pytest.mark.slow
def test_decode_steps_take_the_padded_graph_path(report):
    calls = [tuple(c) for c in report["graph_calls"]]
    assert (4, 4) in calls and (3, 4) in calls, calls  # full bucket, and one padding row
    assert len(calls) >= max(MAX_TOKENS) - 2  # every pure-decode step after the prefills


# ---------------------------------------------------------------- runner logic that needs no model


def test_profile_plan_covers_the_largest_step():
    from types import SimpleNamespace

    from iterserve.config import EngineConfig
    from iterserve.executor.model_runner import ModelRunner
    for total, seats, max_len in ((2048, 64, 8192), (100, 64, 8192), (5, 64, 8192), (4096, 2, 1024)):
        fake = SimpleNamespace(config=EngineConfig(max_num_batched_tokens=total, max_num_seqs=seats),
                               block_size=BS, max_model_len=max_len)
        plan, num_blocks = ModelRunner._profile_plan(fake)
        lens = [len(r.token_ids) for r in plan.scheduled]
        assert sum(lens) == total and max(lens) - min(lens) <= 1 and max(lens) <= max_len
        blocks = [b for r in plan.scheduled for b in r.block_table]
        assert sorted(blocks) == list(range(num_blocks))  # distinct blocks, none shared
        assert all(len(r.block_table) * BS >= len(r.token_ids) for r in plan.scheduled)


def test_only_pure_decode_batches_in_a_bucket_replay():
    from types import SimpleNamespace

    import torch

    from iterserve.executor.cuda_graphs import CudaGraphRunner
    from iterserve.executor.model_runner import ModelRunner
    from iterserve.model.attention_metadata import AttentionMetadata
    replayed, eager = [], []
    graphs = CudaGraphRunner(lambda *a: None, torch.zeros(1, 2, 4, BS, 1, 1), max_num_seqs=8, max_model_len=64,
                             block_size=BS, sizes=[4, 8])
    graphs.graphs = {4: None, 8: None}  # as if captured
    graphs.run = lambda inputs: replayed.append(inputs.batch_size)
    fake = SimpleNamespace(graphs=graphs, model=SimpleNamespace(forward=lambda *a, **kw: eager.append(a[3].num_seqs)))

    def md(q_lens, width=2):
        b = len(q_lens)
        return AttentionMetadata(torch.zeros(sum(q_lens), dtype=torch.int64), torch.zeros(b + 1, dtype=torch.int32),
                                 torch.ones(b, dtype=torch.int32), torch.zeros(b, width, dtype=torch.int32),
                                 max(q_lens), 1, q_lens, [1] * b)
    for q_lens, width in (([1, 1, 1], 2), ([1] * 8, 4), ([1] * 9, 2), ([1, 5], 2), ([1, 1], 5)):
        m = md(q_lens, width)
        t = torch.zeros(sum(q_lens), dtype=torch.int64)
        ModelRunner._run_model(fake, t, t, None, m, t)
    # 9 seats exceed the largest bucket; a prompt row makes it mixed; 5 block columns exceed 64 // 16
    assert replayed == [3, 8] and eager == [9, 2, 2]


if __name__ == "__main__":
    if "--child" in sys.argv:
        print(json.dumps(child()))
    else:  # by hand: the same run, printed
        os.environ.update(TRITON_INTERPRET="1", ITERSERVE_ATTENTION="triton")
        print(json.dumps(child(), indent=1))
