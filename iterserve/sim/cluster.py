"""Many simulated replicas behind one router: `iterserve simulate --replicas N --router POLICY`.

Each replica is a real Engine (its own Scheduler and KV manager) with a SimulatedExecutor and its
own VirtualClock, which reads the time that replica has reached: replicas step in parallel, so one
replica's step must not move another's clock. The driver is a discrete-event loop over one shared
timeline: the next event is either the next arrival (routed by the same policy object the Ray Serve
app uses) or the end of the earliest replica's step. A heap of busy replicas keyed by their clocks
keeps each event O(log replicas); the router's choice is O(replicas).
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass

from iterserve.bench.metrics import TargetResult, request_metrics
from iterserve.bench.runner import trace_params
from iterserve.bench.workload import Trace, materialize_prompts
from iterserve.router.policy import ReplicaLoad, Router, prompt_block_hashes


def load_of(stats) -> ReplicaLoad:
    """A replica's report from its EngineStats: the router's one view of an engine."""
    return ReplicaLoad(stats.num_running, stats.num_waiting + stats.num_swapped, stats.kv_usage)


@dataclass(slots=True)
class ClusterStats:
    requests_per_replica: list[int]
    prefix_queries: int  # prompt tokens looked up, all replicas
    prefix_hits: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def run_cluster(engines: list, trace: Trace, router: Router, name: str = "cluster") -> tuple[TargetResult, ClusterStats]:
    """Drive an open-loop trace through `engines` (each with its own virtual clock, all at 0)."""
    if trace.concurrency:
        raise ValueError("--replicas runs open-loop traces (offline or --request-rate), not --concurrency")
    if any(r.prompt_token_ids is None for r in trace.requests):
        materialize_prompts(trace, None)
    ids = [f"replica-{i}" for i in range(len(engines))]
    index = {rid: i for i, rid in enumerate(ids)}
    loads = {rid: ReplicaLoad() for rid in ids}
    block_size = engines[0].scheduler.block_size
    pending = deque(sorted(trace.requests, key=lambda r: r.arrival_time))
    by_id = {r.request_id: r for r in trace.requests}
    routed = [0] * len(engines)
    busy: list[tuple[float, int]] = []  # (the replica's clock, its index) for replicas with work
    done = {}
    while pending or busy:
        if pending and (not busy or pending[0].arrival_time <= busy[0][0]):
            r = pending.popleft()
            hashes = prompt_block_hashes(r.prompt_token_ids, block_size)
            rid = router.choose(hashes, loads)
            router.on_routed(rid, hashes)
            i = index[rid]
            engine = engines[i]
            was_idle = not engine.has_unfinished()
            engine.add_request(r.prompt_token_ids, trace_params(r), request_id=r.request_id, arrival_time=r.arrival_time)
            routed[i] += 1
            if was_idle:  # an idle replica's clock catches up with the arrival
                engine.clock.advance_to(r.arrival_time)
                heapq.heappush(busy, (engine.clock(), i))
            continue
        _, i = heapq.heappop(busy)
        engine = engines[i]
        before = engine.clock()
        outputs = engine.step()
        assert engine.clock() > before or not engine.has_unfinished(), "a replica with work made no progress"
        loads[ids[i]] = load_of(engine.stats)
        for out in outputs:
            if out.finished:
                router.on_finished(ids[i])
                r = by_id[out.request_id]
                done[r.request_id] = m = request_metrics(r.request_id, r.prompt_len, len(out.token_ids), out.times, 0.0)
                if out.finish_reason in ("error", "abort"):
                    m.e2e = None
        if engine.has_unfinished():
            heapq.heappush(busy, (engine.clock(), i))
    end = max((m.finished for m in done.values() if m.finished is not None), default=0.0)
    steps = sorted((s for e in engines for s in e.step_records), key=lambda s: s.end)
    stats = [e.stats for e in engines]
    result = TargetResult(name, [done[r.request_id] for r in trace.requests if r.request_id in done], end, steps,
                          sum(s.num_preemptions for s in stats))
    cluster = ClusterStats(routed, sum(s.num_prefix_queries for s in stats), sum(s.num_prefix_hits for s in stats))
    result.extra = {"replicas": len(engines), "requests_per_replica": routed,
                    "prefix_hit_rate": cluster.prefix_hit_rate}
    return result, cluster


def run_cluster_targets(trace: Trace, targets: list[str], engine_kwargs: dict, factory, replicas: int,
                        policy: str, seed: int = 0) -> list[TargetResult]:
    """Each target (continuous, static, with '+' overrides) as `replicas` engines behind a fresh router."""
    from iterserve.bench.runner import parse_engine_target
    from iterserve.router.policy import make_router
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    results = []
    for target in targets:
        base, overrides = parse_engine_target(target)
        engines = [factory(base, {**engine_kwargs, **overrides}) for _ in range(replicas)]
        start = time.perf_counter()
        result, _ = run_cluster(engines, trace, make_router(policy, seed), f"{target} x{replicas} {policy}")
        result.extra["wall_s"] = time.perf_counter() - start  # how long simulating took, not modelled time
        results.append(result)
    return results
