"""The Pareto plot of launch.offload_bench (matplotlib, Agg backend, imported lazily: the `plot` extra).

One row per point (model, layers, M), two panels: the step's peak device memory and the activations'
peak (the peak with the gradients held across the step, minus weights, gradients and inputs), each
against the step time. Filled markers: measured; hollow markers of the same shape: the planner's
prediction for that variant; the dashed line: the predicted Pareto front of every plan the planner tried;
the solid line joins the planner's budget sweep as measured.
"""

from __future__ import annotations

from pathlib import Path

GIB = 2**30
HAND_STYLE = {"none": ("X", "black"), "none_again": ("x", "grey"), "keep": ("s", "tab:blue"),
              "recompute": ("^", "tab:orange"), "recompute_s": ("D", "tab:green"), "offload_all": ("v", "tab:red")}
PLANNER_COLOR = "tab:green"


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")   # no display on the GPU machine or in CI
    import matplotlib.pyplot as plt
    return plt


def _panel(ax, rows, frontier, measured_key, predicted_key, front_key, ylabel):
    planner = sorted((r for r in rows if r["variant"].startswith("planner")), key=lambda r: r["t_step_ms"])
    if frontier:
        ax.plot([f["step_ms"] for f in frontier], [f[front_key] / GIB for f in frontier], "--", color="grey",
                linewidth=0.9)
    if planner and all(r[measured_key] is not None for r in planner):
        ax.plot([r["t_step_ms"] for r in planner], [r[measured_key] / GIB for r in planner], "-",
                color=PLANNER_COLOR, linewidth=0.9)
    for r in rows:
        marker, color = HAND_STYLE.get(r["variant"], ("o", PLANNER_COLOR))
        if r[measured_key] is not None:
            ax.plot(r["t_step_ms"], r[measured_key] / GIB, marker, color=color, markersize=6)
        if r.get(predicted_key) is not None and r.get("pred_step_ms") is not None:
            ax.plot(r["pred_step_ms"], r[predicted_key] / GIB, marker, markerfacecolor="none", color=color,
                    markersize=6)
        if r["variant"].startswith("planner") and r[measured_key] is not None:
            ax.annotate(r["variant"].removeprefix("planner") or "[auto]", (r["t_step_ms"], r[measured_key] / GIB),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("step time (ms; forward, backward, optimizer)", fontsize=7)
    ax.set_ylabel(ylabel, fontsize=7)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def _legend(fig, plt):
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], marker=m, color=c, linestyle="none", label=v) for v, (m, c) in HAND_STYLE.items()]
    handles += [Line2D([], [], marker="o", color=PLANNER_COLOR, label="planner at each budget\n"
                       "([auto]: default time budget,\n[+N%]: time budget, [fx]: memory)"),
                Line2D([], [], marker="o", color="black", linestyle="none", label="filled: measured"),
                Line2D([], [], marker="o", color="black", markerfacecolor="none", linestyle="none",
                       label="hollow: predicted\n(the planner's step model)"),
                Line2D([], [], linestyle="--", color="grey", label="predicted Pareto front\n(every plan tried)")]
    fig.legend(handles=handles, loc="center right", fontsize=7, frameon=False)


def plot_pareto(points: list[dict], rows: list[dict], path: str | Path, *, title: str = "") -> Path | None:
    """Write the plot of every measured point to `path`; None when there is nothing to draw."""
    if not points:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(points), 2, figsize=(13, 3.6 * len(points) + 0.6), squeeze=False)
    for (left, right), point in zip(axes, points):
        mine = [r for r in rows if (r["model"], r["layers"], r["M"]) == (point["model"], point["layers"], point["M"])]
        frontier = point.get("frontier") or []
        _panel(left, mine, frontier, "peak_bytes", "pred_peak_bytes", "peak_bytes",
               "peak device memory (GiB)\nweights, grads, activations")
        _panel(right, mine, frontier, "act_peak_bytes", "pred_act_peak_bytes", "act_peak_bytes",
               "activations at their peak (GiB)\ngrads held: peak minus what existed")
        name = f"{point['model']}, {point['layers']} layers, M = {point['M']}"
        left.set_title(f"{name}: step peak", fontsize=8)
        right.set_title(f"{name}: activation peak", fontsize=8)
    _legend(fig, plt)
    fig.suptitle(title or "activation offload: peak memory against step time (one GPU)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.8, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
