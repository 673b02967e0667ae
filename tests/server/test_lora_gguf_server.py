"""A GGUF LoRA adapter over HTTP: --lora-modules and POST /v1/load_lora_adapter take a .gguf file, and the
openai client's completions under it equal transformers + PEFT's greedy tokens."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from tests.model.test_lora import hf_greedy, make_adapter
from tests.model.test_lora_gguf import write_gguf_lora
from tests.server.conftest import no_leaks, start_server, wait_for

pytestmark = pytest.mark.slow  # a real model, transformers + PEFT and a server start

PROMPT = [1, 504, 3458, 282, 4649, 314, 253]


def test_gguf_adapters_from_the_command_line_and_the_load_route(tiny_model_dir, tmp_path, tokenizer):
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    cfg = hf.config
    paths, models = {}, {}
    for i, name in enumerate(["g0", "g1"]):
        models[name] = make_adapter(hf, str(tmp_path / name), seed=i + 1, b_std=0.2)
        paths[name] = write_gguf_lora(str(tmp_path / name), str(tmp_path / f"{name}.gguf"), cfg.num_attention_heads,
                                      cfg.num_key_value_heads)
    config = EngineConfig(model=tiny_model_dir, dtype="float32", device="cpu", num_kv_blocks=256, max_loras=2,
                          max_lora_rank=8, lora_modules=[f"g0={paths['g0']}"])
    server = start_server(Engine(config), runtime_lora_updating=True)
    try:
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "g1", "lora_path": paths["g1"]},
                       timeout=60)
        assert r.status_code == 200, r.text
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        for name in ("g0", "g1"):
            out = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == tokenizer.decode(hf_greedy(models[name], PROMPT, 8), skip_special_tokens=True)
        bad = httpx.post(server.url + "/v1/load_lora_adapter",
                         json={"lora_name": "m", "lora_path": str(tmp_path / "g0" / "adapter_model.safetensors")},
                         timeout=60)
        assert bad.status_code == 400, bad.text
        wait_for(lambda: no_leaks(server), 10, "the server did not go idle")
    finally:
        server.stop()
