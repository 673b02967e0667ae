"""`iterserve env`: this machine as iterserve sees it: the CPU, the kernel path cpu_paths chose for it,
and the versions that matter, for a bug report or beside a benchmark figure."""
from __future__ import annotations

import argparse
import json
import os
import platform

import torch

import iterserve
from iterserve.model import cpu_build, cpu_paths


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def report() -> dict:
    paths = cpu_paths.current()
    return {"iterserve": iterserve.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": cpu_model(), "isa_cap": cpu_build.ISA_CAP, "cores": os.cpu_count(), "cuda": torch.cuda.is_available(),
            "kernel_cache": str(cpu_build.cache_dir()), "paths": {**{f: getattr(paths, f) for f in paths.__slots__},
                                                                    "default_dtype": paths.default_dtype, "torch_prompt_attention": paths.torch_prompt_attention,
                                                                    "decode_loop": paths.decode_loop},
            "summary": paths.summary()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="iterserve env", description=__doc__)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = ap.parse_args(argv)
    info = report()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    for key in ("iterserve", "torch", "python", "cpu", "isa_cap", "cores", "cuda", "kernel_cache"):
        print(f"{key:<18} {info[key]}")
    for key, value in info["paths"].items():
        print(f"{key:<18} {value}")
    print(info["summary"])
    return 0
