"""Prefill/decode disaggregation, simulated: `iterserve simulate --pd xPyD` (docs/disaggregation.md).

x prefill and y decode engines, each a real Engine (wrapped as in engine/disagg.py) on a
SimulatedExecutor with its own VirtualClock, on one event timeline as in sim/cluster.py. The events
are arrivals (to a prefill engine chosen by the router's PrefixAffinityRouter, as replicas are),
engine step ends, and KV transfers landing: a request's prompt blocks leave its prefill engine after
its first token and reach, after bytes / interconnect bandwidth, the decode engine the router's
LeastKVRouter picks when they land. `serve --pd xPyD` routes with the same two classes. Colocated
runs the same trace on x + y replicas (run_cluster), so both use the same number of devices.
"""
from __future__ import annotations

import heapq
from collections import deque

from iterserve.bench.metrics import Slo, TargetResult, request_metrics, summarize
from iterserve.bench.runner import trace_params
from iterserve.bench.workload import Trace, materialize_prompts
from iterserve.engine.disagg import DecodeEngine, PrefillEngine, parse_pd
from iterserve.kv_transfer.connector import KVTransfer
from iterserve.router.policy import LeastKVRouter, PrefixAffinityRouter, ReplicaLoad, make_router, prompt_block_hashes
from iterserve.sim.cluster import load_of


class _Link:
    """A connector that only records what was sent; the driver delivers it after the modelled time."""

    def __init__(self) -> None:
        self.sent: list = []
        self.inbox: deque = deque()

    def send(self, request_id, blocks, hashes, meta) -> None:
        self.sent.append(KVTransfer(request_id, blocks, hashes, meta))

    def receive(self, timeout: float = 0.0):
        return self.inbox.popleft() if self.inbox else None

    def close(self) -> None:
        """Nothing to release."""


def run_disagg(make_engine, num_prefill: int, num_decode: int, trace: Trace, link_bandwidth: float,
               name: str = "disaggregated", make_decode_engine=None) -> TargetResult:
    """Drive an open-loop trace through num_prefill + num_decode simulated engines (clocks at 0).
    make_decode_engine: builds the decode engines where they are priced apart (default: make_engine)."""
    if trace.concurrency:
        raise ValueError("--pd runs open-loop traces (offline or --request-rate), not --concurrency")
    if any(r.prompt_token_ids is None for r in trace.requests):
        materialize_prompts(trace, None)
    link = _Link()
    prefill = [PrefillEngine(make_engine(), link) for _ in range(num_prefill)]
    inboxes = [_Link() for _ in range(num_decode)]
    decode = [DecodeEngine((make_decode_engine or make_engine)(), inbox) for inbox in inboxes]
    sides = prefill + decode
    pending = deque(sorted(trace.requests, key=lambda r: r.arrival_time))
    by_id = {r.request_id: r for r in trace.requests}
    # the two policies `serve --pd xPyD` uses (engine/pd_front.py), the same objects
    router, ids = PrefixAffinityRouter(), [f"prefill-{i}" for i in range(num_prefill)]
    loads = {rid: ReplicaLoad() for rid in ids}
    decode_router, decode_ids = LeastKVRouter(), [f"decode-{j}" for j in range(num_decode)]
    block_size = prefill[0].engine.scheduler.block_size
    busy: list[tuple[float, int]] = []  # (clock, index into sides)
    landing: list[tuple[float, int, object]] = []  # (arrival time, seq, transfer)
    done, seq, transfer_s = {}, 0, 0.0

    def wake(i: int, t: float) -> None:
        side = sides[i]
        if not any(j == i for _, j in busy):
            side.engine.clock.advance_to(t)
            heapq.heappush(busy, (side.engine.clock(), i))

    while pending or busy or landing:
        t_arrival = pending[0].arrival_time if pending else float("inf")
        t_land = landing[0][0] if landing else float("inf")
        t_step = busy[0][0] if busy else float("inf")
        if t_arrival <= min(t_land, t_step):
            r = pending.popleft()
            hashes = prompt_block_hashes(r.prompt_token_ids, block_size)
            i = ids.index(router.choose(hashes, loads))
            router.on_routed(ids[i], hashes)
            prefill[i].add_request(r.prompt_token_ids, trace_params(r), request_id=r.request_id,
                                   arrival_time=r.arrival_time)
            wake(i, r.arrival_time)
        elif t_land <= t_step:
            t, _, transfer = heapq.heappop(landing)
            decode_loads = {d: load_of(e.engine.stats) for d, e in zip(decode_ids, decode)}
            j = decode_ids.index(decode_router.choose(transfer.hashes, decode_loads))
            decode_router.on_routed(decode_ids[j], transfer.hashes)
            inboxes[j].inbox.append(transfer)
            wake(num_prefill + j, t)
        else:
            _, i = heapq.heappop(busy)
            side = sides[i]
            before = side.engine.clock()
            for out in side.step():
                if i < num_prefill:
                    router.on_finished(ids[i])  # handed off, or done after one token
                elif out.finished:
                    decode_router.on_finished(decode_ids[i - num_prefill])
                if out.finished:
                    r = by_id[out.request_id]
                    done[r.request_id] = request_metrics(r.request_id, r.prompt_len, len(out.token_ids), out.times)
            if i < num_prefill:
                loads[ids[i]] = load_of(side.engine.stats)
            for transfer in link.sent:
                dt = transfer.blocks.nbytes / link_bandwidth
                transfer_s += dt
                heapq.heappush(landing, (side.engine.clock() + dt, seq, transfer))
                seq += 1
            link.sent.clear()
            assert side.engine.clock() > before or not side.has_unfinished(), "an engine with work made no progress"
            if side.has_unfinished():
                heapq.heappush(busy, (side.engine.clock(), i))
    end = max((m.finished for m in done.values() if m.finished is not None), default=0.0)
    steps = sorted((s for side in sides for s in side.engine.step_records), key=lambda s: s.end)
    result = TargetResult(name, [done[r.request_id] for r in trace.requests if r.request_id in done], end, steps,
                          sum(side.engine.stats.num_preemptions for side in sides))
    n = len(done)
    result.extra = {"prefill_engines": num_prefill, "decode_engines": num_decode,
                    "mean_transfer_s": transfer_s / n if n else 0.0,
                    "kv_transfers_recomputed": sum(d.engine.stats.num_kv_transfers_recomputed for d in decode)}
    return result


def attainment(result: TargetResult, slo: Slo, num_requests: int) -> float:
    """Share of the trace's requests that finished meeting every SLO."""
    return sum(slo.met(m) for m in result.requests if m.e2e is not None) / max(num_requests, 1)


def max_rate_per_device(run, devices: int, trace_at, slo: Slo, target: float, iters: int = 7) -> tuple[float, TargetResult]:
    """DistServe's goodput: the highest request rate per device at which `target` of the requests meet
    the SLO. Doubles the rate until it fails, then bisects; `run(trace)` simulates one trace."""
    def ok(rate):
        trace = trace_at(rate * devices)
        result = run(trace)
        return attainment(result, slo, len(trace.requests)) >= target, result
    lo, hi, best = 0.0, 0.25, None
    while True:
        passed, result = ok(hi)
        if not passed or hi > 1e4:
            break
        lo, hi, best = hi, hi * 2, result
    for _ in range(iters):
        mid = (lo + hi) / 2
        passed, result = ok(mid)
        if passed:
            lo, best = mid, result
        else:
            hi = mid
    return lo, best


def compare(make_engine, trace_at, splits: list[tuple[int, int]], link_bandwidth: float, slo: Slo,
            target: float = 0.9, router_policy: str = "prefix-affinity") -> list[dict]:
    """Colocated on x + y replicas vs each xPyD split: the goodput per device (max_rate_per_device)
    and the latencies at that rate."""
    from iterserve.sim.cluster import run_cluster
    rows = []
    for n in sorted({x + y for x, y in splits}):
        def colocated(trace, n=n):
            return run_cluster([make_engine() for _ in range(n)], trace, make_router(router_policy), f"colocated x{n}")[0]
        rows.append(_row(*max_rate_per_device(colocated, n, trace_at, slo, target), slo, n))
    for x, y in splits:
        def disagg(trace, x=x, y=y):
            return run_disagg(make_engine, x, y, trace, link_bandwidth, f"{x}P{y}D")
        rows.append(_row(*max_rate_per_device(disagg, x + y, trace_at, slo, target), slo, x + y))
    return rows


def _row(rate: float, result: TargetResult | None, slo: Slo, devices: int) -> dict:
    if result is None:
        return {"name": "-", "devices": devices, "goodput_per_device": 0.0}
    s = summarize(result, slo, per_request=False)
    return {"name": result.name, "devices": devices, "goodput_per_device": rate,
            "slo_attainment": attainment(result, slo, len(result.requests)),
            "ttft_mean_s": s["ttft_s"]["mean"], "ttft_p99_s": s["ttft_s"]["p99"],
            "tpot_p50_s": s["tpot_s"]["p50"], "tpot_p99_s": s["tpot_s"]["p99"], "extra": result.extra}


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'target':<16} {'devices':>7} {'goodput/dev':>12} {'SLO met':>8} {'TTFT mean':>10} "
             f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}   (latencies at the goodput rate)"]
    for r in rows:
        if "ttft_mean_s" not in r:
            lines.append(f"{r['name']:<16} {r['devices']:>7} {'0 (SLO never met)':>12}")
            continue
        lines.append(f"{r['name']:<16} {r['devices']:>7} {r['goodput_per_device']:>12.3f} {r['slo_attainment']:>8.1%} "
                     f"{_ms(r['ttft_mean_s']):>10} {_ms(r['ttft_p99_s']):>9} {_ms(r['tpot_p50_s']):>9} "
                     f"{_ms(r['tpot_p99_s']):>9}")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}ms"


def run_pd(args, make_engine, trace_at, link_bandwidth: float, slo: Slo) -> list[dict]:
    """`simulate --pd xPyD` (that split) or `--pd search --pd-devices N` (every split of N devices)."""
    if slo.ttft is None or slo.tpot is None:
        raise ValueError("--pd compares goodput under a TTFT and a TPOT SLO: give --slo-ttft and --slo-tpot")
    if args.pd == "search":
        n = args.pd_devices
        if n < 2:
            raise ValueError(f"--pd search needs --pd-devices >= 2, got {n}")
        splits = [(x, n - x) for x in range(1, n)]
    else:
        splits = [parse_pd(args.pd)]
    rows = compare(make_engine, trace_at, splits, link_bandwidth, slo, args.pd_attainment)
    print(f"goodput: the highest request rate per device at which {args.pd_attainment:.0%} of requests meet "
          f"TTFT <= {_ms(slo.ttft)} and TPOT <= {_ms(slo.tpot)}; KV link {link_bandwidth / 1e9:.0f} GB/s")
    print(format_rows(rows))
    split_rows = [r for r in rows[len({x + y for x, y in splits}):] if "ttft_mean_s" in r]
    if split_rows:
        best = max(split_rows, key=lambda r: r["goodput_per_device"])
        base = next(r for r in rows if r["devices"] == best["devices"])
        ratio = best["goodput_per_device"] / base["goodput_per_device"] if base["goodput_per_device"] else float("inf")
        print(f"best split {best['name']}: {ratio:.2f}x colocated's goodput per device at {best['devices']} devices")
    return rows
