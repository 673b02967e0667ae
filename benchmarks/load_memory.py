"""Peak memory and time of loading a model, cold and warm: what --quantization costs in RSS.

    python benchmarks/load_memory.py ~/.cache/iterserve-models/1b/1b.Q4_K_M.gguf          # auto: int4
    python benchmarks/load_memory.py MODEL.gguf --quantization none --tokens 8

Each start is a child process that builds a ModelRunner (the engine's whole load: arch, weights, tokenizer,
packing, KV pool) and greedily generates --tokens tokens. Cold: an empty weight cache (ITERSERVE_WEIGHT_CACHE
in a new temporary folder, removed at the end; the C++ kernels' build cache is kept); warm: the folder the
cold start filled. The GGUF sits in the OS page cache either way. Printed per start: seconds to a loaded
model, peak RSS (getrusage's ru_maxrss and /proc/self/status's VmHWM), and the served bytes the memory check
computes from the GGUF header (weight_cache.served_bytes), beside the KV pool's bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, resource, sys, time
start = time.perf_counter()
from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.model import weight_cache
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput
args = json.loads(sys.argv[1])
config = EngineConfig(model=args["model"], quantization=args["quantization"], dtype=args["dtype"],
                      kv_cache_memory=args["kv_cache_memory"], max_model_len=args["max_model_len"])
runner = ModelRunner(config)
loaded = time.perf_counter() - start
tokens = [1, 2, 3, 4]
for i in range(args["tokens"]):  # greedy, one request, recomputing the prompt: a check that it generates
    plan = SchedulerOutput(block_size=16, scheduled=[ScheduledRequest(
        "r", list(tokens), 0, list(range(-(-len(tokens) // 16))), True, SamplingParams(temperature=0.0))])
    tokens.append(runner.execute(plan).sampled[0])
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"load_s": loaded, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "vm_hwm": hwm * 1024, "quantization": runner.quantization, "tokens": tokens[4:],
                  "served": weight_cache.served_bytes(args["model"], runner.quantization, runner.storage_dtype),
                  "kv": runner.kv_cache.nbytes}))
"""


def start(args: argparse.Namespace, cache: str) -> dict:
    env = dict(os.environ, ITERSERVE_WEIGHT_CACHE=cache)
    spec = {k: getattr(args, k) for k in ("model", "quantization", "dtype", "kv_cache_memory", "max_model_len",
                                          "tokens")}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4", "w8a8"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=4, help="greedy tokens generated after loading")
    args = p.parse_args()
    cache = tempfile.mkdtemp(prefix="load-memory-")
    gib = 1 << 30
    try:
        for kind in ("cold", "warm"):
            r = start(args, cache)
            print(f"{kind}: {r['load_s']:.1f} s to a loaded model; peak RSS {r['ru_maxrss'] / gib:.2f} GiB "
                  f"(ru_maxrss), {r['vm_hwm'] / gib:.2f} GiB (VmHWM); served {r['quantization'] or 'floats'}: "
                  f"{r['served'] / gib:.2f} GiB of weights + {r['kv'] / gib:.2f} GiB KV; tokens {r['tokens']}",
                  flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
