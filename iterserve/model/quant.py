"""Quantization of the linear layers on CPU: weight-only `--quantization int8|int4`, and `w8a8`.

At batch 1 a decode step reads every weight once and does almost no arithmetic per byte, so it
runs at memory speed: halving the bytes (int8) or quartering them (int4) is what makes llama.cpp
fast there. Activations stay in the compute dtype; PyTorch's own CPU kernels dequantize the
weight on the fly:
  int8: torch.ops.aten._weight_int8pack_mm, one scale per output row (symmetric, [-127, 127]).
  int4: torch.ops.aten._weight_int4pack_mm_for_cpu, groups of 32 along K, a scale and a zero
        per group: w = (q - 8) * scale + zero, q in [0, 15].
On AVX2 without AVX-512, where those kernels are many times slower than bf16 storage, the same codes
go into cpu_linear.cpp's panels instead, summed in integers against 16-bit codes of the activations
(vpmaddwd: twice a float32 FMA's multiply-adds, so int8 is faster than bf16 storage at a large batch
too; int4's codes are unpacked into 16-bit pairs first). Torch's kernels are slower than a bf16 matmul
once the batch is large (measured: ~2x at B=64), where the step is compute-bound. With AVX-512 BF16
(cpu_paths: weight_only_bf16) bfloat16 arithmetic takes the same panels: each panel's codes are unpacked into
bf16 pairs once a call, however many rows share it, for the AMX tiles (or vdpbf16ps on Zen 4), so a prompt
runs at about the bf16 linear's speed from a quarter of its bytes, and a decode step reads the codes once
(benchmarks/int4_linear.py).

Where the weights come from: from a quantized GGUF, its own codes, tensor by tensor (gguf_quant.py:
Int4Codes, Int8Codes; no float copy of the model): a Q4_0/Q4_1/Q4_K block is w = q * scale + low with q
in [0, 15] over groups of 32, exactly int4's grid below, so the codes are served as they are (up to
rounding scale and low into the compute dtype). A Q8_0 block (per-32 scale), Q5_* or Q6_K has no per-row
int8 equivalent, so its tensor is dequantized alone and re-quantized per row (one more rounding, measured
in the tests). Otherwise the model hands us float weights and we quantize them (the same min/max group-32
grid, so a Q4_1 file's floats give its codes back too).
The LM head (the tied embedding, Q8_0 in the GGUF) is int8 in both modes, as llama.cpp keeps it:
an int4 head failed the top-5 closeness check against float32 on 9 of 10 prompts (measured), while
int4 layers + int8 head gave float32's 16 greedy tokens exactly on 8 of 10 (int8 layers: 4 of 10,
all within the check: per-row int8 re-rounds the Q4_1 grid, int4 group-32 reproduces it).

w8a8 quantizes the activations too, which is what pays at a large batch, where a step is bound by
arithmetic, not bytes: int8 weights (symmetric, one scale an output row, as int8 above) in the C++
kernel's panels (cpu_linear.cpp), and x quantized as it enters the kernel, each row's groups of 64
values asymmetrically over their own range (u8 codes, a scale and a zero point). AVX-512 VNNI's
vpdpbusd then does 64 multiply-adds an instruction, twice bf16's dot product, over half its weight
bytes. It is llama.cpp's Q8_0 and OpenVINO's int8 on CPU in kind (both quantize the activations to
8 bits in blocks); the closeness test holds it to float32 as it does int8 and int4, and the LM head
is w8a8 too (PyTorch's weight-only int8 is slower than bf16 at a large batch).

Float weights on CPU are packed too, without quantizing: one copy, in one layout. Where the C++
linear kernel builds (cpu_linear.cpp: AVX-512 or AVX2), float32 weights go into its panels: at a small
batch it streams them at memory speed, where oneDNN's GEMV reaches only part of that, and the same
layout serves large batches. So do bfloat16 weights on a CPU without native bf16 (AVX-512 BF16 or
AMX), where oneDNN emulates bf16 slowly: the kernel widens them in registers and computes in
float32, reading half float32's bytes. Otherwise (native bf16, float16, no kernel,
ITERSERVE_CPU_KERNELS=0) they go into oneDNN's blocked layout: F.linear would hand oneDNN a plain
[N, K] weight and pay that re-layout on every call (~70 us per linear at B=1, measured: 120 linears
a step); `_linear_pointwise` on the packed weight gives bf16 results bit-identical to F.linear's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from iterserve.model import cpu_kernels, cpu_packing, cpu_paths

INT4_GROUP = cpu_packing.INT4_GROUP  # the GGUF block size, so a Q4_0/Q4_1 tensor maps group for group


@dataclass(slots=True)
class Int8Weight:
    qweight: torch.Tensor  # [N, K] int8, or with `panels` cpu_packing.pack_int8_weight_panels' (scales inside)
    scales: torch.Tensor  # [N]: compute dtype for torch's kernel, float32 beside the panels (a copy is inside)
    shape: torch.Size  # [N, K], as the float weight's
    panels: bool = False  # whether qweight is the C++ kernel's panels (AVX2 or bf16), else torch's [N, K] layout

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + (0 if self.panels else self.scales.nbytes)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.panels:  # in and out in the kernel's dtype (weight_only_dtype)
            dtype = weight_only_dtype()
            return cpu_kernels.linear_int8_weights(x.to(dtype), self.qweight, *self.shape, _as(bias, dtype)).to(x.dtype)
        return _plus(torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales), bias)


@dataclass(slots=True)
class Int4Weight:
    packed: torch.Tensor  # PyTorch's CPU int4 tile layout, [N, K / 2] uint8, or cpu_packing.pack_int4_weight_panels'
    scales_zeros: torch.Tensor | None  # [K / group, N, 2], compute dtype, for torch's kernel; None beside the panels
    shape: torch.Size  # [N, K], as the float weight's

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (self.scales_zeros.nbytes if self.scales_zeros is not None else 0)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.scales_zeros is None:  # the C++ kernel's panels, in and out in its dtype (weight_only_dtype)
            dtype = weight_only_dtype()
            return cpu_kernels.linear_int4_weights(x.to(dtype), self.packed, *self.shape, _as(bias, dtype)).to(x.dtype)
        return _plus(torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, INT4_GROUP,
                                                                self.scales_zeros), bias)


@dataclass(slots=True)
class Int4Codes:
    """A GGUF Q4_0 / Q4_1 / Q4_K tensor as its blocks hold it (model/gguf_quant.py): int4's own grid, each group
    of INT4_GROUP inputs w = q * scale + low, so it serves as int4 with nothing re-rounded."""
    q: torch.Tensor  # [N, K] uint8 in [0, 15]
    scale: torch.Tensor  # [N, K / INT4_GROUP] float32
    low: torch.Tensor  # [N, K / INT4_GROUP] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def parts(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.scale, self.low

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.view(n, -1, INT4_GROUP).float() * self.scale[..., None] + self.low[..., None]
        return w.view(n, k).to(dtype)

    def scaled(self, m: float) -> Int4Codes:
        return Int4Codes(self.q, self.scale * m, self.low * m)

    def to_int8(self, rows: int = 4096) -> Int8Codes:
        """Per-row int8 codes of these weights, dequantized `rows` at a time (rows are coded alone)."""
        parts = [cpu_packing.int8_codes(Int4Codes(*(p[i:i + rows] for p in self.parts())).dequantize(torch.float32))
                 for i in range(0, self.q.shape[0], rows)]
        return Int8Codes(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]))


@dataclass(slots=True)
class Int8Codes:
    """Per-row int8 codes (cpu_packing.int8_codes): a GGUF tensor of another quantized type (Q8_0, Q5_*, Q6_K:
    no int4 or per-row grid holds them, so they are re-rounded once), or a quantized embedding table, whose
    rows are dequantized on lookup instead of keeping a float copy of vocab x hidden."""
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N]: w = q * scale

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def parts(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.scale

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None].float()).to(dtype)

    def scaled(self, m: float) -> Int8Codes:
        return Int8Codes(self.q, self.scale * m)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized rows ids, as an embedding lookup gives them."""
        return (self.q.index_select(0, ids).float() * self.scale.index_select(0, ids)[:, None].float()).to(dtype)


Codes = Int4Codes | Int8Codes


def cat_codes(parts: list[torch.Tensor | Codes]) -> torch.Tensor | Codes:
    """Parts of a fused weight (q/k/v, gate/up) stacked by rows. Mixed kinds (a Q4_K_M file's Q6_K v beside Q4_K
    q and k, or a float part) become per-row int8 each, the finer grid: per-row codes of the parts are the
    fused weight's, since rows are coded alone."""
    kinds = {type(p) for p in parts}
    if len(kinds) == 1 and kinds <= {Int4Codes, Int8Codes}:
        return parts[0].__class__(*(torch.cat(f) for f in zip(*(p.parts() for p in parts))))
    if not kinds & {Int4Codes, Int8Codes}:
        return torch.cat(parts)
    return cat_codes([p if isinstance(p, Int8Codes) else p.to_int8() if isinstance(p, Int4Codes) else
                      Int8Codes(*cpu_packing.int8_codes(p)) for p in parts])


def _as(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return bias.to(dtype).contiguous() if bias is not None else None


def _plus(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y + bias if bias is not None else y


@dataclass(slots=True)
class PackedFloatWeight:
    packed: torch.Tensor  # oneDNN's blocked layout: the [N, K] shape, not its element order
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


@dataclass(slots=True)
class PanelWeight:
    panels: torch.Tensor  # cpu_packing.pack_panels' layouts: [ceil(N / PANEL), K, PANEL], or K / 2 pairs
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_kernels.linear(x, self.panels, self.shape[0], bias)


Weight = torch.Tensor | Int8Weight | Int4Weight | PackedFloatWeight | PanelWeight


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a float or a packed weight; x [..., K] -> [..., N]."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if x.dim() == 2:  # the model's [T, K] activations: no reshape and view, 121 times a decode step
        return w(x, bias)
    return w(x.reshape(-1, x.shape[-1]), bias).view(*x.shape[:-1], w.shape[0])


def weight_only_on_panels(mode: str | None) -> bool:
    """Whether --quantization `mode` is weight-only int8/int4 on cpu_linear.cpp's panels (AVX2 builds): under
    float32 arithmetic, beside bf16 storage. Elsewhere torch's kernels run them, in the arithmetic's dtype."""
    return mode in ("int8", "int4") and cpu_kernels.linear_weight_only_supported()


def weight_only_bf16(dtype: torch.dtype) -> bool:
    """Whether weight-only int8/int4 weights under `dtype` arithmetic go into cpu_linear.cpp's panels unpacked to
    bf16 (AMX tiles, or vdpbf16ps): bfloat16, where cpu_paths says this build takes them."""
    return dtype == torch.bfloat16 and cpu_paths.current().weight_only_bf16


def weight_only_dtype() -> torch.dtype:
    """The activations' dtype of this build's weight-only panels: float32 where they are the AVX2 kernels',
    else bfloat16 (AVX-512 BF16; a build has at most one of them)."""
    return torch.float32 if cpu_kernels.linear_weight_only_supported() else torch.bfloat16


def kernel_panels(w: Weight, x_dtype: torch.dtype) -> tuple[torch.Tensor, int] | None:
    """The panels and dtype code with which cpu_linear.cpp's iterserve_linear runs w under activations of
    x_dtype (cpu_kernels.linear_code; the weight-only panels take weight_only_dtype()), or None where it does not."""
    tensor, kind = panel_tensor(w) or (None, None)
    if kind == "panels":
        return tensor, cpu_kernels.linear_code(x_dtype, tensor)
    if kind is None or x_dtype != weight_only_dtype():
        return None
    return tensor, cpu_kernels.weight_only_code(cpu_kernels.INT8_WEIGHTS if kind == "int8" else
                                                cpu_kernels.INT4_WEIGHTS, x_dtype)


def panel_tensor(w: Weight) -> tuple[torch.Tensor, str] | None:
    """For the weight cache: the one tensor a weight on the C++ kernel's panels is, and its kind ("panels":
    pack_panels' or w8a8's; "int8" / "int4": weight-only); None for any other weight."""
    if isinstance(w, PanelWeight):
        return w.panels, "panels"
    if isinstance(w, Int8Weight) and w.panels:
        return w.qweight, "int8"
    if isinstance(w, Int4Weight) and w.scales_zeros is None:
        return w.packed, "int4"
    return None


def from_panel_tensor(kind: str, t: torch.Tensor, shape: torch.Size) -> Weight:
    """The weight panel_tensor gave (t, kind) for, of this [N, K] shape."""
    if kind == "int8":  # the row scales are the panels' tail
        padded = -(-shape[0] // cpu_packing.PANEL) * cpu_packing.PANEL
        return Int8Weight(t, t[t.numel() - 4 * padded:].view(torch.float32)[:shape[0]], shape, panels=True)
    if kind == "int4":
        return Int4Weight(t, None, shape)
    if kind != "panels":
        raise ValueError(f"no weight of kind {kind!r}")
    return PanelWeight(t, shape)


def stored_tensors(w: Weight) -> tuple[str, list[torch.Tensor]] | None:
    """For the weight cache: (kind, tensors) a weight is kept as: panel_tensor's one tensor, or torch's int8
    layout (codes, scales: "int8-rows") or int4 tiles (packed, scales and zeros: "int4-tiles"); None for
    oneDNN's opaque layout or a plain tensor."""
    found = panel_tensor(w)
    if found is not None:
        return found[1], [found[0]]
    if isinstance(w, Int8Weight):
        return "int8-rows", [w.qweight, w.scales]
    if isinstance(w, Int4Weight):
        return "int4-tiles", [w.packed, w.scales_zeros]
    return None


def from_stored(kind: str, tensors: list[torch.Tensor], shape: torch.Size) -> Weight:
    """The weight stored_tensors gave (kind, tensors) for, of this [N, K] shape."""
    if kind == "int8-rows":
        return Int8Weight(tensors[0], tensors[1], shape)
    if kind == "int4-tiles":
        return Int4Weight(tensors[0], tensors[1], shape)
    return from_panel_tensor(kind, tensors[0], shape)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric, one scale per output row (cpu_packing.int8_codes, as w8a8's panels hold them). On AVX2
    without AVX-512 the C++ kernel's panels: torch's weight-only int8 kernel there is many times slower
    than bf16 storage (docs/performance.md, 2026-12-02)."""
    return int8_weight(*cpu_packing.int8_codes(w), w.dtype, w.device)


def int8_weight(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, device: torch.device) -> Int8Weight:
    """The Int8Weight of codes q [N, K] int8 and float32 row scales [N]; dtype: the arithmetic's (torch's kernel;
    the bf16 unpacking takes bfloat16 and K a multiple of 32)."""
    if device.type == "cpu" and (cpu_kernels.linear_weight_only_supported() or
                                 (weight_only_bf16(dtype) and q.shape[1] % 32 == 0)):
        return Int8Weight(cpu_packing.pack_int8_weight_panels(q, scales), scales, q.shape, panels=True)
    return Int8Weight(q.contiguous(), scales.to(dtype), q.shape)


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    """Asymmetric min/max, groups of INT4_GROUP along K (Q4_1's scheme). On AVX2 without AVX-512 the C++
    kernel's panels (bf16 scales and minimums), as int8's."""
    n, k = w.shape
    if k % INT4_GROUP:
        raise ValueError(f"--quantization int4 quantizes in groups of {INT4_GROUP} inputs; this model has a linear "
                         f"layer of {k} inputs: use int8 instead")
    wf = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = wf.amin(dim=-1), wf.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = torch.round((wf - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    return int4_weight(q, scale, lo, w.dtype, w.device)


def int4_weight(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype,
                device: torch.device) -> Int4Weight:
    """The Int4Weight of codes q [N, K] in [0, 15] and per-group float32 scale and minimum [N, K / INT4_GROUP]
    (w = q * scale + lo); dtype: the arithmetic's, in which torch's kernel takes them (bf16 unpacking: bfloat16)."""
    if device.type == "cpu" and (cpu_kernels.linear_weight_only_supported() or weight_only_bf16(dtype)):
        return Int4Weight(cpu_packing.pack_int4_weight_panels(q, scale, lo), None, q.shape)
    zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    # 2 inner k-tiles: the CPU kernel's choice
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    return Int4Weight(packed, scales_zeros, q.shape)


def panel_layout(dtype: torch.dtype) -> str | None:
    """The C++ kernel's panel layout pack_float gives a CPU weight of this dtype, or None (oneDNN's
    layout, or no kernel here): "plain" for float32; for bfloat16 what cpu_paths decides for this CPU
    ("plain", widened in registers, without native bf16; "pairs" on AVX-512 BF16 and AMX)."""
    if dtype == torch.float32:
        return "plain" if cpu_kernels.linear_kernel() is not None else None
    return cpu_paths.current().bf16_layout if dtype == torch.bfloat16 else None


def pack_float(w: torch.Tensor, panels: bool = False) -> Weight:
    """The C++ kernel's panels or oneDNN's layout for a float CPU weight (see the top), or the weight
    itself where neither can take it. panels: the kernel's plain panels whatever the CPU (bfloat16
    weights under float32 activations: only that kernel takes them; the caller checked it builds)."""
    if w.device.type != "cpu":
        return w
    layout = "plain" if panels else panel_layout(w.dtype)
    if layout == "pairs" and w.shape[1] % 2:
        layout = None  # an odd number of inputs: oneDNN's (no model here has one)
    if layout is not None:
        return PanelWeight(cpu_packing.pack_panels(w, pairs=layout == "pairs"), w.shape)
    if not torch.backends.mkldnn.is_available():
        return w
    try:  # float16 needs AVX-512 fp16 or AVX-NE-CONVERT; bfloat16 without AVX-512 bf16 is emulated
        packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 64)  # the batch hint: no effect measured
    except RuntimeError:
        return w
    return PackedFloatWeight(packed, w.shape)


def quantize(w: torch.Tensor | Codes, mode: str, dtype: torch.dtype | None = None) -> Weight:
    """w in `mode`. A GGUF's codes serve as they are where the mode takes them: int4 both kinds (the Q6_K tensors
    of a Q4_K_M file stay per-row int8, as its head does), int8 the int8 ones; otherwise they are dequantized
    first. dtype: the arithmetic's (torch's kernels take their scales in it); default: w's."""
    dtype = dtype or getattr(w, "dtype", torch.float32)
    if isinstance(w, Int4Codes) and mode == "int4":
        return int4_weight(w.q, w.scale, w.low, dtype, w.q.device)
    if isinstance(w, Int8Codes) and mode in ("int8", "int4"):
        return int8_weight(w.q, w.scale, dtype, w.q.device)
    if not isinstance(w, torch.Tensor):
        w = w.dequantize(dtype)
    if mode == "int8":
        return quantize_int8(w)
    if mode == "int4":
        return quantize_int4(w)
    if mode == "w8a8":
        return PanelWeight(cpu_packing.pack_int8_panels(w), w.shape)
    raise ValueError(f"quantization must be None, 'int8', 'int4' or 'w8a8', got {mode!r}")


def check_supported(mode: str | None, device: torch.device) -> None:
    if mode is not None and device.type != "cpu":
        raise ValueError(f"--quantization {mode} uses iterserve's and PyTorch's CPU kernels; run on cpu "
                         "or drop the flag")
    if mode == "w8a8" and not cpu_kernels.linear_int8_supported():
        raise ValueError("--quantization w8a8 needs the CPU linear kernel built with AVX-512 VNNI (int8 dot "
                         "products), which this machine or build lacks; use int8 (weight-only) instead")
