"""The calibration fit: the simulator's efficiency factors and overheads from measured step times."""
from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from iterserve.sim.cost_model import CostModel
from iterserve.sim.hardware import HardwareSpec
from iterserve.sim.model_spec import ModelSpec


def _part_times(model: ModelSpec, base: HardwareSpec, rows: list[dict], part: str, **efficiencies) -> np.ndarray:
    """Each row's modelled seconds in one part of the step (linear_s or attention_s) at these efficiencies."""
    cm = CostModel(model, replace(base, **efficiencies))
    return np.array([getattr(cm.breakdown(r["q_lens"], r["ctx_lens"]), part) for r in rows])


# Above 1: a prefetched read of packed weights over huge pages outruns the copy the bandwidth is
# measured with (a copy also writes, and over 4 KiB pages).
EFFICIENCY_GRID = [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5]
# CPU attention gathers K/V through block tables and upcasts: far below the roofline, so its
# factors reach down to 0.5%.
ATTENTION_GRID = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8]


def fit_profile(model: ModelSpec, base: HardwareSpec, rows: list[dict]) -> tuple[HardwareSpec, float]:
    """Grid over efficiencies, least squares for the two overheads; minimise squared relative error.
    Mixed steps (decode rows and prompt chunks together) take no part in that: what they cost beyond
    their parts priced so is fitted afterwards (fit_mixed)."""
    pure = [r for r in rows if r["kind"] != "mixed"]
    y = np.array([r["measured_s"] for r in pure])
    batch = np.array([len(r["q_lens"]) for r in pure], float)
    a = np.vstack([np.ones_like(y), batch]).T / y[:, None]  # rows scaled by 1/y: relative residuals
    best = (float("inf"), base)
    zero = {"step_overhead_s": 0.0, "layer_overhead_s": 0.0, "seq_overhead_s": 0.0, "mixed_step_overhead_s": 0.0,
            "mixed_seq_overhead_s": 0.0}
    # the linear part depends on the memory and linear efficiencies only, attention on its own two:
    # each is priced once per pair of its own, and the grid adds them
    linear = {(mem, lin): _part_times(model, base, pure, "linear_s", mem_efficiency=mem, flops_efficiency=lin)
              for mem, lin in itertools.product(EFFICIENCY_GRID, EFFICIENCY_GRID)}
    attention = {(att, att_mem): _part_times(model, base, pure, "attention_s", attn_efficiency=att,
                                             attn_mem_efficiency=att_mem)
                 for att, att_mem in itertools.product(ATTENTION_GRID, ATTENTION_GRID)}
    for (mem, lin), (att, att_mem) in itertools.product(linear, attention):
        roof = linear[mem, lin] + attention[att, att_mem]
        coef, *_ = np.linalg.lstsq(a, (y - roof) / y, rcond=None)
        coef = np.maximum(coef, 0.0)
        pred = roof + coef[0] + coef[1] * batch
        err = float(np.sum(((pred - y) / y) ** 2))
        if err < best[0]:
            hw = replace(base, mem_efficiency=mem, flops_efficiency=lin, attn_efficiency=att,
                         attn_mem_efficiency=att_mem, **zero)
            best = (err, replace(hw, step_overhead_s=float(coef[0]), seq_overhead_s=float(coef[1])))
    err, hw = best
    mixed = [r for r in rows if r["kind"] == "mixed"]
    if not mixed:
        return hw, err
    hw = fit_mixed(model, hw, mixed)
    return hw, err + sum((p / r["measured_s"] - 1) ** 2 for r, p in zip(mixed, predict_rows(model, hw, mixed)))


def fit_mixed(model: ModelSpec, hw: HardwareSpec, rows: list[dict]) -> HardwareSpec:
    """The mixed-step overheads (per step, per decode row in it): least squares on what the mixed points
    measured beyond their price without them, relative like the main fit; none below zero. One point, or
    points that all have the same number of decode rows, give the per-step term alone."""
    y = np.array([r["measured_s"] for r in rows])
    excess = (y - np.array(predict_rows(model, hw, rows))) / y  # relative to each step, like the main fit
    count = np.array([sum(q == 1 for q in r["q_lens"]) for r in rows], float)
    ones, decodes = 1 / y, count / y
    fixed = per_row = -1.0
    if len(set(count)) > 1:
        (fixed, per_row), *_ = np.linalg.lstsq(np.vstack([ones, decodes]).T, excess, rcond=None)
    if fixed < 0 or per_row < 0:  # the best non-negative fit has one term alone (or zero)
        terms = (ones, decodes) if len(set(count)) > 1 else (ones,)
        alone = [(max(0.0, float(excess @ x / (x @ x))), x) for x in terms]
        c, x = min(alone, key=lambda f: float(np.sum((excess - f[0] * f[1]) ** 2)))
        fixed, per_row = (c, 0.0) if x is ones else (0.0, c)
    return replace(hw, mixed_step_overhead_s=float(fixed), mixed_seq_overhead_s=float(per_row))


def refit(path: str) -> dict:
    """Fit a profile again from the step times it recorded (no new measurements)."""
    profile = json.loads(Path(path).read_text())
    m = profile["measured"]
    from iterserve.sim.model_spec import get_model_spec
    spec = get_model_spec(profile["model"]["path"], profile["model"]["dtype_bytes"])
    base = HardwareSpec.from_json(profile["hardware"])
    hw, err = fit_profile(spec, base, m["steps"])
    for r, p in zip(m["steps"], predict_rows(spec, hw, m["steps"])):
        r["predicted_s"], r["error"] = p, p / r["measured_s"] - 1
    hw = HardwareSpec(**{**hw.to_json(), "step_overhead_s": hw.step_overhead_s + m["host_step_s"],
                         "seq_overhead_s": hw.seq_overhead_s + m["host_seq_s"]})
    profile["hardware"] = hw.to_json()
    m["fit_rms_rel_error"] = float(np.sqrt(err / len(m["steps"])))
    return profile


def predict_rows(model: ModelSpec, hw: HardwareSpec, rows: list[dict]) -> list[float]:
    cm = CostModel(model, hw)
    return [cm.step_time(r["q_lens"], r["ctx_lens"]) for r in rows]
