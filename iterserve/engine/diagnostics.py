"""Capacity diagnostics: read the recent window of steps and finished requests and say, with numbers,
what limits the deployment and which knob to turn (docs/operations.md lists every condition).

The engine thread only appends to two bounded deques (`observe_step`, `observe_finished`: O(1), no
analysis). `evaluate` runs elsewhere (the server's diagnostics task, `iterserve diagnose`): it reads
the last `window_s` seconds, checks each condition, and reports a condition once when it starts to
hold (a log line; the server also sets a gauge and serves the list). A recommendation that needs a
what-if (an SLO missed) asks `whatif`, which replays the window through the simulator. Torch-free.
"""
from __future__ import annotations

import logging
import math
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from iterserve.engine.stats import EngineStats
    from iterserve.outputs import RequestOutput, StepRecord

logger = logging.getLogger("iterserve.diagnostics")

KINDS = ("preemption", "swap", "kv_pressure", "overload", "prefix_hit_rate", "slo_ttft", "slo_tpot")


@dataclass(slots=True)
class StepSample:
    """What one engine step leaves for the diagnostics (from its StepRecord and EngineStats)."""

    time: float  # end of the step, on the engine's clock
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    num_batched_tokens: int
    num_preempted: int  # requests preempted in this step
    num_prefix_queries: int = 0  # since start (a counter): the window takes differences
    num_prefix_hits: int = 0

    @classmethod
    def of(cls, record: "StepRecord", stats: "EngineStats") -> "StepSample":
        """From the engine's StepRecord and EngineStats of one step."""
        return cls(record.end, stats.num_running, stats.num_waiting, stats.num_swapped, stats.kv_usage,
                   record.num_batched_tokens, len(record.preempted_ids), stats.num_prefix_queries,
                   stats.num_prefix_hits)


@dataclass(slots=True)
class StartedRequest:
    """A request that got its first token: what a what-if needs of one still running."""

    request_id: str
    arrival: float
    prompt_len: int


@dataclass(slots=True)
class FinishedRequest:
    request_id: str
    time: float  # when it finished, on the engine's clock
    arrival: float
    prompt_len: int
    output_len: int
    ttft: float | None
    tpot: float | None
    num_preemptions: int

    @classmethod
    def of(cls, out: "RequestOutput") -> "FinishedRequest":
        """From a finished RequestOutput (its timestamps are the engine's)."""
        t = out.times
        return cls(out.request_id, t.finished if t.finished is not None else t.arrival, t.arrival,
                   out.num_prompt_tokens, len(out.token_ids), t.ttft, t.tpot, len(t.preempted))


@dataclass(slots=True)
class Capacity:
    """The settings the recommendations speak about."""

    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    bytes_per_block: int | None = None  # None: recommend --num-kv-blocks instead of --kv-cache-memory
    watermark: float = 0.01
    prefix_caching: bool = True
    preemption_mode: str = "recompute"

    @property
    def pool_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @classmethod
    def of_engine(cls, engine) -> "Capacity":
        cache, sched = engine.config.cache_config, engine.config.scheduler_config
        spec = engine.executor.kv_cache_spec
        return cls(engine.stats.num_kv_blocks, spec.block_size, sched.max_num_seqs, sched.max_num_batched_tokens,
                   spec.bytes_per_block, cache.watermark, cache.enable_prefix_caching, sched.preemption_mode)


@dataclass(slots=True)
class Thresholds:
    """When a condition counts as holding. Defaults err towards saying less: a diagnostic must be worth reading."""

    window_s: float = 300.0
    evaluate_every_s: float = 5.0  # how often the server evaluates (off the engine thread)
    min_requests: int = 20  # finished requests in the window before request-based checks speak
    min_steps: int = 50  # steps in the window before step-based checks speak
    hold_s: float = 60.0  # a diagnostic clears only after its condition has not held for this long
    preempted_share: float = 0.05  # of finished requests, preempted at least once
    swapped_step_share: float = 0.10  # of steps, with a request swapped out to host memory
    kv_full: float = 0.95  # KV usage counted as full ...
    kv_full_share: float = 0.5  # ... with requests waiting, in this share of steps
    min_queue_growth: int = 8  # the waiting queue grew by at least this many requests over the window
    prefix_hit_rate: float = 0.10  # of prompt tokens looked up
    min_prefix_queries: int = 10_000  # prompt tokens looked up in the window before the check speaks
    slo_violation_share: float = 0.10  # requests over an SLO (p90 over it)


@dataclass(slots=True)
class Slo:
    ttft: float | None = None
    tpot: float | None = None


@dataclass(slots=True)
class Diagnostic:
    kind: str
    message: str  # the cause, the numbers, the knob: one paragraph an operator can act on
    knobs: dict = field(default_factory=dict)  # recommended settings by flag name (dashes), e.g. max-num-seqs
    observed: dict = field(default_factory=dict)  # the figures the message was computed from
    since: float = 0.0  # engine clock when it started to hold

    def as_dict(self) -> dict:
        return asdict(self)


class WhatIf(Protocol):
    """Replays the window's traffic through the simulator and returns the recommended settings
    (keys: max_num_seqs, max_num_batched_tokens, ttft_p99, tpot_p99, met) or None."""

    def __call__(self, window: "Window", capacity: Capacity, slo: Slo) -> dict | None: ...


@dataclass(slots=True)
class Window:
    """The part of the recent history an evaluation looks at."""

    steps: list[StepSample]
    finished: list[FinishedRequest]
    start: float
    end: float
    started: list[StartedRequest] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return max(self.end - self.start, 1e-9)


class Diagnostics:
    def __init__(self, capacity: Capacity, slo: Slo | None = None, thresholds: Thresholds | None = None,
                 whatif: WhatIf | None = None, max_steps: int = 100_000, max_finished: int = 20_000,
                 on_change: Callable[[dict[str, Diagnostic]], None] | None = None) -> None:
        self.capacity = capacity
        self.slo = slo or Slo()
        self.thresholds = thresholds or Thresholds()
        self.whatif = whatif
        self.on_change = on_change  # called after an evaluation that changed the active set
        self.active: dict[str, Diagnostic] = {}
        self.last_evaluated: float | None = None
        self._steps: deque[StepSample] = deque(maxlen=max_steps)
        self._finished: deque[FinishedRequest] = deque(maxlen=max_finished)
        self._started: deque[StartedRequest] = deque(maxlen=max_finished)
        self._lock = threading.Lock()  # the engine thread appends while another evaluates
        self._last_step = -1
        self._held: dict[str, float] = {}  # kind -> when its condition last held

    # ---- the engine thread: O(1) -------------------------------------------------------------
    def on_step(self, stats: "EngineStats", outputs: "list[RequestOutput]") -> None:
        """After each engine step (or an abort: then no new step record), with the EngineStats and outputs."""
        if stats.num_steps != self._last_step and stats.last_step is not None:
            self._last_step = stats.num_steps
            self.observe_step(StepSample.of(stats.last_step, stats))
        for out in outputs:
            if out.new_token_ids and len(out.new_token_ids) == len(out.token_ids):
                self.observe_started(StartedRequest(out.request_id, out.times.arrival, out.num_prompt_tokens))
            if out.finished and out.finish_reason in ("stop", "length"):
                self.observe_finished(FinishedRequest.of(out))

    def observe_started(self, request: StartedRequest) -> None:
        with self._lock:
            self._started.append(request)

    def observe_step(self, sample: StepSample) -> None:
        with self._lock:
            self._steps.append(sample)

    def observe_finished(self, request: FinishedRequest) -> None:
        with self._lock:
            self._finished.append(request)

    # ---- off the hot path ---------------------------------------------------------------------
    def window(self, now: float | None = None) -> Window:
        with self._lock:
            steps, finished, started = list(self._steps), list(self._finished), list(self._started)
        if now is None:
            now = max(steps[-1].time if steps else 0.0, finished[-1].time if finished else 0.0)
        start = now - self.thresholds.window_s
        steps = [s for s in steps if s.time >= start]
        finished = [r for r in finished if r.time >= start]
        started = [r for r in started if r.arrival >= start]
        first = min([s.time for s in steps[:1]] + [r.arrival for r in finished[:1]], default=now)
        return Window(steps, finished, max(start, first), now, started)

    def evaluate(self, now: float | None = None) -> dict[str, Diagnostic]:
        """Check every condition over the window; log each that starts (or stops) holding."""
        w = self.window(now)
        found: dict[str, Diagnostic] = {}
        for check in (self._preemption, self._swap, self._kv_pressure, self._overload, self._prefix_hits,
                      self._slo):
            for d in check(w):
                found[d.kind] = d
        for kind, d in found.items():
            if kind in self.active:  # still holding: keep the first report (and its what-if)
                found[kind] = self.active[kind]
            else:
                d.since = w.end
                logger.warning("diagnostic %s: %s", kind, d.message)
            self._held[kind] = w.end
        for kind in set(self.active) - set(found):
            if w.end - self._held.get(kind, w.end) < self.thresholds.hold_s:
                found[kind] = self.active[kind]  # a blip under the threshold does not clear it
            else:
                logger.info("diagnostic %s cleared", kind)
        changed = set(found) != set(self.active)
        self.active, self.last_evaluated = found, w.end
        if changed and self.on_change is not None:
            self.on_change(found)
        return found

    def report(self) -> dict:
        return {"window_s": self.thresholds.window_s, "evaluated_at": self.last_evaluated,
                "slo": asdict(self.slo), "capacity": asdict(self.capacity),
                "diagnostics": [d.as_dict() for d in self.active.values()]}

    # ---- the conditions -----------------------------------------------------------------------
    def _preemption(self, w: Window) -> list[Diagnostic]:
        t, c = self.thresholds, self.capacity
        done = w.finished
        if len(done) < t.min_requests:
            return []
        share = sum(r.num_preemptions > 0 for r in done) / len(done)
        if share < t.preempted_share:
            return []
        need = kv_tokens_per_request(done)
        seqs = max(1, int(c.pool_tokens * (1 - c.watermark) // need))
        blocks = math.ceil(c.max_num_seqs * need / c.block_size / (1 - c.watermark))
        per_seat = c.pool_tokens / c.max_num_seqs
        msg = (f"{share:.0%} of requests preempted in the last {_span(w)}: the KV pool holds ~{per_seat:,.0f} "
               f"tokens per running request at max-num-seqs={c.max_num_seqs} but running requests reach "
               f"{need:,.0f} on average; {self._raise_kv(blocks)} or lower --max-num-seqs to {seqs}")
        return [Diagnostic("preemption", msg, {**self._kv_knob(blocks), "max-num-seqs": seqs},
                           {"preempted_share": share, "requests": len(done), "kv_tokens_per_seat": per_seat,
                            "kv_tokens_per_request": need})]

    def _swap(self, w: Window) -> list[Diagnostic]:
        t, c = self.thresholds, self.capacity
        if len(w.steps) < t.min_steps or len(w.finished) < t.min_requests:
            return []
        swapped = [s.num_swapped for s in w.steps]
        share = sum(n > 0 for n in swapped) / len(swapped)
        if share < t.swapped_step_share:
            return []
        events = sum(s.num_preempted for s in w.steps)
        need = kv_tokens_per_request(w.finished)
        blocks = math.ceil(c.max_num_seqs * need / c.block_size / (1 - c.watermark))
        msg = (f"requests were swapped out to host memory in {share:.0%} of the steps of the last {_span(w)} "
               f"({events} preemptions, up to {max(swapped)} swapped at once): each one copies its KV over the "
               f"host link twice and stalls until it is back; {self._raise_kv(blocks)} so the batch fits on the device")
        return [Diagnostic("swap", msg, self._kv_knob(blocks),
                           {"swapped_step_share": share, "preemptions": events, "max_swapped": max(swapped)})]

    def _kv_pressure(self, w: Window) -> list[Diagnostic]:
        t, c = self.thresholds, self.capacity
        if len(w.steps) < t.min_steps:
            return []
        full = [s for s in w.steps if s.kv_usage >= t.kv_full and s.num_waiting > 0]
        share = len(full) / len(w.steps)
        if share < t.kv_full_share:
            return []
        running = sum(s.num_running for s in full) / len(full)
        waiting = sum(s.num_waiting for s in full) / len(full)
        if running >= c.max_num_seqs:  # the seats are the limit, not the pool: that is overload
            return []
        blocks = math.ceil(c.num_kv_blocks * c.max_num_seqs / max(running, 1))
        msg = (f"KV usage was over {t.kv_full:.0%} with requests waiting in {share:.0%} of the steps of the last "
               f"{_span(w)}: ~{running:.0f} of {c.max_num_seqs} seats were in use while ~{waiting:.0f} requests "
               f"waited, so the pool, not max-num-seqs, limits the batch; {self._raise_kv(blocks)} to fill the seats")
        return [Diagnostic("kv_pressure", msg, self._kv_knob(blocks),
                           {"kv_full_share": share, "mean_running": running, "mean_waiting": waiting})]

    def _overload(self, w: Window) -> list[Diagnostic]:
        t, c = self.thresholds, self.capacity
        if len(w.steps) < t.min_steps:
            return []
        q = [s.num_waiting + s.num_swapped for s in w.steps]
        growth = q[-1] - min(q[: max(1, len(q) // 10)])  # from the window's first tenth to its end
        if growth < t.min_queue_growth or _slope([s.time for s in w.steps], q) <= 0:
            return []
        served = len(w.finished) / w.duration
        # arrivals: those that started in the window plus the queue's growth (the rest are still queued)
        arriving = max(served, len(w.started) / w.duration) + growth / w.duration
        running = sum(s.num_running for s in w.steps) / len(w.steps)
        kv = sum(s.kv_usage for s in w.steps) / len(w.steps)
        replicas = math.ceil(arriving / served) if served > 0 else None
        knobs = {"replicas": replicas} if replicas else {}
        fix = f"serve with about {replicas} replicas in all" if replicas else "add replicas"
        if running >= 0.9 * c.max_num_seqs and kv < 0.8 and w.finished:  # the seats, not the pool, are the limit
            seats = min(math.ceil(c.max_num_seqs * arriving / max(served, 1e-9)),
                        int(c.pool_tokens * (1 - c.watermark) // kv_tokens_per_request(w.finished)))
            if seats > c.max_num_seqs:
                knobs["max-num-seqs"] = seats
                fix = f"raise --max-num-seqs to {seats} (the KV pool is {kv:.0%} used; mind TPOT), or " + fix
        msg = (f"the waiting queue grew by {growth} requests in the last {_span(w)} (to {q[-1]}): requests arrive at "
               f"~{arriving:.2f}/s but finish at {served:.2f}/s with ~{running:.0f} of {c.max_num_seqs} seats in "
               f"use; the engine is overloaded: {fix}, or bound the queue with --max-waiting-requests so clients "
               f"get a fast 503 instead of a slow answer")
        return [Diagnostic("overload", msg, knobs,
                           {"queue_growth": growth, "queue": q[-1], "arrival_rps": arriving, "finish_rps": served,
                            "mean_running": running, "mean_kv_usage": kv})]

    def _prefix_hits(self, w: Window) -> list[Diagnostic]:
        t = self.thresholds
        if not self.capacity.prefix_caching or len(w.steps) < 2:
            return []
        queries = w.steps[-1].num_prefix_queries - w.steps[0].num_prefix_queries
        hits = w.steps[-1].num_prefix_hits - w.steps[0].num_prefix_hits
        if queries < t.min_prefix_queries or hits / queries >= t.prefix_hit_rate:
            return []
        rate = hits / queries
        msg = (f"only {rate:.1%} of {queries:,} prompt tokens in the last {_span(w)} were found in the prefix cache: "
               f"prompts share little, or differ early (a timestamp or user id before the shared system prompt, "
               f"different cache_salt values); put the shared text first and keep it byte-identical")
        return [Diagnostic("prefix_hit_rate", msg, {}, {"hit_rate": rate, "queries": queries})]

    def _slo(self, w: Window) -> list[Diagnostic]:
        t, slo = self.thresholds, self.slo
        done = w.finished
        if len(done) < t.min_requests or (slo.ttft is None and slo.tpot is None):
            return []
        out = []
        for kind, limit, values in (("slo_ttft", slo.ttft, [r.ttft for r in done if r.ttft is not None]),
                                    ("slo_tpot", slo.tpot, [r.tpot for r in done if r.tpot is not None])):
            if limit is None or not values:
                continue
            over = sum(v > limit for v in values) / len(values)
            if over < t.slo_violation_share:
                continue
            if kind in self.active:  # holding already: no second what-if
                out.append(self.active[kind])
                continue
            out.append(self._slo_diagnostic(kind, limit, values, over, w))
        return out

    def _slo_diagnostic(self, kind: str, limit: float, values: list[float], over: float, w: Window) -> Diagnostic:
        c = self.capacity
        name = "TTFT" if kind == "slo_ttft" else "TPOT"
        p90 = percentile(values, 0.9)
        head = (f"{over:.0%} of requests in the last {_span(w)} missed the {name} SLO of {_ms(limit)} "
                f"(p90 {_ms(p90)}) at max-num-seqs={c.max_num_seqs}, max-num-batched-tokens={c.max_num_batched_tokens}")
        observed = {"violation_share": over, "p90": p90, "slo": limit, "requests": len(values)}
        best = self.whatif(w, c, self.slo) if self.whatif is not None else None
        if best is None:
            return Diagnostic(kind, head + "; no simulator is configured for a what-if: run `iterserve tune` "
                              "with this traffic to find the settings", {}, observed)
        knobs = {"max-num-seqs": best["max_num_seqs"], "max-num-batched-tokens": best["max_num_batched_tokens"]}
        observed["whatif"] = best
        if best.get("met"):
            tail = (f"; replaying this window in the simulator, --max-num-seqs {best['max_num_seqs']} "
                    f"--max-num-batched-tokens {best['max_num_batched_tokens']} meets it "
                    f"(TTFT p99 {_ms(best.get('ttft_p99'))}, TPOT p99 {_ms(best.get('tpot_p99'))})")
        else:
            tail = (f"; replaying this window in the simulator, no setting meets it at this load (best: "
                    f"--max-num-seqs {best['max_num_seqs']}): add replicas or a faster device")
        return Diagnostic(kind, head + tail, knobs, observed)

    # ---- wording ------------------------------------------------------------------------------
    def _kv_knob(self, blocks: int) -> dict:
        c = self.capacity
        if c.bytes_per_block:
            return {"kv-cache-memory": blocks * c.bytes_per_block}
        return {"num-kv-blocks": blocks}

    def _raise_kv(self, blocks: int) -> str:
        c = self.capacity
        if c.bytes_per_block:
            return f"raise --kv-cache-memory to {_gib(blocks * c.bytes_per_block)} ({blocks:,} blocks)"
        return f"raise --num-kv-blocks to {blocks}"


def kv_tokens_per_request(done: list[FinishedRequest]) -> float:
    """The KV a running request holds at its end (prompt + output), averaged over running time rather than
    over requests: long requests run longer, so a random moment's batch holds more of them."""
    weight = sum(max(1, r.output_len) for r in done)
    return sum(max(1, r.output_len) * (r.prompt_len + r.output_len) for r in done) / max(weight, 1)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope (the queue's trend, not a blip at the end)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0


def _span(w: Window) -> str:
    d = w.duration
    return f"{d / 60:.0f} min" if d >= 120 else f"{d:.0f} s"


def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"
