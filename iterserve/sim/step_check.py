"""Real engine steps against a profile's price: where a simulation's time goes missing.

The simulator prices each step with the cost model and nothing else, so every real second it
misses is either a step priced too low or time between steps. `check_steps` takes a real run's
step records (`Engine.step_records`, or the ones a P/D front receives with each engine's stats),
rebuilds each step's shape (new tokens and context per request) from the requests' prompt lengths,
and prices it with the profile. Per step kind it reports the real time inside the step (execute,
update, outputs), the real time after it until the engine's next step (the driver, the queues,
scheduling) and the profile's price for both. A gap counts only when a request of the step is
still in the next one: otherwise the engine may have been idle. `benchmarks/pd_mixed.py
--check-steps` prints it for each engine of both targets.
"""
from __future__ import annotations

from dataclasses import dataclass

from iterserve.outputs import StepRecord
from iterserve.sim.cost_model import CostModel

KINDS = ("decode", "prefill", "mixed")


@dataclass(slots=True)
class StepShape:
    q_lens: list[int]
    ctx_lens: list[int]
    ids: frozenset[str]
    start: float
    end: float

    @property
    def kind(self) -> str:
        return step_kind(self.q_lens)


def step_kind(q_lens: list[int]) -> str:
    decodes = sum(q == 1 for q in q_lens)
    return "decode" if decodes == len(q_lens) else "prefill" if decodes == 0 else "mixed"


def shapes_from_records(records: list[StepRecord], prompt_lens: dict[str, int]) -> list[StepShape]:
    """Each step's (new tokens, context after the step) per request, replayed from the records in order.
    A record names its prompt requests, where each one's chunk starts (past a prefix-cache hit) and their
    total tokens; they are split in the scheduler's order (each takes what is left of its prompt, up to
    what is left of the total). A record without the starts (an older one) has each prompt start where
    its previous chunk ended, from 0: prefix-cache hits are then priced as computed. A request first seen
    decoding (a P/D decode engine's hand-off) starts with its whole prompt computed. Without the starts, a
    preempted request's recomputation is not replayed either (its chunks are priced as prompt tokens it had
    already computed)."""
    computed: dict[str, int] = {}
    shapes = []
    for r in records:
        q_lens, ctx_lens = [], []
        left = r.num_prefill_tokens
        starts = r.prefill_starts if len(r.prefill_starts) == len(r.prefill_ids) else None
        for k, rid in enumerate(r.prefill_ids):
            done = starts[k] if starts is not None else computed.get(rid, 0)
            q = max(1, min(prompt_lens[rid] - done, left))
            left -= q
            computed[rid] = done + q
            q_lens.append(q)
            ctx_lens.append(done + q)
        for rid in r.decode_ids:
            done = computed.get(rid, prompt_lens[rid]) + 1
            computed[rid] = done
            q_lens.append(1)
            ctx_lens.append(done)
        if q_lens:
            shapes.append(StepShape(q_lens, ctx_lens, frozenset(r.prefill_ids) | frozenset(r.decode_ids),
                                    r.start, r.end))
    return shapes


def busy_gaps(shapes: list[StepShape]) -> list[float]:
    """Per step, the real seconds from its end to the engine's next step while one of its requests goes on
    (0 for an engine that may have gone idle, and for the last step)."""
    gaps = [max(0.0, b.start - a.end) if a.ids & b.ids else 0.0 for a, b in zip(shapes, shapes[1:])]
    return gaps + [0.0] if shapes else []


def check_steps(shapes: list[StepShape], cost: CostModel) -> list[dict]:
    """One row per step kind present, then "all": steps, mean batch, mean new tokens, real seconds in
    the steps and in the busy gaps after them, the profile's price, and the error of price vs real."""
    rows = {k: {"kind": k, "steps": 0, "batch": 0, "tokens": 0, "in_step_s": 0.0, "gap_s": 0.0, "gaps": 0,
                "priced_s": 0.0} for k in (*KINDS, "all")}
    for s, gap in zip(shapes, busy_gaps(shapes)):
        price = cost.step_time(s.q_lens, s.ctx_lens)
        for row in (rows[s.kind], rows["all"]):
            row["steps"] += 1
            row["batch"] += len(s.q_lens)
            row["tokens"] += sum(s.q_lens)
            row["in_step_s"] += s.end - s.start
            row["gap_s"] += gap
            row["gaps"] += gap > 0
            row["priced_s"] += price
    out = []
    for row in rows.values():
        if not row["steps"]:
            continue
        n = row["steps"]
        real = row["in_step_s"] + row["gap_s"]
        out.append({**row, "batch": row["batch"] / n, "tokens": row["tokens"] / n, "real_s": real,
                    "error": row["priced_s"] / real - 1 if real else None})
    return out


def step_rows(shapes: list[StepShape]) -> list[dict]:
    """One engine's steps as calibration rows (calibrate_fit.fit_profile's input): each step's seconds are
    its time inside plus the busy gap after it, so a fit to them prices the engine's host work too."""
    return [{"kind": s.kind, "q_lens": s.q_lens, "ctx_lens": s.ctx_lens, "measured_s": s.end - s.start + gap}
            for s, gap in zip(shapes, busy_gaps(shapes))]


def fit_to_steps(model, hw, rows: list[dict], rows_per_kind: int = 200):
    """hw refitted (calibrate_fit.fit_profile: the efficiencies and overheads; the bandwidths, peak and
    hand-off rates kept) to a real run's own step rows: a profile that prices that run's steps as the
    machine ran them then, not as it ran minutes before. Up to rows_per_kind rows of each kind, evenly
    spaced. Returns (hardware, the fit's RMS relative error)."""
    from iterserve.sim.calibrate_fit import fit_profile
    picked = []
    for kind in KINDS:
        of_kind = [r for r in rows if r["kind"] == kind]
        picked += of_kind[:: max(1, -(-len(of_kind) // rows_per_kind))]
    fitted, err = fit_profile(model, hw, picked)
    return fitted, (err / len(picked)) ** 0.5


def format_check(name: str, rows: list[dict]) -> str:
    lines = [f"{name}: real steps priced by the profile (gap: after a step until the next, while busy)",
             f"  {'kind':<8}{'steps':>6}{'batch':>7}{'tokens':>8}{'in-step ms':>12}{'gap ms':>8}"
             f"{'real ms':>9}{'priced ms':>10}{'price err':>10}{'total real s':>13}"]
    for r in rows:
        n = r["steps"]
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        lines.append(f"  {r['kind']:<8}{n:>6}{r['batch']:>7.1f}{r['tokens']:>8.1f}{r['in_step_s'] / n * 1e3:>12.1f}"
                     f"{r['gap_s'] / n * 1e3:>8.1f}{r['real_s'] / n * 1e3:>9.1f}{r['priced_s'] / n * 1e3:>10.1f}"
                     f"{err:>10}{r['real_s']:>13.2f}")
    return "\n".join(lines)
