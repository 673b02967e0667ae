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
from iterserve.model import loader, weight_cache
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput
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
    runner = ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=4, block_size=16, num_threads=1), arch, weights)
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
