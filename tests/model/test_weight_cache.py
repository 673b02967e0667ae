"""The start-up cache of GGUF models (model/weight_cache.py): a hit serves what a fresh load serves,
bit for bit; a changed file, a corrupt entry and a disabled cache all end in the right weights."""
from __future__ import annotations

import gc
import logging
import os
import weakref

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.model import cpu_kernels, cpu_packing, cpu_paths, loader, weight_cache
from iterserve.model.panel_cache import _map_panels
from iterserve.model.quant import Int4Weight, Int8Weight, panel_layout, panel_tensor
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput
from tests.model.test_cpu_linear import needs_int8
from tests.model.test_loader import write_tiny_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("ITERSERVE_WEIGHT_CACHE", str(root))
    return root


@pytest.fixture
def gguf(tmp_path) -> str:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Q.Q4_1)
    return str(path)


def fresh(path: str):
    arch = loader.load_model_arch(path)
    return arch, loader.load_weights(path, arch)


def logits(arch, weights) -> torch.Tensor:
    """The prompt's logits through the packed model, as the runner computes them."""
    return prompt_logits(ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=4, block_size=16, num_threads=1),
                                     arch, weights))


def prompt_logits(runner: ModelRunner) -> torch.Tensor:
    plan = SchedulerOutput(block_size=16, scheduled=[
        ScheduledRequest("r", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 0, [0], True, SamplingParams(temperature=0.0))])
    with torch.inference_mode():
        return runner.model.forward(*runner._prepare(plan, None))


def entries(root) -> list:
    return sorted(p for p in root.iterdir() if p.is_dir())


def assert_same_weights(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name


def test_a_hit_gives_the_logits_of_a_fresh_pack(gguf, cache, monkeypatch):
    arch, weights = fresh(gguf)
    want = logits(arch, weights)
    cold_arch, cold = weight_cache.load_arch_and_weights(gguf)
    assert (cache / entries(cache)[0].name / "model.safetensors").is_file()

    def no_gguf(*args, **kwargs):
        raise AssertionError("a warm start read the GGUF")
    monkeypatch.setattr(loader, "load_model_arch", no_gguf)
    monkeypatch.setattr(loader, "load_weights", no_gguf)
    warm_arch, warm = weight_cache.load_arch_and_weights(gguf)
    assert cold_arch == warm_arch == arch
    assert_same_weights(warm, weight_cache.fuse(weights))  # q/k/v and gate/up stored as the model runs them
    assert torch.equal(logits(cold_arch, cold), want) and torch.equal(logits(warm_arch, warm), want)


def open_files() -> str:
    fds = "/proc/self/fd"
    names = []
    for fd in os.listdir(fds):
        try:
            names.append(os.readlink(os.path.join(fds, fd)))
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        return "\n".join(names) + f.read()


def test_a_packed_weight_is_read_when_asked_and_not_held(gguf, cache):
    """So a weight's float copy lives only until its layer is packed: the load's peak stays near the packed size."""
    weight_cache.load_arch_and_weights(gguf)
    _, weights = weight_cache.load_arch_and_weights(gguf)
    proj = weights["model.layers.0.self_attn.qkv_proj.weight"]
    held = weakref.ref(proj)
    del proj
    gc.collect()
    assert held() is None
    assert weights["model.embed_tokens.weight"] is weights["model.embed_tokens.weight"]  # kept by the model: read once


def test_no_file_outlives_the_model_build(gguf, cache):
    weight_cache.load_arch_and_weights(gguf)
    arch, weights = weight_cache.load_arch_and_weights(gguf)
    file = str(entries(cache)[0] / "model.safetensors")
    runner = ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=4, block_size=16, num_threads=1), arch, weights)
    del weights
    gc.collect()
    assert file not in open_files()
    assert runner.model.lm_head.shape == (arch.vocab_size, arch.hidden_size)


def test_a_changed_file_is_rebuilt_and_the_old_entry_dropped(gguf, cache):
    weight_cache.load_arch_and_weights(gguf)
    (old,) = entries(cache)
    write_tiny_gguf(gguf, Q.Q8_0)
    _, weights = weight_cache.load_arch_and_weights(gguf)
    assert_same_weights(weights, weight_cache.fuse(fresh(gguf)[1]))
    (new,) = entries(cache)
    assert new != old


def test_a_corrupt_entry_is_rebuilt_with_a_warning(gguf, cache, caplog):
    weight_cache.load_arch_and_weights(gguf)
    file = entries(cache)[0] / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="iterserve.model"):
        _, weights = weight_cache.load_arch_and_weights(gguf)
    assert "unreadable" in caplog.text
    assert_same_weights(weights, weight_cache.fuse(fresh(gguf)[1]))
    assert weight_cache._read_weights(file, file.parent.name) is not None  # whole again


def test_an_entry_of_another_key_is_not_trusted(gguf, cache, caplog):
    weight_cache.load_arch_and_weights(gguf)
    (entry,) = entries(cache)
    with caplog.at_level(logging.WARNING, logger="iterserve.model"):
        assert weight_cache._read_weights(entry / "model.safetensors", "0" * 16) is None
    assert "unreadable" in caplog.text


def test_the_cache_can_be_turned_off(gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("ITERSERVE_WEIGHT_CACHE", "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _, weights = weight_cache.load_arch_and_weights(gguf)
    assert_same_weights(weights, fresh(gguf)[1])
    assert not (tmp_path / "xdg" / "iterserve" / "weights").exists()


def test_the_cache_lives_beside_the_kernels_by_default(gguf, tmp_path, monkeypatch):
    monkeypatch.delenv("ITERSERVE_WEIGHT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    weight_cache.load_arch_and_weights(gguf)
    assert len(entries(tmp_path / "xdg" / "iterserve" / "weights")) == 1


needs_panels = pytest.mark.skipif(cpu_kernels.linear_kernel() is None, reason="the panel kernel needs AVX-512")


def runner_of(path: str, **kwargs) -> ModelRunner:
    return ModelRunner(EngineConfig(model=path, num_kv_blocks=4, block_size=16, num_threads=1, **kwargs))


def panels_of(runner: ModelRunner) -> list[torch.Tensor]:
    model = runner.model
    weights = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return [t for t, _ in filter(None, map(panel_tensor, [*weights, model.lm_head]))]


@needs_panels
@pytest.mark.parametrize("dtype", ["float32", "bf16-storage", "bfloat16"])
@pytest.mark.slow
def test_a_warm_start_maps_the_panels_a_cold_start_packed(gguf, cache, monkeypatch, dtype):
    """bfloat16 arithmetic takes panels where the CPU lacks native bf16 (plain) or has AVX-512 BF16 (pairs)."""
    layout = {"float32": "plain", "bf16-storage": "plain", "bfloat16": panel_layout(torch.bfloat16)}[dtype]
    if layout is None:
        pytest.skip("bfloat16 weights stay oneDNN's on this CPU")
    monkeypatch.setattr(weight_cache, "load_tokenizer", lambda path: None)  # the tiny GGUF has no vocabulary
    cold = runner_of(gguf, dtype=dtype)
    (file,) = entries(cache)[0].glob("panels-*.safetensors")
    name = "float32" if dtype == "float32" else "bfloat16-pairs" if layout == "pairs" else "bfloat16"
    assert file.name == f"panels-{name}.safetensors"
    read = []
    real = weight_cache.LazyWeights.__getitem__
    monkeypatch.setattr(weight_cache.LazyWeights, "__getitem__", lambda self, name: read.append(name) or real(self, name))
    warm = runner_of(gguf, dtype=dtype)
    # neither the packed floats nor the tied embedding are read: lookups gather from the head's panels
    assert read and not [n for n in read if n.endswith(("_proj.weight", "lm_head.weight", "embed_tokens.weight"))]
    assert warm.model.embed is None
    assert str(file) in open_files()  # mapped, not copied
    cold_panels, warm_panels = panels_of(cold), panels_of(warm)
    assert len(cold_panels) == len(warm_panels) == 2 * 4 + 1
    assert all(torch.equal(a, b) for a, b in zip(cold_panels, warm_panels))
    assert torch.equal(prompt_logits(cold), prompt_logits(warm))


@needs_panels
def test_a_corrupt_or_foreign_panel_file_is_packed_again(gguf, cache, monkeypatch, caplog):
    monkeypatch.setattr(weight_cache, "load_tokenizer", lambda path: None)
    want = prompt_logits(runner_of(gguf, dtype="float32"))
    (file,) = entries(cache)[0].glob("panels-*.safetensors")
    good = file.read_bytes()
    foreign = good.replace(b'"key":"tiny', b'"key":"tinz')  # same length: only the key is wrong
    assert foreign != good
    for bad in (good[: len(good) // 2], foreign):
        file.write_bytes(bad)
        with caplog.at_level(logging.WARNING, logger="iterserve.model"):
            got = prompt_logits(runner_of(gguf, dtype="float32"))
        assert "unreadable" in caplog.text and torch.equal(got, want)
        key = f"{file.parent.name}-float32-{cpu_packing.PANEL}"
        assert len(_map_panels(file, key)) == 2 * 4 + 1  # written again whole
        caplog.clear()


@needs_int8
def test_a_warm_w8a8_start_maps_the_int8_panels_a_cold_start_quantized(gguf, cache, monkeypatch):
    monkeypatch.setattr(weight_cache, "load_tokenizer", lambda path: None)
    cold = runner_of(gguf, quantization="w8a8")
    (file,) = entries(cache)[0].glob("panels-*.safetensors")
    assert file.name == f"panels-{str(cold.storage_dtype).removeprefix('torch.')}-w8a8.safetensors"
    read = []
    real = weight_cache.LazyWeights.__getitem__
    monkeypatch.setattr(weight_cache.LazyWeights, "__getitem__", lambda self, name: read.append(name) or real(self, name))
    warm = runner_of(gguf, quantization="w8a8")
    assert read and not [n for n in read if n.endswith(("_proj.weight", "lm_head.weight"))]
    assert str(file) in open_files()
    cold_panels, warm_panels = panels_of(cold), panels_of(warm)
    assert len(cold_panels) == len(warm_panels) == 2 * 4 + 1
    assert all(p.dtype == torch.int8 and torch.equal(a, p) for a, p in zip(cold_panels, warm_panels))
    assert [w.shape for w in (warm.model.layers[0].down, warm.model.lm_head)] == \
        [w.shape for w in (cold.model.layers[0].down, cold.model.lm_head)]  # in_features as given, not padded
    assert torch.equal(prompt_logits(cold), prompt_logits(warm))


@pytest.mark.skipif(not (cpu_kernels.linear_weight_only_supported() or cpu_paths.current().weight_only_bf16),
                    reason="weight-only int8/int4 run on torch's kernels in this build (AVX-512 without BF16)")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_warm_weight_only_start_maps_the_panels_a_cold_start_quantized(gguf, cache, monkeypatch, mode):
    """Weight-only int8/int4 on the kernel's panels (AVX2, or bf16 pairs): the int4 layers and the int8 LM head are
    mapped from the file, their shapes and the logits as the cold start's."""
    monkeypatch.setattr(weight_cache, "load_tokenizer", lambda path: None)
    cold = runner_of(gguf, quantization=mode)
    (file,) = entries(cache)[0].glob("panels-*.safetensors")
    assert file.name == f"panels-{str(cold.storage_dtype).removeprefix('torch.')}-{mode}.safetensors"
    warm = runner_of(gguf, quantization=mode)
    assert str(file) in open_files()
    layer_kind = Int4Weight if mode == "int4" else Int8Weight
    assert isinstance(warm.model.layers[0].down, layer_kind) and isinstance(warm.model.lm_head, Int8Weight)
    cold_panels, warm_panels = panels_of(cold), panels_of(warm)
    assert len(cold_panels) == len(warm_panels) == 2 * 4 + 1
    assert all(torch.equal(a, b) for a, b in zip(cold_panels, warm_panels))
    assert torch.equal(warm.model.lm_head.scales, cold.model.lm_head.scales)
    assert [w.shape for w in (warm.model.layers[0].down, warm.model.lm_head)] == \
        [w.shape for w in (cold.model.layers[0].down, cold.model.lm_head)]
    assert torch.equal(prompt_logits(cold), prompt_logits(warm))


@needs_panels
def test_torch_layouts_are_cached_and_uncached_models_write_no_panels(gguf, cache, monkeypatch):
    """Weight-only int8 on torch's kernels (as on AVX-512) is cached in torch's layout (codes and scales), from
    the GGUF's codes: the entry holds no float32 model."""
    monkeypatch.setattr(weight_cache, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(cpu_kernels, "linear_weight_only_supported", lambda flags=(): False)
    runner_of(gguf, dtype="float32", quantization="int8")
    assert [p.name for p in entries(cache)[0].glob("panels-*")] == ["panels-float32-int8-rows.safetensors"]
    assert not (entries(cache)[0] / "model.safetensors").exists()
    monkeypatch.setenv("ITERSERVE_WEIGHT_CACHE", "0")
    assert weight_cache.panel_cache(gguf, torch.float32, torch.device("cpu")) is None


def test_the_cached_tokenizer_is_the_ggufs(default_model_path, tokenizer, cache, monkeypatch):
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: tokenizer)  # converted once, by the fixture
    texts = ["Hello, world!", "  spaces\tand\nnewlines  ", "<|im_start|>user\nhé 漢字 🙂<|im_end|>"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for _ in range(2):  # written, then read back
        tok = weight_cache.load_tokenizer(default_model_path)
        assert [tok.encode(t) for t in texts] == [tokenizer.encode(t) for t in texts]
        assert tok.decode(tok.encode(texts[2])) == tokenizer.decode(tokenizer.encode(texts[2]))
        assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert (tok.eos_token_id, tok.bos_token_id, len(tok)) == \
            (tokenizer.eos_token_id, tokenizer.bos_token_id, len(tokenizer))
    assert (entries(cache)[0] / "tokenizer").is_dir()
