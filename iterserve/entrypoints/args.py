"""Engine flags shared by every command (`serve`, `generate`, `bench`, `simulate`)."""
from __future__ import annotations

import argparse

from iterserve.config import EngineConfig, parse_bytes


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--quantization", default=None, choices=["int8", "int4"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="bytes of KV cache, e.g. 2GiB (default: 1GiB on CPU; free memory on CUDA)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--scheduling", default="continuous", choices=["continuous", "static"])
    g.add_argument("--no-static-padding", dest="static_padding", action="store_false")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--priority-preemption", action="store_true")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"])
    g.add_argument("--swap-space", type=parse_bytes, default=1 << 30)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--watermark", type=float, default=0.01)
    g.add_argument("--max-waiting-requests", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--no-cuda-graphs", dest="use_cuda_graphs", action="store_false")


def config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    values = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    values.update(overrides)
    return EngineConfig(**values)
