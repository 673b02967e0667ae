"""Multi-LoRA throughput: the same requests on the base model alone, then spread over N adapters in one batch.

    python benchmarks/lora.py [--model PATH] [--requests 32] [--adapters 4] [--rank 8] [--prompt-len 128]
                              [--max-tokens 64] [--dtype auto] [--num-threads N]

Random rank-r adapters on all seven projections are written as PEFT directories and loaded into the
runner's slots. Both runs are greedy with ignore_eos, so they generate the same number of tokens; the
adapters' run pays for the LoRA deltas (model/lora.py: an op pair per linear in the Python loop, per-row
loops inside the C decode loop) and leaves CUDA graphs. Prints output tok/s of each and their ratio,
with the command that produced them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.executor.model_runner import ModelRunner
from iterserve.sampling_params import SamplingParams

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path: str, arch, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of this architecture (every layer, all seven projections)."""
    g = torch.Generator().manual_seed(seed)
    q, kv, h, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size, \
        arch.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[key + ".lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
            tensors[key + ".lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes)}, f)


def run(engine: Engine, prompts: list[list[int]], names: list[str | None], max_tokens: int) -> tuple[int, float]:
    """(output tokens, seconds) for all requests run to completion together."""
    start = time.perf_counter()
    for p, name in zip(prompts, names):
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, lora_name=name))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.token_ids) for o in engine.step() if o.finished)
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None, help="default: all cores")
    args = ap.parse_args()
    config = EngineConfig(model=args.model, dtype=args.dtype, max_loras=args.adapters, max_lora_rank=args.rank,
                          max_num_seqs=args.requests, enable_prefix_caching=False,
                          num_threads=args.num_threads)
    runner = ModelRunner(config)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, runner.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.requests)]
    names = [f"lora{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            write_adapter(os.path.join(tmp, name), runner.arch, args.rank, seed=i)
            runner.load_lora(name, os.path.join(tmp, name))
    engine = Engine(config, executor=runner)
    run(engine, prompts[:2], [None, names[0]], 2)  # warm-up: kernel builds, first allocations
    base_tokens, base_s = run(engine, prompts, [None] * args.requests, args.max_tokens)
    mixed = [names[i % len(names)] for i in range(args.requests)]
    lora_tokens, lora_s = run(engine, prompts, mixed, args.max_tokens)
    print("$ python " + " ".join(sys.argv))
    for label, tokens, seconds in (("base alone", base_tokens, base_s),
                                   (f"{args.adapters} adapters mixed", lora_tokens, lora_s)):
        print(f"{label:<20} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
    print(f"ratio (adapters / base): {(lora_tokens / lora_s) / (base_tokens / base_s):.2f}")


if __name__ == "__main__":
    main()
