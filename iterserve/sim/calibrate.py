"""`iterserve calibrate`: measure this machine and fit the simulator's `cpu-local` profile.

Four measurements, each a few seconds:
1. matmul throughput (float32 and bfloat16 GEMMs): the peak FLOP/s the roofline divides by;
2. memory bandwidth (a large tensor summed): the bytes/s the roofline divides by;
3. real step times of the loaded model (ModelRunner.execute on hand-made plans: decode at a few
   batch sizes and contexts, prefill at a few lengths);
4. the engine's host work per step (schedule, update, detokenize) with a zero-cost executor.

Then the efficiency factors are fitted to (3) by a grid search over (memory, linear, attention)
efficiency with the overheads solved by least squares for each point, minimising squared
relative error; (4) is added to the fixed and per-request overheads. The profile is JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from iterserve.config import EngineConfig
from iterserve.entrypoints.args import HelpFormatter, fail
from iterserve.sim.calibrate_fit import fit_profile, predict_rows, refit
from iterserve.sim.calibrate_measure import (
    _point_blocks, _point_label, fill_pool, measure_bandwidth, measure_host_overhead, measure_kv_handoff,
    measure_matmul, measure_steps, neighbour, parse_points,
)
from iterserve.sim.calibrate_validate import VALIDATION_WORKLOADS, format_validation, validate
from iterserve.sim.hardware import HardwareSpec, default_cpu_profile_path


# The default step shapes: kind:batch:length[@cached]. A profile is most accurate on the shapes its
# workload runs (long contexts, chunks after a cached prefix): pass those with --points.
QUICK_POINTS = ("decode:1:128,decode:8:128,decode:32:128,decode:32:512,decode:8:1024,"
                "prefill:1:128,prefill:1:512,prefill:4:128")
MORE_POINTS = "decode:4:256,decode:16:256,decode:64:256,prefill:1:32"


def calibrate(model_path: str | None, quick: bool = False, dtype: str = "auto", reps: int = 3,
              num_threads: int | None = None, points: list[tuple] | None = None,
              neighbour_point: tuple | None = None) -> dict:
    """neighbour_point: every measurement taken while a second process runs that step in a loop."""
    import torch
    if num_threads:
        torch.set_num_threads(num_threads)
    if points is None:
        points = parse_points(QUICK_POINTS if quick else f"{QUICK_POINTS},{MORE_POINTS}")
    blocks = max(1200, max(_point_blocks(p) for p in [*points, *filter(None, [neighbour_point])]))
    runner_kwargs = dict(model=model_path, dtype=dtype, num_kv_blocks=blocks, max_num_seqs=64, num_threads=num_threads)
    with neighbour(neighbour_point, runner_kwargs):
        return _calibrate(model_path, runner_kwargs, reps, points, neighbour_point)


def _calibrate(model_path: str | None, runner_kwargs: dict, reps: int, points: list[tuple],
               neighbour_point: tuple | None) -> dict:
    import torch

    from iterserve.executor.model_runner import ModelRunner
    from iterserve.sim.model_spec import get_model_spec
    from iterserve.model.loader import default_model_path
    path = model_path or default_model_path()
    print(f"calibrating on {torch.get_num_threads()} threads with {path}", flush=True)
    flops = {d: measure_matmul(d) for d in ("float32", "bfloat16")}
    bw = measure_bandwidth()
    print(f"  matmul {flops['float32'] / 1e9:.1f} GFLOP/s fp32, {flops['bfloat16'] / 1e9:.1f} GFLOP/s bf16; "
          f"memory {bw / 1e9:.1f} GB/s", flush=True)
    runner = ModelRunner(EngineConfig(**runner_kwargs))  # one point's requests at a time
    fill_pool(runner)
    elem = runner.storage_dtype.itemsize  # the weights' and the KV's bytes
    spec = get_model_spec(path, elem)
    rows = measure_steps(runner, points, reps)
    base = HardwareSpec("cpu-local", memory_bytes=_total_memory(), mem_bandwidth=bw,
                        peak_flops=flops["bfloat16" if runner.dtype == torch.bfloat16 else "float32"],
                        reserved_bytes=0, kind="cpu",
                        interconnect_bandwidth=bw, host_link_bandwidth=bw, fused_attention=False)
    hw, err = fit_profile(spec, base, rows)
    host_fixed, host_seq = measure_host_overhead(runner.tokenizer, [1, 8, 32])
    print(f"  engine host work: {host_fixed * 1e3:.2f} ms/step + {host_seq * 1e6:.0f} us/request", flush=True)
    kv_send, kv_receive = measure_kv_handoff(runner)
    print(f"  P/D hand-off of a 2,048-token prompt (shared memory): send {kv_send / 1e9:.2f} GB/s, "
          f"receive {kv_receive / 1e9:.2f} GB/s", flush=True)
    for r, p in zip(rows, predict_rows(spec, hw, rows)):  # the runner's steps: without the host work
        r["predicted_s"] = p
        r["error"] = p / r["measured_s"] - 1
    # the engine's steps = the runner's + its own host work (schedule, update, detokenize)
    hw = HardwareSpec(**{**hw.to_json(), "step_overhead_s": hw.step_overhead_s + host_fixed,
                         "seq_overhead_s": hw.seq_overhead_s + host_seq, "kv_send_bandwidth": kv_send,
                         "kv_receive_bandwidth": kv_receive})
    return {"hardware": hw.to_json(),
            "model": {"path": path, "name": spec.name, "dtype_bytes": elem},
            "measured": {"matmul_flops": flops, "mem_bandwidth": bw, "threads": torch.get_num_threads(),
                         "host_step_s": host_fixed, "host_seq_s": host_seq, "kv_send_bandwidth": kv_send,
                         "kv_receive_bandwidth": kv_receive, "steps": rows,
                         "fit_rms_rel_error": float(np.sqrt(err / len(rows))),
                         **({"neighbour": list(neighbour_point)} if neighbour_point else {})},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _total_memory() -> int:
    try:
        import os
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="iterserve calibrate", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="model to time (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="model dtype")
    p.add_argument("--output", default=None, help=f"profile path (default: {default_cpu_profile_path()})")
    p.add_argument("--quick", action="store_true", help="fewer step-time points")
    p.add_argument("--reps", type=int, default=3, help="timings per step-time point (the median is kept)")
    p.add_argument("--points", default=None, metavar="SPEC",
                   help="step shapes to time instead of the default grid, e.g. "
                        "decode:16:1024,prefill:1:64@1024 (BATCH requests; LENGTH new tokens after CACHED)")
    p.add_argument("--neighbor", default=None, metavar="POINT",
                   help="measure while a second process runs this step (same threads) over and over, as the "
                        "other engine of a P/D pair on this host does: a decode engine's profile beside "
                        "prefill:1:512, a prefill engine's beside decode:16:100")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads for every measurement (1 is steadier when other work shares the cores)")
    p.add_argument("--validate", action="store_true",
                   help="after fitting, run bench workloads for real and simulated and print the error table")
    p.add_argument("--validate-only", default=None, metavar="PROFILE", help="validate an existing profile")
    p.add_argument("--save-runs", default=None, metavar="DIR", help="validation: keep the real runs' reports here")
    p.add_argument("--refit", default=None, metavar="PROFILE",
                   help="fit an existing profile again from its recorded step times, in place")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.refit:
        if not Path(args.refit).is_file():
            fail(f"no profile at {args.refit}")
        profile = refit(args.refit)
        Path(args.refit).write_text(json.dumps(profile, indent=2))
        _print_fit(profile)
        print(f"wrote {args.refit}")
        return 0
    if args.validate_only:
        if not Path(args.validate_only).is_file():
            fail(f"no profile at {args.validate_only} (write one with `iterserve calibrate`)")
        print(format_validation(validate(args.validate_only, num_threads=args.num_threads, save_dir=args.save_runs)))
        return 0
    try:
        points = parse_points(args.points) if args.points else None
        neighbour_points = parse_points(args.neighbor) if args.neighbor else [None]
    except ValueError as exc:
        fail(str(exc))
    if len(neighbour_points) != 1:
        fail(f"--neighbor takes one point, got {len(neighbour_points)}")
    profile = calibrate(args.model, args.quick, args.dtype, args.reps, args.num_threads, points, neighbour_points[0])
    out = Path(args.output) if args.output else default_cpu_profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2))
    _print_fit(profile)
    print(f"wrote {out}")
    if args.validate:
        rows = validate(str(out), num_threads=args.num_threads, save_dir=args.save_runs)
        print("workloads:\n" + "\n".join(f"  iterserve bench {' '.join(w)}" for w in VALIDATION_WORKLOADS))
        print(format_validation(rows))
        profile["validation"] = rows
        out.write_text(json.dumps(profile, indent=2))
    return 0


def _print_fit(profile: dict) -> None:
    hw = profile["hardware"]
    print(f"fitted: memory eff {hw['mem_efficiency']:.2f}, linear eff {hw['flops_efficiency']:.2f}, "
          f"attention eff {hw['attn_efficiency']:.2f}, overhead {hw['step_overhead_s'] * 1e3:.2f} ms/step "
          f"+ {hw['seq_overhead_s'] * 1e6:.0f} us/request; step-time fit error "
          f"{profile['measured']['fit_rms_rel_error'] * 100:.1f}% rms")
    print(f"{'kind':<8}{'batch':>6}{'len':>15}{'measured ms':>13}{'model ms':>10}{'error':>8}")
    for r in profile["measured"]["steps"]:
        print(f"{r['kind']:<8}{r['batch']:>6}{_point_label(r):>15}{r['measured_s'] * 1e3:>13.1f}"
              f"{r['predicted_s'] * 1e3:>10.1f}{r['error'] * 100:>7.1f}%")
