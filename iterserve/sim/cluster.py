"""Many simulated replicas behind one router: `iterserve simulate --replicas N --router POLICY`.

Each replica is a real Engine (its own Scheduler and KV manager) with a SimulatedExecutor and its
own VirtualClock, which reads the time that replica has reached: replicas step in parallel, so one
replica's step must not move another's clock. Replicas meet only when a request is routed, so the
driver walks the arrivals in time order: it steps every replica whose clock is before the next
arrival (a heap of busy replicas keyed by their clocks, O(log replicas) a step), then routes the
arrival with the same policy object the Ray Serve app uses (O(replicas)). The replicas may be split
into groups in worker processes (`--sim-workers`), which step at the same time between arrivals.
"""
from __future__ import annotations

import gc
import heapq
import math
import multiprocessing
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from iterserve.bench.metrics import RequestMetrics, TargetResult, request_metrics
from iterserve.bench.runner import trace_params
from iterserve.bench.workload import Trace, TraceRequest, materialize_prompts
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


@dataclass(frozen=True, slots=True)
class SharedHost:
    """The replicas of a group on one host of `cores` cores (a CPU test bed), each stepping on `threads`
    threads, beside `background_cores` of other work (the load generator, the HTTP front end, the
    replicas' own serving threads, in CPU seconds per second). That work sleeps most of the time and runs
    as soon as it wakes (the kernel's scheduler favours a task that slept), so the busy replicas share
    what it leaves: a step priced at t takes t * max(1, threads x busy replicas / (cores - background)).
    A profile calibrated with every replica's threads busy at once (side-by-side calibrations) prices
    the share of 1."""

    cores: float
    threads: int = 1
    background_cores: float = 0.0

    def stretch(self, busy_replicas: int) -> float:
        free = max(self.cores - self.background_cores, 1e-3)
        return max(1.0, self.threads * busy_replicas / free)


class ReplicaGroup:
    """Some of the cluster's replicas, stepped up to a time. Replicas interact only through routing,
    so between two arrivals each one runs on its own; the groups may live in worker processes."""

    def __init__(self, engines: list, first_index: int = 0, host: SharedHost | None = None) -> None:
        self.engines = engines
        self.host = host
        self.first, self.count = first_index, len(engines)
        self.busy: list[tuple[float, int]] = []  # (the replica's clock, its local index), replicas with work
        self.arrivals: list[tuple[float, int, int, TraceRequest]] = []  # routed, not yet arrived
        self.num_routed = 0
        self.done: dict[str, RequestMetrics] = {}

    def add(self, i: int, r: TraceRequest) -> None:
        """A request routed to replica i: it joins the replica when the replica's clock reaches its arrival."""
        heapq.heappush(self.arrivals, (r.arrival_time, self.num_routed, i - self.first, r))
        self.num_routed += 1

    def _arrive(self) -> None:
        _, _, k, r = heapq.heappop(self.arrivals)
        engine = self.engines[k]
        was_idle = not engine.has_unfinished()
        engine.add_request(r.prompt_token_ids, trace_params(r), request_id=r.request_id, arrival_time=r.arrival_time)
        if was_idle:  # an idle replica's clock catches up with the arrival
            engine.clock.advance_to(r.arrival_time)
            heapq.heappush(self.busy, (engine.clock(), k))

    def advance(self, until: float, prompt_lens: dict[str, int]) -> tuple[dict[int, ReplicaLoad], list[int]]:
        """Arrivals and steps in time order up to `until` (an arrival at a step's time goes first);
        returns the new loads of the replicas that stepped, and the replica of each finished request."""
        loads, finished = {}, []
        busy, arrivals = self.busy, self.arrivals
        while True:
            if arrivals and arrivals[0][0] < until and (not busy or arrivals[0][0] <= busy[0][0]):
                self._arrive()
                continue
            if not busy or busy[0][0] >= until:
                break
            _, k = heapq.heappop(busy)
            engine = self.engines[k]
            if self.host is not None:  # the replicas still in `busy` are mid-step now
                engine.executor.time_scale = self.host.stretch(len(busy) + 1)
            before = engine.clock()
            outputs = engine.step(unfinished=False)  # only finished requests' outputs are read
            assert engine.clock() > before or not engine.has_unfinished(), "a replica with work made no progress"
            loads[self.first + k] = load_of(engine.stats)
            for out in outputs:
                if out.finished:
                    finished.append(self.first + k)
                    m = request_metrics(out.request_id, prompt_lens[out.request_id], len(out.token_ids), out.times, 0.0)
                    if out.finish_reason in ("error", "abort"):
                        m.e2e = None
                    self.done[out.request_id] = m
            if engine.has_unfinished():
                heapq.heappush(busy, (engine.clock(), k))
        return loads, finished

    def results(self) -> tuple[dict, list, list]:
        """(metrics by request id, step records, EngineStats of each replica), once all have drained."""
        return self.done, [s for e in self.engines for s in e.step_records], [e.stats for e in self.engines]


    # the driver's two-phase call, so that groups in worker processes step at the same time
    def start_advance(self, until: float, prompt_lens: dict[str, int]) -> None:
        self.pending = self.advance(until, prompt_lens)

    def finish_advance(self) -> tuple[dict[int, ReplicaLoad], list[int]]:
        return self.pending


class WorkerGroup:
    """A ReplicaGroup in a forked worker process, driven over a pipe (fork: the engine factory,
    whatever closure it is, is inherited, never pickled)."""

    def __init__(self, make_engine: Callable[[], object], first: int, count: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_group_worker, args=(child, make_engine, first, count), daemon=True)
        self.process.start()
        self.first, self.count = first, count

    def add(self, i: int, r: TraceRequest) -> None:
        self.conn.send(("add", i, r))

    def start_advance(self, until: float, prompt_lens: dict[str, int]) -> None:
        self.conn.send(("advance", until))

    def finish_advance(self) -> tuple[dict[int, ReplicaLoad], list[int]]:
        return _reply(self.conn.recv())

    def results(self) -> tuple[dict, list, list]:
        self.conn.send(("results",))
        out = _reply(self.conn.recv())
        self.process.join()
        return out


def _reply(message):
    if isinstance(message, BaseException):
        raise message
    return message


def _group_worker(conn, make_engine: Callable[[], object], first: int, count: int) -> None:
    gc.disable()  # see no_cyclic_gc; the process ends with the run
    try:
        group = ReplicaGroup([make_engine() for _ in range(count)], first)
        prompt_lens: dict[str, int] = {}
        while True:
            command, *args = conn.recv()
            if command == "add":
                prompt_lens[args[1].request_id] = args[1].prompt_len
                group.add(*args)
            elif command == "advance":
                conn.send(group.advance(args[0], prompt_lens))
            else:
                conn.send(group.results())
                return
    except Exception as e:  # noqa: BLE001 - the driver re-raises it
        conn.send(e)


def run_cluster(engines: list, trace: Trace, router: Router, name: str = "cluster",
                report_interval: float = 0.0, host: SharedHost | None = None) -> tuple[TargetResult, ClusterStats]:
    """Drive an open-loop trace through `engines` (each with its own virtual clock, all at 0).
    report_interval: see _drive_arrivals. host: the engines share one host's cores (default: each has
    its own)."""
    return _drive([ReplicaGroup(engines, host=host)], len(engines), engines[0].scheduler.block_size, trace, router,
                  name, report_interval)


def run_cluster_parallel(make_engine: Callable[[], object], replicas: int, workers: int, trace: Trace,
                         router: Router, name: str = "cluster",
                         report_interval: float = 0.0) -> tuple[TargetResult, ClusterStats]:
    """The same run with the replicas split over `workers` processes: the same figures (replicas
    only meet where the router reads their loads, and there the driver waits for every group), in
    less wall time on many cores: the longer the report interval, the less they wait."""
    block_size = make_engine().scheduler.block_size
    sizes = [replicas // workers + (k < replicas % workers) for k in range(workers)]
    firsts = [sum(sizes[:k]) for k in range(workers)]
    groups = [WorkerGroup(make_engine, first, n) for first, n in zip(firsts, sizes) if n]
    try:
        return _drive(groups, replicas, block_size, trace, router, name, report_interval)
    finally:
        for g in groups:
            if g.process.is_alive():  # the run failed before the group was done
                g.process.kill()


@contextmanager
def no_cyclic_gc():
    """The event loop makes millions of short-lived objects (plans, outputs) and frees them by reference
    count: it makes no reference cycles. With the collector on, each collection re-scans the growing
    results and the replicas' block pools for cycles that are not there."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _drive(groups: list, replicas: int, block_size: int, trace: Trace, router: Router,
           name: str, report_interval: float = 0.0) -> tuple[TargetResult, ClusterStats]:
    with no_cyclic_gc():
        return _drive_arrivals(groups, replicas, block_size, trace, router, name, report_interval)


def _drive_arrivals(groups: list, replicas: int, block_size: int, trace: Trace, router: Router,
                    name: str, report_interval: float = 0.0) -> tuple[TargetResult, ClusterStats]:
    """Route each request on the replicas' loads as of the latest report: with report_interval 0, as of
    its own arrival; otherwise as of the start of its interval (a real router reads polled reports:
    Ray Serve's every 0.5 s), its own routing counts always current."""
    if report_interval < 0:
        raise ValueError(f"the load report interval must be >= 0, got {report_interval}")
    if trace.concurrency:
        raise ValueError("--replicas runs open-loop traces (offline or --request-rate), not --concurrency")
    if any(r.prompt_token_ids is None for r in trace.requests):
        materialize_prompts(trace, None)
    ids = [f"replica-{i}" for i in range(replicas)]
    index = {rid: i for i, rid in enumerate(ids)}
    owner = [g for g in groups for _ in range(g.count)]
    loads = {rid: ReplicaLoad() for rid in ids}
    prompt_lens = {r.request_id: r.prompt_len for r in trace.requests}
    routed = [0] * replicas

    def advance(until: float) -> None:
        for g in groups:
            g.start_advance(until, prompt_lens)
        for g in groups:
            changed, finished = g.finish_advance()
            for i, load in changed.items():
                loads[ids[i]] = load
            for i in finished:
                router.on_finished(ids[i])

    next_report = -math.inf
    for r in sorted(trace.requests, key=lambda r: r.arrival_time):
        if r.arrival_time >= next_report:
            advance(r.arrival_time)
            next_report = r.arrival_time + report_interval
        hashes = prompt_block_hashes(r.prompt_token_ids, block_size)
        rid = router.choose(hashes, loads)
        router.on_routed(rid, hashes)
        routed[index[rid]] += 1
        owner[index[rid]].add(index[rid], r)
    advance(math.inf)
    done, steps, stats = {}, [], []
    for g in groups:
        d, s, st = g.results()
        done.update(d)
        steps += s
        stats += st
    end = max((m.finished for m in done.values() if m.finished is not None), default=0.0)
    result = TargetResult(name, [done[r.request_id] for r in trace.requests if r.request_id in done], end,
                          sorted(steps, key=lambda s: s.end), sum(s.num_preemptions for s in stats))
    cluster = ClusterStats(routed, sum(s.num_prefix_queries for s in stats), sum(s.num_prefix_hits for s in stats))
    result.extra = {"replicas": replicas, "requests_per_replica": routed, "prefix_hit_rate": cluster.prefix_hit_rate}
    return result, cluster


def run_cluster_targets(trace: Trace, targets: list[str], engine_kwargs: dict, factory, replicas: int,
                        policy: str, seed: int = 0, workers: int = 1,
                        report_interval: float = 0.0) -> list[TargetResult]:
    """Each target (continuous, static, with '+' overrides) as `replicas` engines behind a fresh router."""
    from iterserve.bench.runner import parse_engine_target
    from iterserve.router.policy import make_router
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    results = []
    for target in targets:
        base, overrides = parse_engine_target(target)
        kw = {**engine_kwargs, **overrides}
        router, name = make_router(policy, seed), f"{target} x{replicas} {policy}"
        start = time.perf_counter()
        if workers > 1:
            result, _ = run_cluster_parallel(lambda: factory(base, kw), replicas, workers, trace, router, name,
                                             report_interval)
        else:
            result, _ = run_cluster([factory(base, kw) for _ in range(replicas)], trace, router, name,
                                    report_interval)
        result.extra["wall_s"] = time.perf_counter() - start  # how long simulating took, not modelled time
        results.append(result)
    return results
