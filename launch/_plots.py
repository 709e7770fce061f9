"""PNG plots of launch.kfactor (matplotlib, Agg backend, imported lazily: the project's `plot` extra).

plot_sweep: one panel per (op, shape): k_comm, k_comp and E against sm_margin, one line style per
(method, chunks_per_rank), the gate's max_k as a dashed line.
plot_timeline: one panel per overlapped step: a Gantt bar per stream (CPU: per thread), ms from the step's
start.
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["plot_sweep", "plot_timeline"]

METRICS = (("k_comm", "tab:blue"), ("k_comp", "tab:orange"), ("E", "tab:green"))
STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")   # no display on the GPU machine or in CI
    import matplotlib.pyplot as plt
    return plt


def _grid(count: int) -> tuple[int, int]:
    cols = min(4, max(1, count))
    return math.ceil(count / cols), cols


def plot_sweep(rows: list[dict], path: str | Path, *, max_k: float | None, title: str = "") -> Path:
    """k_comm, k_comp, E vs sm_margin per (op, layer, M, K, N); returns the path written."""
    plt = _pyplot()
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        panels.setdefault((r["op"], r["layer"], r["M"], r["K"], r["N"]), []).append(r)
    rows_n, cols_n = _grid(len(panels))
    fig, axes = plt.subplots(rows_n, cols_n, figsize=(4.2 * cols_n, 3.2 * rows_n), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, ((op, layer, m, k, n), items) in zip(axes.flat, panels.items()):
        series: dict[tuple, list[dict]] = {}
        for r in items:
            series.setdefault((r["method"], r["chunks_per_rank"]), []).append(r)
        for i, ((method, chunks), points) in enumerate(series.items()):
            points.sort(key=lambda r: r["sm_margin"])
            xs = [r["sm_margin"] for r in points]
            for metric, color in METRICS:
                ax.plot(xs, [r[metric] for r in points], color=color, linestyle=STYLES[i % len(STYLES)],
                        marker=MARKERS[i % len(MARKERS)], markersize=4,
                        label=f"{metric} {method} c{chunks}")
        if max_k is not None:
            ax.axhline(max_k, color="tab:red", linestyle="--", linewidth=0.8, label=f"max_k {max_k}")
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_title(f"{op} {layer}\nM={m} K={k} N={n}", fontsize=8)
        ax.set_xlabel("sm_margin (SMs left free by the GEMM)", fontsize=7)
        ax.tick_params(labelsize=7)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=7)
    fig.suptitle(f"{title}: k_comm, k_comp (slow-down under overlap) and E", fontsize=10)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(labels) // 6), 1, 0.95))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(steps: list[tuple[str, dict]], path: str | Path) -> Path:
    """Gantt of one overlapped step per entry: (title, {lane: [(start_ms, end_ms)]})."""
    plt = _pyplot()
    count = max(1, len(steps))
    fig, axes = plt.subplots(count, 1, figsize=(9, 1.2 + 0.55 * max([len(l) for _, l in steps] or [1]) * count),
                             squeeze=False)
    colors = ("tab:orange", "tab:blue", "tab:purple", "tab:green", "tab:red")
    for ax, (title, lanes) in zip(axes.flat, steps):
        names = list(lanes)
        for i, name in enumerate(names):
            bars = [(start, max(end - start, 1e-6)) for start, end in lanes[name]]
            ax.broken_barh(bars, (i - 0.35, 0.7), color=colors[i % len(colors)])
            if len(lanes[name]) <= 4:  # a whole training step has too many kernels to label
                for start, end in lanes[name]:
                    ax.text(end, i, f" {end - start:.3f} ms", va="center", fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_xlabel("ms from the start of the overlapped step", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_xlim(left=0, right=max([e for spans in lanes.values() for _, e in spans] or [1]) * 1.25)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
