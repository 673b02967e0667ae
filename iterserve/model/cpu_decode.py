"""A decode step's decoder layers in one C call (cpu_decode.cpp), on CPU.

LlamaModel._layer_forward runs a layer as ~10 calls into the C kernels (norms, linears, rotary, the
K/V write, decode attention, silu-and-mul); at one sequence each call's Python and ctypes cost
(measured: ~5 us a linear call, ~2.6 of them in ctypes itself) adds up to a fifth of the step.
cpu_decode.cpp makes the same calls, in the same order and with the same arguments, from one loop
in C: the results are bit for bit the Python loop's (tests/model/test_cpu_decode.py).

It takes the layers the Python loop runs with the C kernels and nothing else: pre-norm, SiLU, no
q/k norms, no output norms, no experts, every linear in the C kernel's panels under the arithmetic's
dtype (each its own kind: a Q4_K_M file's int4 beside its int8 tensors), the K/V cache in the
arithmetic's dtype, in bfloat16 under float32 arithmetic (bf16 storage) or in int8, a decode-only
step through the paged decode kernel, no tensor parallelism. DecodeLayers.build says None for anything
else, and the model keeps its Python loop. A step with LoRA adapters runs here too: after each linear
cpu_decode.cpp adds each row's own adapter's delta from the slots' stacks (model/lora.py), so decodes
under adapters keep the one call.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from iterserve.model import cpu_build, cpu_kernels
from iterserve.model.attention import in_pairs
from iterserve.model.cpu_build import FLAGS, _build, _f32, _i32, _i64, _p
from iterserve.model.cpu_kernels import DTYPES
from iterserve.model.quant import kernel_panels

SOURCE = cpu_build.DECODE_SOURCE
LORA_LINEARS = ("qkv", "o", "gate_up", "down")  # cpu_decode.cpp's LoraLinear order
MAX_LORA_COLUMNS = 1024  # cpu_lora.h's kMaxLoraColumns: a fused linear's parts * max_rank
# What cpu_decode.cpp can time, per layer and in its Part order: both norms are "norm".
PARTS = ("norm", "qkv", "rope", "write_kv", "attention", "o", "gate_up", "silu_mul", "down")


class _Layer(ctypes.Structure):
    _fields_ = ([(name, _p) for name in ("attn_norm", "qkv", "qkv_bias", "o", "mlp_norm", "gate_up", "down", "cos",
                                         "sin")]
                + [(name, _i32) for name in ("window", "qkv_dtype", "o_dtype", "gate_up_dtype", "down_dtype")])


class _Step(ctypes.Structure):
    _fields_ = ([(name, _p) for name in ("rms_norm", "linear", "rope", "write_kv", "write_kv_int8", "write_kv_pairs",
                                         "write_kv_bf16", "attention", "silu_mul")]
                + [(name, _i32) for name in ("dtype", "attention_dtype", "num_threads", "heads",
                                             "kv_heads", "head_dim", "block_size")]
                + [(name, _i64) for name in ("rows", "hidden", "intermediate")]
                + [(name, _f32) for name in ("eps", "scale", "softcap")]
                + [("kv_cache", _p), ("layer_bytes", _i64), ("v_offset", _i64), ("positions", _p),
                   ("slot_mapping", _p), ("block_tables", _p), ("table_stride", _i64), ("seq_lens", _p)]
                + [(name, _p) for name in ("x", "delta", "h", "qkv", "attn", "gate_up", "act", "part_seconds")]
                + [(name, _p) for name in ("lora_a", "lora_b", "lora_slots")] + [("lora_rank", _i32)])


@functools.cache
def _kernel():
    fn = getattr(_build(SOURCE, FLAGS), "iterserve_decode_layers", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.POINTER(_Step), ctypes.POINTER(_Layer), _i32], _i32
    return fn


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class DecodeLayers:
    """The model's layers as cpu_decode.cpp runs them: their weights' addresses, taken once."""

    def __init__(self, model, kernel) -> None:
        cfg, layers = model.cfg, model.layers
        self.model, self.kernel, self.dtype = model, kernel, model.dtype

        def panels(w) -> int:
            return kernel_panels(w, model.dtype)[0].data_ptr()

        def code(w) -> int:
            return kernel_panels(w, model.dtype)[1]

        self.layers = (_Layer * len(layers))(*[_Layer(
            l.attn_norm.data_ptr(), panels(l.qkv), cpu_kernels._ptr(l.qkv_bias), panels(l.o),
            l.mlp_norm.data_ptr(), panels(l.gate_up), panels(l.down),
            model.rope_tables[l.rope][0].data_ptr(), model.rope_tables[l.rope][1].data_ptr(), l.window,
            code(l.qkv), code(l.o), code(l.gate_up), code(l.down))
            for l in layers])
        self.intermediate = layers[0].gate_up.shape[0] // 2
        self.part_seconds = None  # see time_parts
        self._lora = None  # (the LoRASlots, A's and B's addresses per layer and linear), taken on first use
        ops = cpu_kernels.elementwise_ops()
        self.fns = {"rms_norm": _address(ops.rms_norm), "linear": _address(cpu_kernels.linear_kernel()),
                    "rope": _address(ops.rope), "silu_mul": _address(ops.silu_mul), "write_kv": _address(ops.write_kv),
                    "write_kv_int8": _address(ops.write_kv_int8), "write_kv_pairs": _address(ops.write_kv_pairs),
                    "write_kv_bf16": _address(ops.write_kv_bf16),
                    "attention": _address(cpu_kernels.decode_attention_kernel()),
                    "attention_int8": _address(cpu_kernels.decode_attention_int8_kernel())}

    @staticmethod
    def build(model) -> DecodeLayers | None:
        """DecodeLayers for the model, or None where cpu_decode.cpp cannot run its layers (see the top)."""
        cfg, layers = model.cfg, model.layers
        if not model.cpu_ops or not model.silu or model.tp is not None or model.attention.name != "torch":
            return None
        if cfg.norm_placement != "pre" or cfg.qk_norm != "none":
            return None
        if any(l.experts is not None or l.attn_norm is None or l.mlp_norm is None for l in layers):
            return None
        if any(kernel_panels(w, model.dtype) is None for l in layers for w in (l.qkv, l.o, l.gate_up, l.down)):
            return None
        kernel = _kernel()
        if kernel is None or cpu_kernels.decode_attention_kernel() is None or \
                cpu_kernels.decode_attention_int8_kernel() is None:
            return None
        return DecodeLayers(model, kernel)

    def time_parts(self, on: bool = True) -> None:
        """Sum, from now on, the seconds each of PARTS takes over all layers (part_seconds, from zero), or
        stop timing. A benchmark's tool (step_time.py --parts): two clock reads a call."""
        self.part_seconds = (ctypes.c_double * len(PARTS))() if on else None

    def parts(self) -> dict[str, float]:
        """Seconds per part summed since time_parts()."""
        return dict(zip(PARTS, self.part_seconds or [0.0] * len(PARTS)))

    def runs(self, plan, kv_cache: torch.Tensor, lora=None) -> bool:
        """Whether this step is one it runs: decode rows only, through the paged kernel, a cache it reads,
        LoRA adapters (a lora.LoRABatch) of ranks it holds."""
        return plan.decode_all and plan.decode_tables is not None and kv_cache.is_contiguous() and \
            kv_cache.dtype in (self.dtype, torch.int8, torch.bfloat16) and \
            (lora is None or 3 * lora.slots.max_rank <= MAX_LORA_COLUMNS)

    def _lora_args(self, lora) -> tuple:
        """_Step's LoRA fields for the step's adapters: the stacks' addresses (the slots' tensors are
        allocated once and loaded in place, so taken once), each row's slot and the slots' rank."""
        if lora is None:
            return None, None, None, 0
        slots = lora.slots
        if self._lora is None or self._lora[0] is not slots:
            n = 4 * len(slots.a)
            a = (_p * n)(*[layer[f].data_ptr() for layer in slots.a for f in LORA_LINEARS])
            b = (_p * n)(*[layer[f].data_ptr() for layer in slots.b for f in LORA_LINEARS])
            self._lora = slots, a, b
        _, a, b = self._lora
        return ctypes.addressof(a), ctypes.addressof(b), lora.row_slots.ctypes.data, slots.max_rank

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 plan, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, hidden] (the embedded tokens, updated in place) -> (x, delta) as the Python loop leaves them.
        lora: the step's adapters by rows (lora.LoRABatch), or None."""
        assert lora is None or lora.row_slots.dtype == np.int32 and lora.row_slots.shape == (x.shape[0],)
        m, cfg = x.shape[0], self.model.cfg
        q_size, kv_size = self.model.q_size, self.model.kv_size
        empty = lambda n: torch.empty(m, n, dtype=self.dtype)  # noqa: E731
        delta, h, qkv, attn = empty(cfg.hidden_size), empty(cfg.hidden_size), empty(q_size + 2 * kv_size), empty(q_size)
        gate_up, act = empty(2 * self.intermediate), empty(self.intermediate)
        int8, pairs = kv_cache.dtype == torch.int8, in_pairs(plan.pairs, kv_cache)
        mixed = kv_cache.dtype != self.dtype and not int8  # bf16 storage: float32 rows, a bfloat16 cache
        f, size = self.fns, kv_cache.element_size()
        tables = plan.decode_tables
        write = "write_kv_int8" if int8 else "write_kv_pairs" if pairs else "write_kv_bf16" if mixed else "write_kv"
        step = _Step(f["rms_norm"], f["linear"], f["rope"],
                     *(f[name] if name == write else None
                       for name in ("write_kv", "write_kv_int8", "write_kv_pairs", "write_kv_bf16")),
                     f["attention_int8" if int8 else "attention"], f["silu_mul"], DTYPES[self.dtype],
                     cpu_kernels.attention_code(self.dtype, kv_cache.dtype, pairs), plan.num_threads,
                     cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, plan.block_size, m, cfg.hidden_size,
                     self.intermediate, cfg.rms_norm_eps,
                     self.model.scale, cfg.attn_logit_softcap, kv_cache.data_ptr(), kv_cache.stride(0) * size,
                     kv_cache.stride(1) * size, positions.data_ptr(), plan.slot_mapping.data_ptr(), tables.data_ptr(),
                     tables.stride(0), plan.decode_seq_lens.data_ptr(), x.data_ptr(), delta.data_ptr(), h.data_ptr(),
                     qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), act.data_ptr(),
                     None if self.part_seconds is None else ctypes.addressof(self.part_seconds),
                     *self._lora_args(lora))
        rc = self.kernel(ctypes.byref(step), self.layers, len(self.layers))
        if rc != 0:
            raise ValueError(f"decode layers: a kernel declined (code {rc})")
        return x, delta
