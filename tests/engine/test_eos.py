"""Several EOS ids (Llama 3 lists three): generation stops on any of them, read from the checkpoint."""
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.executor.model_runner import ModelRunner
from iterserve.model.loader import load_model_arch, load_weights
from iterserve.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 99, 3, 64, 7, 11]


def _engine(path) -> Engine:
    arch = load_model_arch(str(path))
    config = EngineConfig(dtype="float32", num_kv_blocks=32, block_size=4)
    runner = ModelRunner(config, arch, load_weights(str(path), arch, torch.float32, torch.device("cpu")))
    return Engine(config, executor=runner)


def _generate(engine: Engine, ignore_eos: bool):
    engine.add_request(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=ignore_eos))
    while engine.has_unfinished():
        final = [o for o in engine.step() if o.finished]
    return final[0]


def test_a_checkpoint_with_two_eos_ids_stops_on_the_second(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path)
    free = _generate(_engine(tmp_path), ignore_eos=True).token_ids
    k = next((i for i in range(1, len(free)) if free[i] not in free[:i]), 0)  # first seen at step k
    first = next(t for t in range(128) if t not in free)  # an EOS id this prompt never produces
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = [first, free[k]]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").unlink(missing_ok=True)  # it repeats the default EOS id
    engine = _engine(tmp_path)
    assert engine.eos_token_ids == frozenset({first, free[k]})
    out = _generate(engine, ignore_eos=False)
    assert out.token_ids == free[:k + 1] and out.finish_reason == "stop"
