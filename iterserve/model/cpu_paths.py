"""Which kernel path this CPU gets: the one place that decides, from the ISA flags (read once) and what
the C++ kernels' builds take here. The model runner logs the choice at start, `iterserve env` prints it,
and the tests ask it what to expect instead of assuming the CPU they were written on.

The paths, widest first:
- amx: AVX-512 BF16 + AMX tiles. bfloat16 throughout; weights in the pairs panels, whose rows are the
  layout a bf16 tile multiply takes, so the linear kernel runs them on AMX tiles at every batch (a
  row's bits then do not depend on its batch); weight-only int8/int4 keep their codes in the kernel's
  panels and unpack each panel into those pairs for the tiles; unwindowed prompts attend through torch's
  flash kernel, which runs on the tiles too; the C decode loop runs.
- avx512_bf16 (Zen 4, Cooper Lake): the same panels (weight-only ones unpacked too) on vdpbf16ps alone.
- avx512 (no bf16 arithmetic): float32 arithmetic over bfloat16 weights widened in registers (bf16
  storage); int8 x int8 where VNNI is there (w8a8).
- avx2 (with FMA): bf16 storage as above; weight-only int8/int4 summed in integers on the kernel's panels.
- baseline: no vector kernel (or no compiler): torch's ops in float32.

ITERSERVE_CPU_ISA=<a path> caps the CPU at that path (cpu_build.ISA_CAPS): the kernels are built
without the wider instructions and their flags are hidden, so a wide CPU runs and tests a narrower one's.
"""
from __future__ import annotations

from dataclasses import dataclass

from iterserve.model import cpu_build, cpu_kernels

ISAS = ("amx", "avx512_bf16", "avx512", "avx2", "baseline")


@dataclass(frozen=True, slots=True)
class CpuPaths:
    isa: str                   # one of ISAS: the widest this CPU has
    kernels: bool              # cpu_linear.cpp builds and runs here
    bf16_arithmetic: bool      # bfloat16 matmuls run natively (AVX-512 BF16 or AMX)
    bf16_layout: str | None    # bfloat16 weights' panels: "pairs", "plain" (widened), None (oneDNN's layout)
    amx_tiles: bool            # the pairs panels run on AMX tiles
    w8a8: bool                 # --quantization w8a8: int8 x int8 dot products (AVX-512 VNNI)
    weight_only_panels: bool   # --quantization int8/int4 on the kernel's panels, summed in integers (AVX2)
    weight_only_bf16: bool     # --quantization int8/int4 on the kernel's panels, unpacked to bf16 (AMX or vdpbf16ps)

    @property
    def default_dtype(self) -> str:
        """What --dtype auto runs: bfloat16 throughout, bf16 storage under float32 arithmetic, or float32."""
        return "bfloat16" if self.bf16_arithmetic else "bf16-storage" if self.kernels else "float32"

    @property
    def decode_loop(self) -> bool:
        """Whether the default dtype's decode steps run their layers in one C call (cpu_decode.py): its
        linears must be in the kernel's panels."""
        return self.bf16_layout is not None

    @property
    def torch_prompt_attention(self) -> bool:
        """Whether unwindowed bfloat16 prompts attend through torch's flash kernel rather than
        cpu_attention.cpp's causal one: on AMX torch's runs its matmuls on the tiles, 2-3x the
        vdpbf16ps kernel at 512-2,048 tokens (docs/performance.md)."""
        return self.amx_tiles

    def summary(self) -> str:
        linear = {"pairs": "pairs panels" + (" on AMX tiles" if self.amx_tiles
                                             else " on vdpbf16ps"),
                  "plain": "plain panels, widened to float32", None: "oneDNN"}[self.bf16_layout]
        quant = [name for name, on in (("w8a8 (VNNI)", self.w8a8), ("int8/int4 panels", self.weight_only_panels),
                                       ("int8/int4 panels unpacked to bf16", self.weight_only_bf16)) if on]
        return (f"cpu {self.isa}: default dtype {self.default_dtype}; bf16 weights: {linear}; "
                f"C decode loop {'on' if self.decode_loop else 'off'}; "
                f"prompt attention: {'torch flash (AMX)' if self.torch_prompt_attention else 'own kernel'}; "
                f"quantized kernels: {', '.join(quant) or 'torch only'}")


def isa_of(flags: bytes) -> str:
    """The widest of ISAS that /proc/cpuinfo's flags line names."""
    words = set(flags.split())
    if {b"amx_bf16", b"amx_tile", b"avx512_bf16"} <= words:
        return "amx"
    if b"avx512_bf16" in words:
        return "avx512_bf16"
    if b"avx512f" in words:
        return "avx512"
    return "avx2" if {b"avx2", b"fma"} <= words else "baseline"


def decide(flags: bytes, *, kernels: bool, pairs: bool, amx: bool, w8a8: bool, weight_only: bool,
           weight_only_bf16: bool = False) -> CpuPaths:
    """The paths for a CPU with these flags and a kernel build that takes the pairs layout, AMX tiles,
    w8a8, weight-only panels (AVX2) and weight-only panels unpacked to bf16 pairs as given (the build can lack what the CPU
    has: -mno-* flags, an old compiler)."""
    isa = isa_of(flags)
    bf16 = isa in ("amx", "avx512_bf16")
    layout = None if not kernels else "plain" if not bf16 else "pairs" if pairs else None
    amx_tiles = kernels and pairs and amx
    return CpuPaths(isa, kernels, bf16, layout, amx_tiles, kernels and w8a8, kernels and weight_only,
                    kernels and pairs and weight_only_bf16)


def current() -> CpuPaths:
    """This CPU's paths, with this process's kernel builds (each cached where it is built)."""
    kernels = cpu_kernels.linear_kernel() is not None
    return decide(cpu_build.cpu_flags(), kernels=kernels, pairs=kernels and cpu_kernels.linear_pairs_supported(),
                  amx=kernels and cpu_kernels.linear_amx_supported(),
                  w8a8=kernels and cpu_kernels.linear_int8_supported(),
                  weight_only=kernels and cpu_kernels.linear_weight_only_supported(),
                  weight_only_bf16=kernels and cpu_kernels.linear_weight_only_bf16_supported())
