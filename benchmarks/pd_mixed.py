"""Colocated vs P/D (1P1D or any xPyD) on a mixed trace: steady chats plus long prompts every few seconds.

Colocated is one engine with --cores threads; --pd xPyD (default 1P1D) is x prefill and y decode
processes (server/pd_engines.py) with cores/(x+y) threads each, joined by KV connectors (--transport). Both see
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


def run_colocated(args, trace) -> dict[str, object]:
    from iterserve.engine.engine import Engine
    engine = Engine(EngineConfig(**config(args), num_threads=args.cores))
    engine.add_request(trace[0][2][:8], params(2))  # warm-up: one-time costs out of the measurement
    while engine.has_unfinished():
        engine.step()
    done, i, start = {}, 0, time.monotonic()
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
    return done


def run_pd(args, trace) -> dict[str, object]:
    from iterserve.server.pd_engines import PDEngines
    x, y = parse_pd(args.pd)
    pd = PDEngines({**config(args), "num_threads": pd_threads(args)}, args.transport, x, y)
    try:
        pd.add_request(trace[0][2][:8], params(2), "warm-up")
        while pd.has_unfinished():
            pd.get_outputs(0.05)
        done, i, start = {}, 0, time.monotonic()
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
        return done
    finally:
        pd.close()


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
        rows.append({"target": name, "kind": kind, "n": len(outs), "tpot_p50_s": tpot["p50"],
                     "tpot_p99_s": tpot["p99"], "ttft_mean_s": ttft["mean"]})
    return rows


def simulated(args, trace) -> list[dict]:
    """The same trace through the simulator: colocated priced by --sim-profile (calibrated with --cores
    threads), the P/D engines by --sim-pd-profile (one engine's threads, calibrated beside a second
    calibration, as the engines run beside each other), the KV hand-off at the host link's bandwidth."""
    from iterserve.bench.workload import Trace, TraceRequest
    from iterserve.sim.cli import make_engine, resolve, simulate_trace
    from iterserve.sim.disagg import run_disagg

    def requests() -> Trace:
        return Trace([TraceRequest(str(i), len(ids), n, t, ids) for i, (t, _, ids, n) in enumerate(trace)])

    def spec(path: str):
        return resolve(argparse.Namespace(hardware="cpu-local", hardware_profile=path, dtype_bytes=None, model=None))
    sim_config = EngineConfig(**config(args), model=None)
    model, hw = spec(args.sim_profile)
    rows = sim_table(f"sim colocated ({args.cores} cores)", trace, simulate_trace(requests(), sim_config, model, hw))
    model, hw = spec(args.sim_pd_profile or args.sim_profile)
    x, y = parse_pd(args.pd)
    result = run_disagg(lambda: make_engine(sim_config, model, hw), x, y, requests(), hw.host_link_bandwidth)
    return rows + sim_table(f"sim {args.pd.upper()}", trace, result)


def sim_table(name: str, trace, result) -> list[dict]:
    by_id = {m.request_id: m for m in result.requests}
    done = {str(i): argparse.Namespace(times=by_id[str(i)]) for i in range(len(trace))}
    return table(name, trace, done)


def main(argv: list[str] | None = None) -> int:
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
    args = p.parse_args(argv)
    trace = make_trace(args)
    print(f"$ python benchmarks/pd_mixed.py {shlex.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{sum(r[1] == 'chat' for r in trace)} chats of {args.chat_len}+{args.chat_output} tokens, "
          f"{sum(r[1] == 'long' for r in trace)} prompts of {args.long_len} tokens, over {args.duration:.0f} s")
    rows = table(f"colocated ({args.cores} cores)", trace, run_colocated(args, trace))
    rows += table(f"{args.pd.upper()} ({pd_threads(args)} core each, {args.transport})", trace, run_pd(args, trace))
    if args.sim_profile:  # rows in the real rows' order, so each is compared with its twin
        for real, sim in zip(list(rows), simulated(args, trace)):
            sim["err_tpot_p99"] = _err(sim["tpot_p99_s"], real["tpot_p99_s"])
            sim["err_ttft_mean"] = _err(sim["ttft_mean_s"], real["ttft_mean_s"])
            rows.append(sim)
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    pct = lambda v: "" if v is None else f"{v:+.1%}"  # noqa: E731
    print(f"{'target':<32} {'kind':<5} {'n':>4} {'TPOT p50 ms':>12} {'TPOT p99 ms':>12} {'TTFT mean ms':>13}"
          + (f"{'sim err p99':>13}{'sim err TTFT':>14}" if args.sim_profile else ""))
    for r in rows:
        print(f"{r['target']:<32} {r['kind']:<5} {r['n']:>4} {ms(r['tpot_p50_s']):>12} {ms(r['tpot_p99_s']):>12} "
              f"{ms(r['ttft_mean_s']):>13}{pct(r.get('err_tpot_p99')):>13}{pct(r.get('err_ttft_mean')):>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=2)
    return 0


def _err(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else (sim - real) / real


if __name__ == "__main__":
    sys.exit(main())
