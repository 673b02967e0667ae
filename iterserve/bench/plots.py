"""PNG plots of a bench run: throughput, latency CDFs, batch size and KV usage over time, and the
batch timeline (one row per request, coloured by its state at every engine step)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from iterserve.bench.metrics import TargetResult, batch_size  # noqa: E402

STATES = ("idle", "waiting", "prefill", "decode", "preempted")  # codes 0..4 in the timeline matrix
COLOURS = ("#ffffff", "#f2c14e", "#d1495b", "#2e86ab", "#6c3483")


def plot_all(results: list[TargetResult], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_throughput(results, out / "throughput.png"), plot_latency_cdfs(results, out / "latency_cdf.png")]
    stepped = [r for r in results if r.steps]
    if stepped:
        paths.append(plot_batch_and_kv(stepped, out / "batch_kv.png"))
    for r in stepped:
        paths.append(plot_timeline(r, out / f"timeline_{_safe(r.name)}.png"))
    return paths


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def plot_throughput(results: list[TargetResult], path: Path) -> Path:
    names = [r.name for r in results]
    tok = [sum(m.output_len for m in r.requests if m.e2e is not None) / max(r.duration, 1e-9) for r in results]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 4))
    bars = ax.bar(names, tok, color=COLOURS[3])
    for b, v in zip(bars, tok):
        ax.annotate(f"{v:.0f}\n({v / tok[0]:.2f}x)" if tok[0] else f"{v:.0f}", (b.get_x() + b.get_width() / 2, v),
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput (ratio to the first target)")
    ax.set_ylim(0, max(tok) * 1.25 if max(tok) > 0 else 1)
    return _save(fig, path)


def plot_latency_cdfs(results: list[TargetResult], path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, label) in zip(axes, (("ttft", "TTFT (s)"), ("tpot", "TPOT (s)"), ("e2e", "end-to-end (s)"))):
        for r in results:
            v = np.sort([getattr(m, key) for m in r.requests if getattr(m, key) is not None])
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=r.name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Latency CDFs")
    return _save(fig, path)


def plot_batch_and_kv(results: list[TargetResult], path: Path) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    for r in results:
        t = [s.end for s in r.steps]
        top.step(t, [batch_size(s) for s in r.steps], where="post", label=r.name, lw=0.9)
        if r.extra.get("kv_usage_known", True):
            bottom.step(t, [100 * s.kv_usage for s in r.steps], where="post", label=r.name, lw=0.9)
    top.set_ylabel("requests in batch")
    bottom.set_ylabel("KV blocks in use (%)")
    bottom.set_xlabel("time since start (s)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    fig.suptitle("Batch size and KV cache usage over time")
    return _save(fig, path)


def timeline_matrix(r: TargetResult) -> np.ndarray:
    """[request, step] -> state code (see STATES), requests in trace order."""
    row = {m.request_id: i for i, m in enumerate(r.requests)}
    grid = np.zeros((len(r.requests), len(r.steps)), dtype=np.int8)
    arrival = np.array([m.arrival for m in r.requests])
    finished = np.array([np.inf if m.finished is None else m.finished for m in r.requests])
    preempted = np.zeros(len(r.requests), dtype=bool)
    for k, s in enumerate(r.steps):
        present = (arrival <= s.end) & (finished > s.start)
        grid[present, k] = 1
        for rid in s.preempted_ids:
            if rid in row:
                preempted[row[rid]] = True
        for rid in s.decode_ids:
            if rid in row:
                grid[row[rid], k] = 3
        for rid in s.prefill_ids:
            if rid in row:
                grid[row[rid], k] = 2
                preempted[row[rid]] = False
        waiting_again = preempted & (grid[:, k] == 1)
        grid[waiting_again, k] = 4
    return grid


def plot_timeline(r: TargetResult, path: Path) -> Path:
    grid = timeline_matrix(r)
    fig, ax = plt.subplots(figsize=(14, max(4, min(16, 0.06 * len(r.requests) + 2))))
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(COLOURS), vmin=0, vmax=4)
    ax.set_xlabel("engine step")
    ax.set_ylabel("request (trace order)")
    ax.set_title(f"Batch timeline: {r.name}")
    ax.legend(handles=[Patch(color=c, label=s) for s, c in zip(STATES[1:], COLOURS[1:])],
              loc="upper right", fontsize=8)
    return _save(fig, path)


def plot_sweep(name: str, points: list[tuple[float, dict]], out_dir: str | Path) -> Path:
    """Throughput against latency, one line per target, each point labelled by the swept value."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [t["name"] for t in points[0][1]["targets"]]
    for ax, (key, stat, label) in zip(axes, (("ttft_s", "p99", "TTFT p99 (s)"), ("tpot_s", "mean", "TPOT mean (s)"))):
        for i, target in enumerate(names):
            xs = [report["targets"][i]["output_tokens_per_s"] for _, report in points]
            ys = [report["targets"][i][key][stat] for _, report in points]
            ax.plot(xs, ys, marker="o", label=target)
            for v, x, y in zip((v for v, _ in points), xs, ys):
                if y is not None:
                    ax.annotate(f"{v:g}", (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("output tokens / s")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"Throughput vs latency, sweeping {name}")
    return _save(fig, out / f"sweep_{_safe(name)}.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
