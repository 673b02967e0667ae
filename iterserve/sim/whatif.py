"""The diagnostics' what-if: replay a window of finished requests through the simulator at other
settings (`tune.search`, the real scheduler on the cost model) and pick the one that meets the SLOs."""
from __future__ import annotations

from iterserve.bench.metrics import Slo as BenchSlo
from iterserve.bench.workload import Trace, TraceRequest
from iterserve.engine.diagnostics import Capacity, Slo, Thresholds, Window
from iterserve.sim.tune import search


def trace_of(w: Window) -> Trace:
    """The window's traffic as an open-loop trace at its own arrival times: every request seen in it
    (finished ones with their lengths; running ones with an output length drawn from the finished
    ones), plus the requests still queued, spread after the last one that started (FCFS)."""
    finished = {r.request_id: r for r in w.finished}
    outputs = [r.output_len for r in w.finished] or [1]
    prompts = [r.prompt_len for r in w.finished] or [1]
    rows = [(r.arrival, r.prompt_len, r.output_len) for r in w.finished]
    rows += [(r.arrival, r.prompt_len, outputs[i % len(outputs)])
             for i, r in enumerate(r for r in w.started if r.request_id not in finished)]
    last = max((a for a, _, _ in rows), default=w.start)
    queued = (w.steps[-1].num_waiting + w.steps[-1].num_swapped) if w.steps else 0
    rows += [(last + (w.end - last) * (i + 1) / (queued + 1), prompts[i % len(prompts)], outputs[i % len(outputs)])
             for i in range(queued)]
    rows.sort()
    t0 = rows[0][0]
    return Trace([TraceRequest(f"w{i}", p, max(1, o), round(a - t0, 6)) for i, (a, p, o) in enumerate(rows)],
                 meta={"seed": 0, "source": "diagnostics window"})


def seat_candidates(max_num_seqs: int, more: bool) -> list[int]:
    """Fewer seats than today, down to 1 (a TPOT past the knee of the step-time curve); with `more`, up to 4x
    too (a TTFT missed because requests queue for seats)."""
    fewer = {max(1, max_num_seqs * k // 8) for k in range(1, 9)} | {1, 2, 4}
    return sorted(fewer | ({max_num_seqs * 2, max_num_seqs * 4} if more else set()))


class SimulatorWhatIf:
    """`model` and `hardware` are the simulator's specs of what is being served; `base` the engine
    settings to keep (block size, KV pool, preemption mode, ...) as flat EngineConfig names."""

    def __init__(self, model, hardware, base: dict | None = None, thresholds: Thresholds | None = None) -> None:
        self.model, self.hardware, self.base = model, hardware, dict(base or {})
        self.thresholds = thresholds or Thresholds()

    def __call__(self, window: Window, capacity: Capacity, slo: Slo) -> dict | None:
        if not window.finished:
            return None
        budgets = [capacity.max_num_batched_tokens]
        if slo.ttft is not None:  # a smaller prompt chunk lets decodes and queued prompts in sooner, a larger one
            budgets = sorted({max(64, capacity.max_num_batched_tokens // 2), *budgets,
                              capacity.max_num_batched_tokens * 2})
        base = {**self.base, "num_kv_blocks": capacity.num_kv_blocks, "block_size": capacity.block_size}
        trace = trace_of(window)
        points = search(trace, self.model, self.hardware, BenchSlo(slo.ttft, slo.tpot),
                        seat_candidates(capacity.max_num_seqs, more=slo.ttft is not None), budgets, base)
        # Met as the diagnostic measures it, with room: fewer than half the allowed share over the SLO.
        ok = [p for p in points if 1 - p.met_share < self.thresholds.slo_violation_share / 2]
        best = max(ok, key=lambda p: (p.goodput_rps, p.max_num_seqs)) if ok else points[0]
        return {"max_num_seqs": best.max_num_seqs, "max_num_batched_tokens": best.max_num_batched_tokens,
                "ttft_p99": best.ttft_p99, "tpot_p99": best.tpot_p99, "met": bool(ok),
                "met_share": best.met_share, "replayed_requests": len(trace),
                "hardware": self.hardware.name, "model": self.model.name}
