"""`iterserve calibrate --validate`: bench workloads run for real and simulated on a profile, and the
error of each figure."""
from __future__ import annotations

import json
from pathlib import Path

from iterserve.config import CPU_KV_CACHE_MEMORY
from iterserve.kv.spec import num_blocks_for


# Bench workloads (the flags of `iterserve bench`), scaled to run in minutes on two shared cores.
VALIDATION_WORKLOADS = [
    ["--num-requests", "32", "--prompt-len", "128", "--output-dist", "exponential", "--output-mean", "32",
     "--output-max", "128", "--max-num-seqs", "8", "--seed", "0"],
    ["--num-requests", "32", "--prompt-len", "64", "--output-dist", "uniform", "--output-min", "16",
     "--output-max", "64", "--max-num-seqs", "16", "--seed", "1"],
]
FIGURES = (("out tok/s", lambda t: t["output_tokens_per_s"]), ("TTFT mean", lambda t: t["ttft_s"]["mean"]),
           ("TPOT mean", lambda t: t["tpot_s"]["mean"]))


def validate(profile_path: str, workloads: list[list[str]] | None = None, num_threads: int | None = None,
             save_dir: str | None = None) -> list[dict]:
    """Each workload through the real engine and through the simulator on the profile; the
    relative error of each figure, per target."""
    from iterserve.bench import cli as bench_cli
    from iterserve.bench.runner import build_report, run_targets
    from iterserve.sim.cli import build_parser as sim_parser, engine_factory, resolve
    rows = []
    for flags in workloads or VALIDATION_WORKLOADS:
        threads = ["--num-threads", str(num_threads)] if num_threads else []
        args = sim_parser().parse_args([*flags, *threads, "--hardware", "cpu-local", "--hardware-profile", profile_path])
        trace, kw = bench_cli.trace_from_args(args), bench_cli.engine_kwargs_from_args(args)
        real = build_report({}, run_targets(trace, ["continuous", "static"], kw))["targets"]
        if save_dir:  # the real runs are the expensive half: keep them for later comparisons
            Path(save_dir, f"real-{len(rows) // 2}.json").write_text(json.dumps({"flags": flags, "targets": real}))
        model, hw = resolve(args)
        sim_kw = {**kw, "num_kv_blocks": kw.get("num_kv_blocks") or _real_kv_blocks(kw)}
        sim = build_report({}, run_targets(trace, ["continuous", "static"], sim_kw,
                                           engine_factory=engine_factory(model, hw)))["targets"]
        for r, m in zip(real, sim):
            row = {"workload": " ".join(flags), "target": r["name"]}
            for name, get in FIGURES:
                row[name] = (get(r), get(m), get(m) / get(r) - 1 if get(r) else None)
            rows.append(row)
            print(format_validation([row]).splitlines()[-1], flush=True)
    return rows


def _real_kv_blocks(kw: dict) -> int:
    """The pool the real engine would size from kv_cache_memory, so both runs share one KV budget."""
    from iterserve.config import parse_bytes
    from iterserve.model.loader import default_model_path
    from iterserve.sim.model_spec import get_model_spec, with_kv_cache_dtype
    from iterserve.executor.dtypes import pick_device, storage_dtype
    elem = storage_dtype(kw.get("dtype", "auto"), pick_device("auto"), kw.get("quantization")).itemsize
    spec = with_kv_cache_dtype(get_model_spec(kw.get("model") or default_model_path(), elem),
                               kw.get("kv_cache_dtype", "auto"))
    block = kw.get("block_size", 16) * spec.kv_bytes_per_token
    return num_blocks_for(parse_bytes(kw.get("kv_cache_memory") or CPU_KV_CACHE_MEMORY), block)


def format_validation(rows: list[dict]) -> str:
    head = f"{'target':<11}" + "".join(f"{n + ' real':>15}{'sim':>9}{'err':>7}" for n, _ in FIGURES)
    out = [head]
    for r in rows:
        line = f"{r['target']:<11}"
        for name, _ in FIGURES:
            real, sim, err = r[name]
            line += f"{real:>15.3f}{sim:>9.3f}{'-' if err is None else f'{err * 100:+.0f}%':>7}"
        out.append(line)
    return "\n".join(out)
