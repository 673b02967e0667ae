"""Per-request latencies from timestamps, and the aggregate figures of one run (one target).

Definitions follow `vllm bench serve` so numbers compare: TTFT = first token - arrival;
TPOT = (e2e - TTFT) / (output tokens - 1); ITL = gaps between consecutive tokens; goodput =
requests per second that meet every given SLO.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from iterserve.outputs import StepRecord
from iterserve.request import RequestTimes

LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue")


@dataclass(slots=True)
class RequestMetrics:
    request_id: str
    prompt_len: int
    output_len: int  # tokens actually generated
    arrival: float  # seconds after the run's start
    ttft: float | None
    tpot: float | None  # None for one-token outputs
    itl: list[float]
    queue: float | None  # arrival -> first scheduled; None where unknown (HTTP targets)
    e2e: float | None
    finished: float | None  # seconds after the run's start
    preemptions: int = 0


def request_metrics(request_id: str, prompt_len: int, output_len: int, times: RequestTimes,
                    t0: float = 0.0) -> RequestMetrics:
    """Latencies of one request from its timestamps; t0 is the run's start on the same clock."""
    ttft, e2e = times.ttft, times.e2e
    tpot = (e2e - ttft) / (output_len - 1) if e2e is not None and ttft is not None and output_len > 1 else None
    return RequestMetrics(request_id, prompt_len, output_len, times.arrival - t0, ttft, tpot, times.itl,
                          times.queue_time, e2e, None if times.finished is None else times.finished - t0,
                          len(times.preempted))


@dataclass(slots=True)
class Slo:
    """Service-level objectives in seconds; None: no limit on that figure."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def met(self, m: RequestMetrics) -> bool:
        if m.e2e is None:  # never finished
            return False
        if self.ttft is not None and (m.ttft is None or m.ttft > self.ttft):
            return False
        # A one-token output has no TPOT; like vLLM, it meets the TPOT objective.
        if self.tpot is not None and m.tpot is not None and m.tpot > self.tpot:
            return False
        return self.e2e is None or m.e2e <= self.e2e

    def as_dict(self) -> dict:
        return {"ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e}


@dataclass(slots=True)
class TargetResult:
    """Everything measured for one target in one run; times are seconds after the run's start."""

    name: str
    requests: list[RequestMetrics]
    duration: float  # start of the run -> last request finished
    steps: list[StepRecord] = field(default_factory=list)  # engine targets only, times relative
    preemptions: int = 0
    extra: dict = field(default_factory=dict)  # target-specific notes (approximations, settings)


def stats(values: list[float] | np.ndarray) -> dict[str, float | None]:
    if len(values) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "std": None, "max": None}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "std": float(a.std()), "max": float(a.max())}


def batch_size(step: StepRecord) -> int:
    """Requests that did work in the step (static mode's padding rows are not in either list)."""
    return len({*step.prefill_ids, *step.decode_ids})


def summarize(result: TargetResult, slo: Slo | None = None, per_request: bool = True) -> dict:
    """The JSON figures of one target: throughput, latency percentiles, goodput, batch and KV."""
    slo = slo or Slo()
    done = [m for m in result.requests if m.e2e is not None]
    dur = max(result.duration, 1e-9)
    out_tokens = sum(m.output_len for m in done)
    in_tokens = sum(m.prompt_len for m in done)
    steps = result.steps
    sizes = [batch_size(s) for s in steps]
    busy = sum(s.end - s.start for s in steps)
    out = {
        "name": result.name,
        "completed": len(done),
        "failed": len(result.requests) - len(done),
        "duration_s": result.duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "requests_per_s": len(done) / dur,
        "output_tokens_per_s": out_tokens / dur,
        "total_tokens_per_s": (in_tokens + out_tokens) / dur,
        "ttft_s": stats([m.ttft for m in done if m.ttft is not None]),
        "tpot_s": stats([m.tpot for m in done if m.tpot is not None]),
        "itl_s": stats(np.fromiter(chain.from_iterable(m.itl for m in done), np.float64)),
        "e2e_s": stats([m.e2e for m in done]),
        "queue_s": stats([m.queue for m in done if m.queue is not None]),
        "slo": slo.as_dict(),
        "goodput_rps": sum(slo.met(m) for m in done) / dur,
        "mean_batch_size": float(np.mean(sizes)) if sizes else None,
        # time-weighted: the batch size a random instant of busy engine time sees
        "mean_batch_size_time_weighted": (sum(b * (s.end - s.start) for b, s in zip(sizes, steps)) / busy
                                          if busy > 0 else None),
        "max_batch_size": max(sizes) if sizes else None,
        "num_steps": len(steps),
        "mean_kv_usage": float(np.mean([s.kv_usage for s in steps])) if steps else None,
        "max_kv_usage": max((s.kv_usage for s in steps), default=None),
        "preemptions": result.preemptions,
        "prefill_tokens_computed": sum(s.num_prefill_tokens for s in steps),
        "extra": result.extra,
        "series": {  # over time, for plots and for anyone re-plotting the JSON
            "step_end_s": [round(s.end, 6) for s in steps],
            "batch_size": sizes,
            "num_batched_tokens": [s.num_batched_tokens for s in steps],
            "num_waiting": [s.num_waiting for s in steps],
            "kv_usage": [round(s.kv_usage, 5) for s in steps],
        },
    }
    if per_request:
        out["requests"] = [{"id": m.request_id, "prompt_len": m.prompt_len, "output_len": m.output_len,
                            "arrival_s": m.arrival, "ttft_s": m.ttft, "tpot_s": m.tpot, "queue_s": m.queue,
                            "e2e_s": m.e2e, "preemptions": m.preemptions} for m in result.requests]
    return out
