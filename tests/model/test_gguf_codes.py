"""A quantized GGUF served from its own codes (model/gguf_quant.py): Q4_0/Q4_1/Q4_K blocks become int4 group for
group, other types per-row int8; no float copy of the model; --quantization auto; the memory check; the cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.engine import Engine
from iterserve.model import cache_entry, cpu_kernels, cpu_paths, gguf_quant, loader, weight_cache
from iterserve.model.quant import Int4Weight, Int8Codes, Int8Weight, linear
from iterserve.model.quant import quantize as serve
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput
from tests.model.test_loader import write_tiny_gguf
from tests.model.test_weight_cache import entries, prompt_logits

H, HEADS, KV, D, FF, VOCAB, LAYERS = 256, 4, 2, 64, 512, 128, 2


def blocks(rows: int, k: int, qtype: Q, rng) -> np.ndarray:
    """Rows of `qtype` blocks: Q4_0/Q4_1/Q8_0 quantized by gguf from random floats; Q4_K and Q6_K (which gguf's
    numpy code cannot quantize) random bytes with sane float16 scales."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        return quantize(rng.standard_normal((rows, k)).astype(np.float32) * 0.05, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * k // block, size), dtype=np.uint8)
    scales = (rng.uniform(2e-4, 1e-3, (raw.shape[0], 2))).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        raw[:, 0:4] = scales  # d, dmin
    else:  # Q6_K: d is the block's last 2 bytes
        raw[:, 208:210] = scales[:, :2]
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_int4_codes_are_the_blocks_values(qtype):
    raw = blocks(48, 512, qtype, np.random.default_rng(0))
    codes = gguf_quant.int4_codes(raw, qtype)
    want = torch.from_numpy(dequantize(raw, qtype))
    assert codes.q.dtype == torch.uint8 and int(codes.q.max()) <= 15
    assert torch.equal(codes.dequantize(torch.float32), want)  # exactly: the same arithmetic, in float32
    served = serve(codes, "int4", torch.bfloat16)
    assert isinstance(served, Int4Weight)
    got = linear(torch.eye(512, dtype=torch.bfloat16), served).float().t()  # x = I reads the weight back
    # scale and zero rounded to bfloat16 (3 significant digits): up to ~16 steps of their rounding
    torch.testing.assert_close(got, want, atol=float(want.abs().max()) * 2 ** -6, rtol=0)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K])
def test_other_types_become_per_row_int8(qtype):
    raw = blocks(40, 512, qtype, np.random.default_rng(1))
    codes = gguf_quant.codes(raw, qtype)
    assert isinstance(codes, Int8Codes)
    want = torch.from_numpy(dequantize(raw, qtype))
    step = want.abs().amax(dim=1, keepdim=True) / 127
    assert ((codes.dequantize(torch.float32) - want).abs() <= step / 2 + 1e-7).all()  # half a step per row
    assert isinstance(serve(codes, "int4", torch.bfloat16), Int8Weight)  # a Q4_K_M file's Q6_K stays int8


def write_q4_k_m(path, rng=None) -> None:
    """A tiny tied Llama GGUF laid out as llama.cpp's Q4_K_M: Q4_K linears, Q6_K attn_v and ffn_down, a Q6_K
    embedding (the head), F32 norms."""
    rng = rng or np.random.default_rng(2)
    w = GGUFWriter(str(path), "llama")
    for key, val in [("block_count", LAYERS), ("context_length", 256), ("embedding_length", H),
                     ("feed_forward_length", FF), ("attention.head_count", HEADS),
                     ("attention.head_count_kv", KV), ("vocab_size", VOCAB)]:
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)

    def add(name, rows, k, qtype):
        w.add_tensor(name, blocks(rows, k, qtype, rng), raw_dtype=qtype)

    add("token_embd.weight", VOCAB, H, Q.Q6_K)
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    for i in range(LAYERS):
        add(f"blk.{i}.attn_q.weight", HEADS * D, H, Q.Q4_K)
        add(f"blk.{i}.attn_k.weight", KV * D, H, Q.Q4_K)
        add(f"blk.{i}.attn_v.weight", KV * D, H, Q.Q6_K)
        add(f"blk.{i}.attn_output.weight", H, HEADS * D, Q.Q4_K)
        add(f"blk.{i}.ffn_gate.weight", FF, H, Q.Q4_K)
        add(f"blk.{i}.ffn_up.weight", FF, H, Q.Q4_K)
        add(f"blk.{i}.ffn_down.weight", H, FF, Q.Q6_K if i == 0 else Q.Q4_K)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(H, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def q4_k_m(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("ITERSERVE_WEIGHT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "load_tokenizer", lambda path: None)
    path = tmp_path / "tiny.Q4_K_M.gguf"
    write_q4_k_m(path)
    return str(path)


def runner(path: str, **kwargs) -> ModelRunner:
    return ModelRunner(EngineConfig(**{"model": path, "num_kv_blocks": 4, "block_size": 16, "num_threads": 1, **kwargs}))


def test_auto_serves_a_q4_k_m_file_in_int4_from_its_codes(q4_k_m):
    native = runner(q4_k_m)  # --quantization auto, --dtype auto
    model = native.model
    assert native.quantization == "int4"
    assert isinstance(model.layers[0].o, Int4Weight) and isinstance(model.layers[1].down, Int4Weight)
    assert isinstance(model.layers[0].qkv, Int8Weight)  # q, k Q4_K beside a Q6_K v: fused per-row int8
    assert isinstance(model.layers[0].down, Int8Weight) and isinstance(model.lm_head, Int8Weight)
    assert isinstance(model.embed, Int8Codes)  # int8 rows, no vocab x hidden floats
    if not model.lm_head.panels:  # torch's layout: the tied head's rows are the lookups' table
        assert model.embed.q.data_ptr() == model.lm_head.qweight.data_ptr()
    floats = runner(q4_k_m, quantization="none")
    assert floats.quantization is None and isinstance(floats.model.layers[0].o, type(floats.model.layers[0].o))
    got, want = prompt_logits(native).float(), prompt_logits(floats).float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]


def greedy_tokens(runner: ModelRunner) -> list[list[int]]:
    """12 greedy tokens for each of three prompts, batched: prompt steps, then decode steps (the C loop where
    it runs)."""
    engine = Engine(runner.config, runner)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out.token_ids) for out in engine.step() if out.finished)
    return [done[i] for i in ids]


@pytest.mark.skipif(not cpu_paths.current().weight_only_bf16, reason="cpu_paths: no weight-only panels unpacked to bf16")
def test_bf16_panels_serve_a_q4_k_m_file_as_torchs_kernels_did(q4_k_m, monkeypatch):
    """With AVX-512 BF16 the file's int4 and int8 codes run on the kernel's panels, decode steps in the C loop;
    torch's int4/int8 kernels over the same codes (the path before them) give the same greedy tokens, up to
    near-ties, and logits within the check against floats above."""
    panels = runner(q4_k_m, num_kv_blocks=16)
    model = panels.model
    assert model.layers[0].o.scales_zeros is None and model.layers[0].qkv.panels and model.lm_head.panels
    assert model.decode_layers is not None
    monkeypatch.setattr(cpu_kernels, "linear_weight_only_bf16_supported", lambda flags=(): False)
    torchs = runner(q4_k_m, num_kv_blocks=16)
    assert torchs.model.layers[0].o.scales_zeros is not None and torchs.model.decode_layers is None
    got, want = prompt_logits(panels).float(), prompt_logits(torchs).float()
    tolerance = 0.05 * want.abs().max()
    assert (got - want).abs().max() <= tolerance
    for prompt, tokens in zip(PROMPTS, greedy_tokens(panels)):  # torch's greedy choice at each step, up to a near-tie
        for t in range(len(tokens)):
            logits = last_logits(torchs, prompt + tokens[:t])
            assert logits[tokens[t]] >= logits.max() - tolerance


def last_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """The logits after `tokens`, a fresh prompt (at most two blocks)."""
    plan = SchedulerOutput(block_size=16, scheduled=[
        ScheduledRequest("r", tokens, 0, [0, 1], True, SamplingParams(temperature=0.0))])
    with torch.inference_mode():
        return runner.model.forward(*runner._prepare(plan, None))[0].float()


def test_auto_picks_the_files_format_and_floats_when_asked(q4_k_m, tmp_path):
    q8 = tmp_path / "tiny.Q8_0.gguf"
    f32 = tmp_path / "tiny.F32.gguf"
    write_tiny_gguf(q8, Q.Q8_0)
    write_tiny_gguf(f32, Q.F32)
    resolve = weight_cache.resolve_quantization
    assert resolve(q4_k_m, "auto", "auto") == "int4"
    assert resolve(str(q8), "auto", "auto") == "int8"
    assert resolve(str(f32), "auto", "auto") is None
    assert resolve(q4_k_m, "auto", "bfloat16") is None  # a float --dtype asks for floats
    assert resolve(q4_k_m, "none", "auto") is None and resolve(str(f32), "int8", "auto") == "int8"
    default = tmp_path / loader.DEFAULT_GGUF
    write_tiny_gguf(default, Q.Q4_1)
    assert resolve(str(default), "auto", "auto") is None  # the shipped default model stays bf16


def test_served_bytes_are_what_the_model_holds(q4_k_m):
    model = runner(q4_k_m).model
    held = sum(w.nbytes for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    held += model.lm_head.nbytes
    planned = weight_cache.served_bytes(q4_k_m, "int4", model.weight_dtype)
    norms = (2 * LAYERS + 1) * H * model.weight_dtype.itemsize
    assert planned == pytest.approx(held + norms, rel=0.02)  # tied: the embedding's rows are the head's


def test_a_model_that_cannot_fit_is_refused_before_loading(q4_k_m, monkeypatch):
    monkeypatch.setattr(weight_cache, "available_memory", lambda: 1000)
    monkeypatch.setattr(loader.GGUFCodes, "__getitem__", lambda *a: pytest.fail("read a tensor"))
    with pytest.raises(ValueError, match=r"cannot fit: it needs .* GiB .* int4 weights .* KV cache\) but 0.0 GiB is "
                                         r"available \(MemAvailable\)"):
        runner(q4_k_m)
    with pytest.raises(ValueError, match=r"weights in float32 as they load"):  # a cold float start's need
        runner(q4_k_m, quantization="none")


def test_the_cache_holds_the_served_codes_and_a_warm_start_reads_no_gguf(q4_k_m, monkeypatch):
    cold = runner(q4_k_m)
    (entry,) = entries(cache_entry.cache_root())
    assert not (entry / "model.safetensors").exists()  # no float32 model on disk
    assert (entry / "native.safetensors").is_file() and list(entry.glob("panels-*int4*.safetensors"))

    def no_gguf(*args, **kwargs):
        raise AssertionError("a warm start read the GGUF")
    monkeypatch.setattr(loader, "load_model_arch", no_gguf)
    monkeypatch.setattr(loader, "GGUFCodes", no_gguf)
    monkeypatch.setattr(loader, "gguf_tensor_table", no_gguf)
    warm = runner(q4_k_m)
    assert type(warm.model.layers[1].down) is type(cold.model.layers[1].down)
    assert torch.equal(prompt_logits(warm), prompt_logits(cold))
