"""What the simulator knows about one accelerator: bandwidths, peak FLOP/s, efficiencies, overheads.

Datasheet numbers are raw peaks; the efficiency factors say what fraction a real serving engine
reaches (a decode step streams weights at ~80% of HBM peak, large GEMMs hit ~60-70% of tensor-core
peak). The GPU presets' factors were set against published lmdeploy/vLLM step times (see
tests/sim/test_cost_model.py); `cpu-local` is measured by `iterserve calibrate`.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

GB = 1e9
GiB = 1 << 30


LATER_FIELDS = ("mixed_step_overhead_s", "mixed_seq_overhead_s", "kv_send_bandwidth", "kv_receive_bandwidth")


@dataclass(slots=True, frozen=True)
class HardwareSpec:
    name: str
    memory_bytes: int  # device memory of one accelerator
    mem_bandwidth: float  # bytes/s, datasheet peak
    peak_flops: float  # FLOP/s dense, at the model's dtype (bf16/fp16 on GPUs)
    mem_efficiency: float = 0.8  # reached fraction of mem_bandwidth for weight/KV streaming
    flops_efficiency: float = 0.65  # reached fraction of peak_flops for the linear layers
    attn_efficiency: float = 0.5  # reached fraction of peak for attention FLOPs (prefill)
    attn_mem_efficiency: float | None = None  # KV reads in decode attention; None: mem_efficiency
    fused_attention: bool = True  # decode rows and prompt chunks in one attention kernel (GPU varlen)
    step_overhead_s: float = 0.0004  # per step: scheduling, input prep, sampling, launch
    layer_overhead_s: float = 0.00002  # per layer per step: kernel launches, norms, rope
    seq_overhead_s: float = 0.0  # per scheduled request per step: host-side bookkeeping
    # A step with decode rows and prompt chunks costs more than its two parts priced alone (on the CPU the
    # decode rows are split out of the batch and put back per layer, and the chunks run one by one):
    # fitted by `calibrate` from mixed:B:C+L points, per such step and per decode row in it.
    mixed_step_overhead_s: float = 0.0
    mixed_seq_overhead_s: float = 0.0
    interconnect_bandwidth: float = 300 * GB  # bytes/s one way between GPUs (NVLink)
    allreduce_latency_s: float = 8e-6  # fixed cost of one all-reduce
    host_link_bandwidth: float = 25 * GB  # bytes/s device<->host for swap (PCIe)
    # P/D hand-off, bytes/s of the request's KV blocks, paid by the engine itself (it waits for them): the
    # prefill side's copy out of its pool and onto the transport, the decode side's copy off it into its
    # pool. `calibrate` measures both on the CPU. None: free to the engines, as the GPU presets assume
    # (device-to-device transfers overlapped with the steps; iterserve's own GPU path, through the host,
    # is not measured).
    kv_send_bandwidth: float | None = None
    kv_receive_bandwidth: float | None = None
    reserved_bytes: int = GiB  # runtime context, CUDA graphs, allocator slack
    kind: str = "gpu"  # "cpu": the KV pool is sized from kv_cache_memory, as the CPU engine does

    @property
    def kv_mem_efficiency(self) -> float:
        return self.mem_efficiency if self.attn_mem_efficiency is None else self.attn_mem_efficiency

    def to_json(self) -> dict:
        """Fields added after profiles were first written are left out at their defaults, so a spec
        without them writes the same JSON as before."""
        data = asdict(self)
        for name in LATER_FIELDS:
            if not data[name]:
                del data[name]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "HardwareSpec":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


_A100 = dict(peak_flops=312e12, step_overhead_s=0.0005, layer_overhead_s=0.00002,
             interconnect_bandwidth=300 * GB, host_link_bandwidth=25 * GB)
_H100 = dict(peak_flops=989e12, step_overhead_s=0.0004, layer_overhead_s=0.000015,
             interconnect_bandwidth=450 * GB, host_link_bandwidth=50 * GB)

PRESETS: dict[str, HardwareSpec] = {
    "a100-40gb": HardwareSpec("a100-40gb", memory_bytes=40 * GiB, mem_bandwidth=1555 * GB, **_A100),
    "a100-80gb": HardwareSpec("a100-80gb", memory_bytes=80 * GiB, mem_bandwidth=2039 * GB, **_A100),
    "h100-sxm": HardwareSpec("h100-sxm", memory_bytes=80 * GiB, mem_bandwidth=3350 * GB, **_H100),
    "h200": HardwareSpec("h200", memory_bytes=141 * GB, mem_bandwidth=4800 * GB, **_H100),
}

CPU_PROFILE_ENV = "ITERSERVE_CPU_PROFILE"
SHIPPED_CPU_PROFILE = Path(__file__).parent / "data" / "cpu-local.json"


def default_cpu_profile_path() -> Path:
    """Where `iterserve calibrate` writes the cpu-local profile and `--hardware cpu-local` reads it."""
    if os.environ.get(CPU_PROFILE_ENV):
        return Path(os.environ[CPU_PROFILE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "iterserve" / "cpu-local.json"


def load_profile(path: str | os.PathLike) -> HardwareSpec:
    data = json.loads(Path(path).read_text())
    return HardwareSpec.from_json(data["hardware"] if "hardware" in data else data)


def get_hardware(name: str, profile: str | None = None) -> HardwareSpec:
    """A preset by name, or `cpu-local` from the calibration profile (or any profile path)."""
    if profile:
        return load_profile(profile)
    if name in PRESETS:
        return PRESETS[name]
    if name == "cpu-local":
        path = default_cpu_profile_path()
        if not path.is_file():  # the profile calibrated on the development machine (2 cores, AVX-512)
            path = SHIPPED_CPU_PROFILE
        return load_profile(path)
    raise ValueError(f"unknown hardware {name!r}; presets: {', '.join([*PRESETS, 'cpu-local'])}")


def with_overrides(hw: HardwareSpec, **overrides) -> HardwareSpec:
    return replace(hw, **{k: v for k, v in overrides.items() if v is not None})
