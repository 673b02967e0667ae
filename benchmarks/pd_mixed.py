"""Colocated vs P/D (1P1D or any xPyD) on a mixed trace: steady chats plus long prompts every few seconds.

Colocated is one engine with --cores threads; --pd xPyD (default 1P1D) is x prefill and y decode
processes (engine/pd_front.py) with cores/(x+y) threads each, joined by KV connectors (--transport). Both see
the same trace in wall-clock time; the table gives p50/p99 TPOT and mean TTFT of the chats and of
the long prompts. The claim under test: disaggregation takes the long prompts' prefill spikes out of
the chats' decode steps, so the chats' p99 TPOT drops. Takes timings: run it on a quiet machine.

    python benchmarks/pd_mixed.py                                   # 60 s: 2 chats/s, a 2,048-token prompt every 4 s
    python benchmarks/pd_mixed.py --duration 4 --chat-rate 2 --long-len 128 --long-every 2 --chat-output 8   # smoke
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import numpy as np

from iterserve.bench.metrics import stats
from iterserve.bench.runner import process_cpu_seconds
from iterserve.config import EngineConfig
from iterserve.engine.disagg import parse_pd
from iterserve.sampling_params import SamplingParams


def make_trace(args) -> list[tuple[float, str, list[int], int]]:
    """(arrival s, kind, prompt token ids, output tokens), sorted by arrival."""
    rng = np.random.default_rng(args.seed)
    trace, t = [], 0.0
    while True:
        t += rng.exponential(1 / args.chat_rate)
        if t >= args.duration:
            break
        trace.append((t, "chat", rng.integers(100, 20000, args.chat_len).tolist(), args.chat_output))
    for k in range(int(args.duration // args.long_every)):
        trace.append(((k + 0.5) * args.long_every, "long", rng.integers(100, 20000, args.long_len).tolist(),
                      args.long_output))
    return sorted(trace, key=lambda r: r[0])


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run_colocated(args, trace, probe: dict | None = None) -> dict[str, object]:
    """probe: filled with the engine's step records and the process's CPU seconds (--check-steps)."""
    from iterserve.engine.engine import Engine
    engine = Engine(EngineConfig(**config(args), num_threads=args.cores))
    engine.add_request(trace[0][2][:8], params(2))  # warm-up: one-time costs out of the measurement
    while engine.has_unfinished():
        engine.step()
    done, i, start, cpu = {}, 0, time.monotonic(), time.process_time()
    while len(done) < len(trace):
        now = time.monotonic() - start
        while i < len(trace) and trace[i][0] <= now:
            engine.add_request(trace[i][2], params(trace[i][3]), request_id=str(i), arrival_time=start + trace[i][0])
            i += 1
        if not engine.has_unfinished():
            time.sleep(min(0.005, max(0.0, trace[i][0] - now)) if i < len(trace) else 0)
            continue
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    if probe is not None:
        probe["records"] = {"engine": [r for r in engine.step_records if r.start >= start]}
        probe["cpu_s"] = {"engine (this process)": time.process_time() - cpu}
        probe["wall_s"] = time.monotonic() - start
        probe["load"] = _load_average()
        probe["preemptions"] = engine.stats.num_preemptions
    return done


def run_pd(args, trace, probe: dict | None = None) -> dict[str, object]:
    """probe: filled with each engine's step records (from the stats it reports after every step) and
    the CPU seconds of the front (this process) and of each engine process (--check-steps)."""
    from iterserve.engine.pd_front import PDEngines
    x, y = parse_pd(args.pd)
    pd = PDEngines({**config(args), "num_threads": pd_threads(args)}, args.transport, x, y)
    records: dict[str, list] = {name: [] for name in pd.procs}
    steps_seen, preemptions = dict.fromkeys(pd.procs, 0), dict.fromkeys(pd.procs, 0)
    if probe is not None:
        report = pd._report

        def recording(name, stats):  # an engine reports after every step it runs, with that step's record
            preemptions[name] = stats.num_preemptions
            if stats.last_step is not None and stats.num_steps > steps_seen[name]:
                steps_seen[name] = stats.num_steps
                records[name].append(stats.last_step)
            report(name, stats)
        pd._report = recording
    try:
        pd.add_request(trace[0][2][:8], params(2), "warm-up")
        while pd.has_unfinished():
            pd.get_outputs(0.05)
        done, i, start = {}, 0, time.monotonic()
        cpu = {name: process_cpu_seconds(p.pid) for name, p in pd.procs.items()}
        front = time.process_time()
        while len(done) < len(trace):
            now = time.monotonic() - start
            while i < len(trace) and trace[i][0] <= now:
                pd.add_request(trace[i][2], params(trace[i][3]), str(i))
                i += 1
            for o in pd.get_outputs(0.002):
                if o.finished:
                    if o.error:
                        raise RuntimeError(f"request {o.request_id}: {o.error}")
                    done[o.request_id] = o
        if probe is not None:
            probe["records"] = {name: [r for r in recs if r.start >= start] for name, recs in records.items()}
            probe["cpu_s"] = {"front (this process)": time.process_time() - front,
                              **{name: process_cpu_seconds(p.pid) - cpu[name] for name, p in pd.procs.items()}}
            probe["wall_s"] = time.monotonic() - start
            probe["load"] = _load_average()
            probe["preemptions"] = sum(preemptions.values())
        return done
    finally:
        pd.close()


def _load_average() -> float | None:
    """The host's 1-minute load average: above the cores, other work shared them and the run is noisy."""
    import os
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def pd_threads(args) -> int:
    """The cores shared out among the P/D engines (x + y processes on one host)."""
    return max(1, args.cores // sum(parse_pd(args.pd)))


def config(args) -> dict:
    return {"dtype": args.dtype, "max_num_batched_tokens": args.max_num_batched_tokens, "num_kv_blocks": args.num_kv_blocks}


def table(name: str, trace, done) -> list[dict]:
    rows = []
    for kind in ("chat", "long"):
        outs = [done[str(i)] for i, r in enumerate(trace) if r[1] == kind]
        tpot = stats([o.times.tpot for o in outs if o.times.tpot is not None])
        ttft = stats([o.times.ttft for o in outs])
        # first token -> second: on 1P1D the hand-off (the copies, the queue, the decode engine's next step)
        second = stats([o.times.itl[0] for o in outs if o.times.itl])
        rows.append({"target": name, "kind": kind, "n": len(outs), "tpot_p50_s": tpot["p50"],
                     "tpot_p99_s": tpot["p99"], "ttft_mean_s": ttft["mean"], "second_token_mean_s": second["mean"]})
    return rows


def profile_paths(args) -> dict[str, str]:
    """Each role's profile: colocated --sim-profile, the P/D engines --sim-pd-profile (default: the same),
    the decode engines --sim-decode-profile where given."""
    pd_profile = args.sim_pd_profile or args.sim_profile
    return {"colocated": args.sim_profile, "prefill": pd_profile, "decode": args.sim_decode_profile or pd_profile}


def simulated(args, trace, specs: dict[str, tuple], label: str = "", sim_steps: dict | None = None) -> list[dict]:
    """The same trace through the simulator, each role's steps priced by its (model spec, hardware spec)
    in specs (colocated: one engine of --cores threads; prefill and decode: one P/D engine's), the KV
    hand-off at the prefill profile's host link. sim_steps: filled with each target's simulated step records."""
    from iterserve.bench.workload import Trace, TraceRequest
    from iterserve.sim.cli import make_engine, simulate_trace
    from iterserve.sim.disagg import run_disagg

    def requests() -> Trace:
        return Trace([TraceRequest(str(i), len(ids), n, t, ids) for i, (t, _, ids, n) in enumerate(trace)])

    sim_config = EngineConfig(**config(args), model=None)
    colocated = simulate_trace(requests(), sim_config, *specs["colocated"])
    rows = sim_table(f"sim colocated ({args.cores} cores){label}", trace, colocated)
    (model, hw), (d_model, d_hw) = specs["prefill"], specs["decode"]
    x, y = parse_pd(args.pd)
    result = run_disagg(lambda: make_engine(sim_config, model, hw), x, y, requests(), hw.host_link_bandwidth,
                        make_decode_engine=lambda: make_engine(sim_config, d_model, d_hw))
    if sim_steps is not None:
        sim_steps["colocated"], sim_steps["pd"] = colocated.steps, result.steps
    return rows + sim_table(f"sim {args.pd.upper()}{label}", trace, result)


def with_host(specs: dict[str, tuple], host: dict[str, float]) -> dict[str, tuple]:
    """Each role's profile with host_time's seconds per step added to its fixed overhead."""
    from iterserve.sim.hardware import with_overrides
    return {role: (model, with_overrides(hw, step_overhead_s=hw.step_overhead_s + host[role]))
            for role, (model, hw) in specs.items()}


def fitted_to_run(trace, probes: dict, specs: dict[str, tuple]) -> tuple[dict[str, tuple], dict[str, float]]:
    """Each role's profile refitted to the real run's own steps (step_check.fit_to_steps: every engine of
    the role, each step with the busy gap after it), and each fit's RMS relative error."""
    from iterserve.sim.step_check import fit_to_steps, shapes_from_records, step_rows
    prompt_lens = {str(i): len(ids) for i, (_, _, ids, _) in enumerate(trace)}
    rows: dict[str, list[dict]] = {role: [] for role in specs}
    for target, probe in probes.items():
        for name, records in probe["records"].items():
            role = "colocated" if target == "colocated" else name.split("-")[0]
            rows[role] += step_rows(shapes_from_records(records, prompt_lens))
    fits, errors = {}, {}
    for role, (model, hw) in specs.items():
        fitted, errors[role] = fit_to_steps(model, hw, rows[role])
        fits[role] = (model, fitted)
    return fits, errors


def save_fits(directory: str, fits: dict[str, tuple], errors: dict[str, float], paths: dict[str, str]) -> None:
    """Each role's fitted profile as <directory>/<role>.json: its calibrated profile with the fitted
    hardware, usable as --sim-profile / --sim-pd-profile / --sim-decode-profile of a later run."""
    import os
    os.makedirs(directory, exist_ok=True)
    for role, (_, hw) in fits.items():
        with open(paths[role]) as f:
            profile = json.load(f)
        profile["hardware"] = hw.to_json()
        profile["fitted_to_run"] = {"role": role, "rms_rel_error": errors[role], "calibrated": paths[role],
                                    "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        with open(os.path.join(directory, f"{role}.json"), "w") as f:
            json.dump(profile, f, indent=2)


def host_time(trace, probes: dict) -> dict[str, float]:
    """Per role, the real seconds per step the profiles do not price: the engine's mean busy gap between
    steps and, for the P/D engines, the front's CPU spread over all their steps (the front runs on the
    cores the engines share)."""
    from iterserve.sim.step_check import busy_gaps, shapes_from_records
    prompt_lens = {str(i): len(ids) for i, (_, _, ids, _) in enumerate(trace)}
    gaps: dict[str, list[float]] = {"colocated": [], "prefill": [], "decode": []}
    for target, probe in probes.items():
        for name, records in probe["records"].items():
            role = "colocated" if target == "colocated" else name.split("-")[0]
            gaps[role] += busy_gaps(shapes_from_records(records, prompt_lens))
    out = {role: sum(g) / len(g) if g else 0.0 for role, g in gaps.items()}
    steps = len(gaps["prefill"]) + len(gaps["decode"])
    front = probes.get("pd", {}).get("cpu_s", {}).get("front (this process)", 0.0)
    for role in ("prefill", "decode"):
        out[role] += front / steps if steps else 0.0
    return out


def sim_spec(path: str):
    """(model spec, hardware spec) of a cpu-local profile."""
    from iterserve.sim.cli import resolve_cpu_profile
    return resolve_cpu_profile(path)


def print_checks(args, trace, probes: dict, sim_steps: dict) -> None:
    """--check-steps: each engine's real steps priced by its profile, beside the simulator's steps on the
    same trace, and the CPU each process of the run used."""
    from iterserve.sim.cost_model import CostModel
    from iterserve.sim.step_check import check_steps, format_check, shapes_from_records
    prompt_lens = {str(i): len(ids) for i, (_, _, ids, _) in enumerate(trace)}
    profiles = profile_paths(args)
    for target, probe in probes.items():
        load = "" if probe.get("load") is None else f"; load average {probe['load']:.1f} at its end"
        load += f"; {probe['preemptions']} preemptions (the rows misprice their recomputation)" \
            if probe.get("preemptions") else ""
        print(f"\n== {target}: {probe['wall_s']:.1f} s of wall time{load}; CPU seconds per wall second: "
              + ", ".join(f"{name} {cpu / probe['wall_s']:.2f}" for name, cpu in probe["cpu_s"].items()))
        for name, records in probe["records"].items():
            cost = CostModel(*sim_spec(profiles["colocated" if target == "colocated" else name.split("-")[0]]))
            print(format_check(f"real {name}", check_steps(shapes_from_records(records, prompt_lens), cost)))
        shapes = shapes_from_records(sim_steps[target], prompt_lens)
        cost = CostModel(*sim_spec(profiles["colocated" if target == "colocated" else "prefill"]))
        print(format_check(f"simulated {target} (every engine; priced again by the {target.replace('pd', 'prefill')} "
                           "profile)", check_steps(shapes, cost)))


def sim_table(name: str, trace, result) -> list[dict]:
    by_id = {m.request_id: m for m in result.requests}
    done = {str(i): argparse.Namespace(times=by_id[str(i)]) for i in range(len(trace))}
    return table(name, trace, done)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--chat-rate", type=float, default=2.0, help="short chats per second (Poisson)")
    p.add_argument("--chat-len", type=int, default=64, help="chat prompt tokens")
    p.add_argument("--chat-output", type=int, default=64, help="chat output tokens")
    p.add_argument("--long-len", type=int, default=2048, help="long prompt tokens")
    p.add_argument("--long-every", type=float, default=4.0, help="seconds between long prompts")
    p.add_argument("--long-output", type=int, default=16, help="long request output tokens")
    p.add_argument("--cores", type=int, default=2, help="colocated threads; the P/D engines share them out")
    p.add_argument("--pd", default="1P1D", help="the disaggregated split, xPyD (engines chosen as `serve --pd` does)")
    p.add_argument("--transport", choices=("shm", "dist"), default="shm")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="chunked prefill budget, both targets")
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--sim-profile", default=None, help="also simulate both targets: a cpu-local profile "
                   "(`iterserve calibrate --num-threads CORES`) for colocated")
    p.add_argument("--sim-pd-profile", default=None, help="the profile for one P/D engine (calibrated with its "
                   "threads while a second calibration runs beside it; default: --sim-profile)")
    p.add_argument("--sim-decode-profile", default=None, help="the profile for the P/D decode engines where they "
                   "differ (e.g. `calibrate --neighbor prefill:1:512`: timed beside a prefill engine's work); "
                   "default: --sim-pd-profile")
    p.add_argument("--check-steps", action="store_true", help="also price every real step with the profiles and "
                   "print, per engine and step kind, real vs priced time and the time between steps, beside the "
                   "simulator's steps and each process's CPU use, then simulate again with the time between "
                   "steps and the P/D front's CPU added to each engine's steps ('+ host' rows; needs --sim-profile)")
    p.add_argument("--fit-to-run", action="store_true", help="with --check-steps: also refit each role's profile "
                   "to the real run's own steps (each with the busy gap after it) and simulate again with those "
                   "('fit to run' rows): the simulator's error once its step prices are the run's")
    p.add_argument("--save-fits", default=None, metavar="DIR", help="with --fit-to-run: write the fitted profiles "
                   "as DIR/colocated.json, prefill.json and decode.json, for a later run's --sim-*-profile flags")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.check_steps and not args.sim_profile:
        p.error("--check-steps prices the real steps with --sim-profile: give it")
    if (args.fit_to_run or args.save_fits) and not args.check_steps:
        p.error("--fit-to-run and --save-fits fit the real steps --check-steps records: give it")
    trace = make_trace(args)
    print(f"$ python benchmarks/pd_mixed.py {shlex.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{sum(r[1] == 'chat' for r in trace)} chats of {args.chat_len}+{args.chat_output} tokens, "
          f"{sum(r[1] == 'long' for r in trace)} prompts of {args.long_len} tokens, over {args.duration:.0f} s")
    probes = {"colocated": {}, "pd": {}} if args.check_steps else {}
    rows = table(f"colocated ({args.cores} cores)", trace, run_colocated(args, trace, probes.get("colocated")))
    rows += table(f"{args.pd.upper()} ({pd_threads(args)} core each, {args.transport})", trace,
                  run_pd(args, trace, probes.get("pd")))
    sim_steps: dict = {}
    real_rows, host = list(rows), host_time(trace, probes) if probes else None
    runs = []
    if args.sim_profile:
        specs = {role: sim_spec(path) for role, path in profile_paths(args).items()}
        runs.append(("", specs))
        if host:
            runs.append((" + host", with_host(specs, host)))
        if args.fit_to_run:
            fits, fit_errors = fitted_to_run(trace, probes, specs)
            runs.append((" fit to run", fits))
            if args.save_fits:
                save_fits(args.save_fits, fits, fit_errors, profile_paths(args))
    for label, specs in runs:
        for real, sim in zip(real_rows, simulated(args, trace, specs, label, sim_steps if not label else None)):
            sim["err_tpot_p99"] = _err(sim["tpot_p99_s"], real["tpot_p99_s"])  # each row against its real twin
            sim["err_ttft_mean"] = _err(sim["ttft_mean_s"], real["ttft_mean_s"])
            rows.append(sim)
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    pct = lambda v: "" if v is None else f"{v:+.1%}"  # noqa: E731
    print(f"{'target':<36} {'kind':<5} {'n':>4} {'TPOT p50 ms':>12} {'TPOT p99 ms':>12} {'TTFT mean ms':>13}"
          f"{'2nd token ms':>13}" + (f"{'sim err p99':>13}{'sim err TTFT':>14}" if args.sim_profile else ""))
    for r in rows:
        print(f"{r['target']:<36} {r['kind']:<5} {r['n']:>4} {ms(r['tpot_p50_s']):>12} {ms(r['tpot_p99_s']):>12} "
              f"{ms(r['ttft_mean_s']):>13}{ms(r.get('second_token_mean_s')):>13}"
              f"{pct(r.get('err_tpot_p99')):>13}{pct(r.get('err_ttft_mean')):>14}")
    if probes:
        print_checks(args, trace, probes, sim_steps)
        print("unpriced host time per step added in the '+ host' rows: "
              + ", ".join(f"{role} {t * 1e3:.2f} ms" for role, t in host.items()))
        if args.fit_to_run:
            print("profiles fitted to the run's steps ('fit to run' rows), RMS relative error per step: "
                  + ", ".join(f"{role} {e:.1%}" for role, e in fit_errors.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=2)
    return 0


def _err(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else (sim - real) / real


if __name__ == "__main__":
    sys.exit(main())
