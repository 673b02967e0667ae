"""The dtype policy: which device a runner uses, the dtype its arithmetic runs in, the one its weights and
KV cache are stored in, and the KV pool's (int8 where attention can read it)."""
from __future__ import annotations

import torch

from iterserve.model import cpu_paths
from iterserve.model.cpu_kernels import linear_kernel
from iterserve.model.quant import weight_only_on_panels

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch sees no CUDA device")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The arithmetic's dtype (activations, logits)."""
    if name == "bf16-storage":
        return torch.float32
    if name != "auto":
        return _DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" or cpu_paths.current().bf16_arithmetic else torch.float32


def storage_dtype(name: str, device: torch.device, quantization: str | None = None) -> torch.dtype:
    """The dtype the weights and the KV cache are kept in: the arithmetic's, except under bf16-storage
    (asked for, or `auto` on a CPU without bf16 instructions), where bfloat16 halves the bytes every step
    streams while the panel kernel widens them in registers for float32 arithmetic. Weight-only int8/int4
    on the kernel's own panels (AVX2) run under it too: their codes come from the bfloat16 weights, and the
    KV cache and the other weights stay bfloat16."""
    compute = pick_dtype(name, device)
    quantization = None if quantization in ("auto", "none") else quantization  # unresolved (the simulator): floats'
    panels = quantization is None or weight_only_on_panels(quantization)
    if name == "bf16-storage":
        if device.type != "cpu" or linear_kernel() is None:
            raise ValueError("--dtype bf16-storage needs the CPU linear kernel (cpu_linear.cpp: AVX-512, or AVX2 with FMA); "
                             "use --dtype float32 or bfloat16 here")
        if not panels:
            raise ValueError(f"--dtype bf16-storage runs --quantization {quantization} on this CPU's build only "
                             "through PyTorch's kernels, which take the arithmetic's dtype: use --dtype float32")
        return torch.bfloat16
    if name == "auto" and compute == torch.float32 and device.type == "cpu" and panels and linear_kernel() is not None:
        return torch.bfloat16
    return compute


def kv_dtype_name(kv_cache_dtype: str, dtype: torch.dtype, attention: str) -> str:
    """The KV pool's dtype (executor.base.DTYPE_BYTES): the model's, or int8 where attention can read it."""
    if kv_cache_dtype == "auto":
        return str(dtype).removeprefix("torch.")
    if attention != "torch":
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is read by the torch/CPU attention path only, not by "
                         f"the {attention} kernels: use --kv-cache-dtype auto here (or ITERSERVE_ATTENTION=torch)")
    return kv_cache_dtype
