"""Multi-LoRA (model/lora.py): random PEFT adapters on a tiny random Llama and on the default model,
against transformers + PEFT; several adapters and the base in one batch; refusals."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.executor.model_runner import ModelRunner
from iterserve.model import cpu_paths
from iterserve.model.loader import load_model_arch, load_weights
from iterserve.sampling_params import SamplingParams
from tests.model.test_llama import tiny_checkpoint

pytestmark = pytest.mark.slow  # transformers + PEFT beside the engine

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 12


def make_adapter(hf, path: str, seed: int, r: int = 8, targets=tuple(ALL), rslora: bool = False,
                 b_std: float = 0.05, **lora_config):
    """A random PEFT LoRA adapter of `hf` saved at `path`; returns transformers + PEFT's model of it.
    B is random too (PEFT starts it at zero), so the adapter changes the outputs."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=16, target_modules=list(targets), lora_dropout=0.0, use_rslora=rslora,
                        init_lora_weights=False, **lora_config)
    model = get_peft_model(copy.deepcopy(hf), config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, b_std)
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logprob of each token of `tokens`, teacher-forced after the prompt."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]


def tiny_engine(path: str, dtype: str = "float32", **kwargs) -> Engine:
    config = EngineConfig(dtype=dtype, device="cpu", block_size=4, num_kv_blocks=128, **kwargs)
    arch = load_model_arch(path)
    weights = load_weights(path, arch, getattr(torch, dtype), torch.device("cpu"))
    return Engine(config, ModelRunner(config, arch, weights))


def run(engine: Engine, prompts, adapters, n: int = NEW_TOKENS, logprobs: int | None = None) -> list:
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=logprobs,
                                                lora_name=a)) for p, a in zip(prompts, adapters)]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The checkpoint, transformers' model and four adapters of different ranks, targets and scaling."""
    root = tmp_path_factory.mktemp("lora")
    base = str(root / "base")
    hf = tiny_checkpoint(base, "llama")
    kinds = [dict(), dict(r=4, targets=("q_proj", "v_proj")), dict(rslora=True, targets=("o_proj", "down_proj")),
             dict(r=16, targets=("gate_proj", "up_proj", "k_proj"))]
    adapters = {}
    for i, kind in enumerate(kinds):
        path = str(root / f"a{i}")
        adapters[f"a{i}"] = (path, make_adapter(hf, path, seed=i + 1, **kind))
    return base, hf, adapters


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(k),), generator=g).tolist() for k in torch.randint(3, 20, (n,), generator=g)]


def test_greedy_tokens_equal_transformers_peft_in_float32(tiny):
    base, hf, adapters = tiny
    engine = tiny_engine(base, lora_modules=[f"{name}={path}" for name, (path, _) in adapters.items()])
    ps = prompts(2)
    for name, (_, peft_model) in adapters.items():
        outs = run(engine, ps, [name] * len(ps))
        for p, out in zip(ps, outs):
            assert out.token_ids == hf_greedy(peft_model, p), name
    assert [o.token_ids for o in run(engine, ps, [None, None])] == [hf_greedy(hf, p) for p in ps]


def test_adapters_change_the_output(tiny):
    base, hf, adapters = tiny
    engine = tiny_engine(base, lora_modules=[f"a0={adapters['a0'][0]}"])
    p = prompts(1)
    assert run(engine, p, ["a0"])[0].token_ids != run(engine, p, [None])[0].token_ids


def test_bf16_logprobs_close_to_transformers_peft(tiny):
    base, _, adapters = tiny
    engine = tiny_engine(base, dtype="bfloat16", lora_modules=[f"a0={adapters['a0'][0]}"])
    p = prompts(1, seed=3)[0]
    out = run(engine, [p], ["a0"], logprobs=1)[0]
    ours = torch.tensor([lp.logprob for lp in out.logprobs])
    torch.testing.assert_close(ours, hf_logprobs(adapters["a0"][1], p, out.token_ids), atol=0.15, rtol=0.05)


def test_four_adapters_and_the_base_in_one_batch_each_get_their_own_tokens(tiny):
    base, _, adapters = tiny
    names = [*adapters, None]
    engine = tiny_engine(base, lora_modules=[f"{name}={path}" for name, (path, _) in adapters.items()])
    ps = prompts(10, seed=5)
    mix = [names[i % len(names)] for i in range(len(ps))]
    alone = [run(engine, [p], [a])[0].token_ids for p, a in zip(ps, mix)]
    together = [o.token_ids for o in run(engine, ps, mix)]
    assert together == alone
    for p, a, tokens in zip(ps, mix, together):
        assert tokens == hf_greedy(hf_model(tiny, a), p)


def hf_model(tiny, name: str | None):
    _, hf, adapters = tiny
    return hf if name is None else adapters[name][1]


def test_prefix_cache_never_shares_blocks_across_adapters(tiny):
    base, _, adapters = tiny
    engine = tiny_engine(base, enable_prefix_caching=True,
                         lora_modules=[f"a0={adapters['a0'][0]}", f"a1={adapters['a1'][0]}"])
    p = prompts(1, seed=7)[0] * 3  # several full blocks
    first = run(engine, [p], ["a0"])[0].token_ids
    hits = engine.stats.num_prefix_hits
    other = run(engine, [p], ["a1"])[0].token_ids
    assert engine.stats.num_prefix_hits == hits  # another adapter: nothing reused
    assert other == hf_greedy(adapters["a1"][1], p)
    assert run(engine, [p], ["a0"])[0].token_ids == first
    assert engine.stats.num_prefix_hits > hits  # the same adapter: its blocks reused


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decodes_with_adapters_in_the_c_loop_give_the_python_loops_tokens_and_logprobs(tiny, monkeypatch, dtype):
    """Decode steps of four adapters and the base mixed run their layers in one C call (cpu_decode.cpp adds each
    row's adapter), wherever cpu_paths says the loop runs, with the Python loop's tokens and near its logprobs."""
    base, _, adapters = tiny
    engine = tiny_engine(base, dtype=dtype, lora_modules=[f"{name}={path}" for name, (path, _) in adapters.items()])
    paths = cpu_paths.current()
    if dtype == "bfloat16" and paths.default_dtype == "bfloat16":
        assert (engine.executor.model.decode_layers is not None) == paths.decode_loop
    check_c_loop_against_python(engine, [*adapters, None], monkeypatch, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_c_loops_lora_on_widths_and_ranks_off_its_vector_lengths(tmp_path, monkeypatch, dtype):
    """Input and output widths that are no multiple of the kernel's 16, 32 or 64 lanes and a rank no multiple
    of its four rows at a time: every tail of cpu_lora.h, against the Python loop."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=2,
                                      head_dim=16, num_key_value_heads=1, vocab_size=128, rms_norm_eps=1e-6)).eval()
    hf.save_pretrained(tmp_path / "base")
    for i in range(2):
        make_adapter(hf, str(tmp_path / f"r{i}"), seed=i, r=3)
    engine = tiny_engine(str(tmp_path / "base"), dtype=dtype, max_lora_rank=3,
                         lora_modules=[f"r{i}={tmp_path / f'r{i}'}" for i in range(2)])
    check_c_loop_against_python(engine, ["r0", None, "r1"], monkeypatch, dtype)


def check_c_loop_against_python(engine: Engine, names: list[str | None], monkeypatch, dtype: str) -> None:
    """The adapters (and the base) mixed over ten requests: every decode step in C, then all in the Python loop."""
    model = engine.executor.model
    if model.decode_layers is None:
        pytest.skip("the C decode loop does not run this dtype on this CPU build")
    calls = []
    real = type(model.decode_layers).__call__
    monkeypatch.setattr(type(model.decode_layers), "__call__",
                        lambda self, *a: calls.append(a[-1] is not None) or real(self, *a))
    ps = prompts(10, seed=13)
    mix = [names[i % len(names)] for i in range(len(ps))]
    in_c = run(engine, ps, mix, logprobs=1)
    assert calls and all(calls)  # every decode step, adapters present, in C
    calls.clear()
    model.decode_layers = None
    in_python = run(engine, ps, mix, logprobs=1)
    assert not calls
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=0.05, rtol=0.05)
    for c, py in zip(in_c, in_python):
        # equal tokens; in bfloat16 up to a near-tie of a tiny random model's flat logits, where each side's
        # token is its own top with the other's logprob (the rest of the run then differs by design)
        n = next((i for i, (a, b) in enumerate(zip(c.token_ids, py.token_ids)) if a != b), len(c.token_ids))
        assert n == len(c.token_ids) or dtype == "bfloat16"
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in c.logprobs[:n + 1]]),
                                   torch.tensor([lp.logprob for lp in py.logprobs[:n + 1]]), **tolerance)


def test_load_and_unload_between_steps(tiny):
    base, _, adapters = tiny
    engine = tiny_engine(base, max_loras=2)
    p = prompts(1, seed=9)[0]
    rid = engine.add_request(p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    engine.step()
    engine.load_lora("a2", adapters["a2"][0])  # while a base request is in flight
    assert engine.lora_adapters == {"a2": adapters["a2"][0]}
    out = run(engine, [p], ["a2"])[0]
    assert out.token_ids == hf_greedy(adapters["a2"][1], p)
    assert rid not in engine.states  # the base request finished too
    busy = engine.add_request(p, SamplingParams(max_tokens=4, lora_name="a2"))
    with pytest.raises(ValueError, match="in use"):
        engine.unload_lora("a2")
    engine.abort_request(busy)
    engine.unload_lora("a2")
    with pytest.raises(ValueError, match="no LoRA adapter named 'a2'"):
        engine.add_request(p, SamplingParams(lora_name="a2"))
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_refusals(tiny, tmp_path):
    base, hf, adapters = tiny
    engine = tiny_engine(base, max_loras=2, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16, above --max-lora-rank 8"):
        engine.load_lora("big", adapters["a3"][0])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.load_lora("missing", str(tmp_path / "nowhere"))
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="cannot read .* as GGUF"):
        engine.load_lora("g", str(gguf))
    embed = str(tmp_path / "embed")
    make_adapter(hf, embed, seed=1, targets=("q_proj", "embed_tokens"))
    with pytest.raises(ValueError, match="embed_tokens"):
        engine.load_lora("e", embed)
    dora = tmp_path / "dora"
    os.makedirs(dora)
    with open(dora / "adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "use_dora": True, "r": 8, "lora_alpha": 8}, f)
    with pytest.raises(ValueError, match="DoRA"):
        engine.load_lora("d", str(dora))
    engine.load_lora("a0", adapters["a0"][0])
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora("a0", adapters["a0"][0])
    engine.load_lora("a1", adapters["a1"][0])
    with pytest.raises(ValueError, match="all --max-loras 2 LoRA slots"):
        engine.load_lora("a2", adapters["a2"][0])
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        engine.add_request([1, 2, 3], SamplingParams(lora_name="nope"))
    assert set(engine.lora_adapters) == {"a0", "a1"}


def test_per_module_ranks_load(tiny, tmp_path):
    base, hf, _ = tiny
    path = str(tmp_path / "pattern")
    peft_model = make_adapter(hf, path, seed=11, r=8, rank_pattern={"q_proj": 2, "down_proj": 4})
    engine = tiny_engine(base, lora_modules=[f"p={path}"])
    p = prompts(1, seed=11)[0]
    assert run(engine, [p], ["p"])[0].token_ids == hf_greedy(peft_model, p)


def test_lora_modules_beyond_max_loras_are_refused():
    with pytest.raises(ValueError, match="do not fit max_loras 1"):
        EngineConfig(lora_modules=["a=/x", "b=/y"], max_loras=1)


def test_default_model_with_a_random_rank8_adapter(tmp_path, default_model_path, hf_reference_model, tokenizer):
    """transformers' float32 model of the shipped GGUF, with the adapter, against iterserve's float32 run:
    tokens equal up to the first difference, and there each side's token in the other's top 5 (a near-tie)."""
    path = str(tmp_path / "smol-lora")
    peft_model = make_adapter(hf_reference_model, path, seed=0, b_std=0.02)
    runner = ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=64, lora_modules=[f"smol={path}"]))
    engine = Engine(EngineConfig(dtype="float32", num_kv_blocks=64), executor=runner)
    p = tokenizer.encode("The capital of France is a city that", add_special_tokens=False)
    out = run(engine, [p], ["smol"], n=16, logprobs=5)[0]
    base = run(engine, [p], [None], n=16)[0]
    assert out.token_ids != base.token_ids  # the adapter matters
    with torch.inference_mode():
        logits = peft_model(torch.tensor([p + out.token_ids[:-1]])).logits[0, len(p) - 1:].float()
    want = logits.argmax(-1).tolist()
    for i, (ours, theirs) in enumerate(zip(out.token_ids, want)):
        if ours != theirs:
            assert theirs in {t for t, _ in out.logprobs[i].top}
            assert ours in set(torch.topk(logits[i], 5).indices.tolist())
            break


def test_steps_with_adapters_never_replay_a_cuda_graph():
    """The graphs hold the base weights alone: a pure-decode step that fits a bucket replays only without LoRA."""
    from types import SimpleNamespace

    from iterserve.executor.cuda_graphs import CudaGraphRunner
    from iterserve.model.attention_metadata import AttentionMetadata
    replayed, eager = [], []
    graphs = CudaGraphRunner(lambda *a: None, torch.zeros(1, 2, 4, 16, 1, 1), max_num_seqs=8, max_model_len=64,
                             block_size=16, sizes=[4, 8])
    graphs.graphs = {4: None, 8: None}  # as if captured
    graphs.run = lambda inputs: replayed.append(inputs.batch_size)
    fake = SimpleNamespace(graphs=graphs, model=SimpleNamespace(forward=lambda *a, lora: eager.append(lora)))
    md = AttentionMetadata(torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int32),
                           torch.ones(3, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32), 1, 1, [1] * 3, [1] * 3)
    t = torch.zeros(3, dtype=torch.int64)
    lora = object()
    ModelRunner._run_model(fake, t, t, None, md, t, lora)
    ModelRunner._run_model(fake, t, t, None, md, t)
    assert eager == [lora] and replayed == [3]


def _slots(max_loras: int, max_rank: int, seed: int):
    """LoRASlots of a one-layer model shape, every slot filled with random A and B (the fused layout's zeros kept)."""
    from types import SimpleNamespace

    from iterserve.model.lora import LoRASlots
    cfg = SimpleNamespace(hidden_size=8, intermediate_size=12, num_layers=1, residual_multiplier=1.0)
    model = SimpleNamespace(cfg=cfg, q_size=8, kv_size=4, layers=[SimpleNamespace(experts=None)],
                            dtype=torch.float64, device=torch.device("cpu"))
    slots = LoRASlots(model, max_loras, max_rank)
    slots._allocate()
    g = torch.Generator().manual_seed(seed)
    for fused in slots.a[0]:
        slots.a[0][fused].copy_(torch.randn(slots.a[0][fused].shape, generator=g, dtype=torch.float64))
        slots.b[0][fused].copy_(torch.randn(slots.b[0][fused].shape, generator=g, dtype=torch.float64))
    slots.slot_of = {f"s{i}": i for i in range(max_loras)}
    return slots


def test_grouped_rows_equal_each_row_under_its_own_adapter():
    """The step's grouping by adapter adds, to every row, its own adapter's delta and nothing to base rows,
    whatever the mix of requests, adapters and chunk lengths."""
    from hypothesis import given, settings, strategies as st

    slots = _slots(3, 2, seed=0)

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.tuples(st.sampled_from([None, "s0", "s1", "s2"]), st.integers(1, 5)), min_size=1, max_size=6))
    def check(requests):
        names, q_lens = [n for n, _ in requests], [k for _, k in requests]
        x = torch.randn(sum(q_lens), 8, dtype=torch.float64)
        y = torch.randn(sum(q_lens), 16, dtype=torch.float64)
        want = y.clone()
        row = 0
        for name, k in requests:
            if name is not None:
                s = slots.slot_of[name]
                want[row:row + k] += x[row:row + k] @ slots.a[0]["qkv"][s].T @ slots.b[0]["qkv"][s]
            row += k
        batch = slots.batch(names, q_lens)
        if batch is None:
            assert all(n is None for n in names)
        else:
            batch.layer(0).add(y, x, "qkv")
        torch.testing.assert_close(y, want)

    check()


def test_adapter_salts_never_meet_cache_salts():
    from iterserve.request import Request, RequestTimes

    def salt(lora, cache_salt):
        return Request("r", [1], SamplingParams(lora_name=lora), RequestTimes(0.0), cache_salt=cache_salt).prefix_salt

    pairs = [(None, None), (None, "x"), ("a", None), ("a", "x"), ("ax", None), ("a", "1:ax"), ("a:", "x")]
    assert len({salt(*p) for p in pairs}) == len(pairs)
    from iterserve.engine import Engine
    from tests.fake_executor import FakeExecutor
    with pytest.raises(ValueError, match="NUL"):
        Engine(EngineConfig(), FakeExecutor()).add_request([1, 2], cache_salt="\0lora:1:a")
