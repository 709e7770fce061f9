"""The Pareto plot of launch.offload_bench (matplotlib, Agg backend, imported lazily: the `plot` extra).

One row per point (model, layers, M), two panels: the step's peak device memory and the activations'
peak (the peak with the gradients held across the step, minus weights, gradients and inputs), each
against the step time. Filled markers: measured; hollow markers of the same shape: the planner's
prediction for that variant; the dashed line: the predicted Pareto front of every plan the planner tried;
the solid line joins the planner's budget sweep as measured. The planner's budgets that chose one plan
share one label; a variant far slower than the rest (offload_all) sits at the right edge with its time written
out, so that the variants within a few per cent of each other stay apart.
"""

from __future__ import annotations

from pathlib import Path

GIB = 2**30
HAND_STYLE = {"none": ("X", "black"), "none_again": ("x", "grey"), "keep": ("s", "tab:blue"),
              "recompute": ("^", "tab:orange"), "recompute_s": ("D", "tab:green"), "offload_all": ("v", "tab:red")}
PLANNER_COLOR = "tab:green"
OFF_SCALE = 1.15   # a step time beyond 1.15x the fastest sits at the right edge, its value in the panel's title


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")   # no display on the GPU machine or in CI
    import matplotlib.pyplot as plt
    return plt


def _x_range(rows) -> tuple[float, float]:
    """The step times to show. The slowest variant, when it is far slower than the rest (offload_all: 2-3x),
    sits at the right edge with its time in the title instead of squeezing the rest; a prediction far from
    every measured time (a CPU run's) sits at the edge too."""
    measured = sorted(r["t_step_ms"] for r in rows)
    kept = measured[:-1] if len(measured) > 1 and measured[-1] > OFF_SCALE * measured[-2] else measured
    xs = kept + [r["pred_step_ms"] for r in rows if r.get("pred_step_ms") is not None
                 and kept[0] / OFF_SCALE <= r["pred_step_ms"] <= kept[-1] * OFF_SCALE]
    return min(xs) * 0.985, max(xs) * 1.03


def _plans(rows) -> list[list[dict]]:
    """The planner's rows grouped by plan: budgets that chose the same plan share one label."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["variant"].startswith("planner"):
            key = (round(r.get("pred_step_ms") or 0, 3), r.get("pred_peak_bytes"), r.get("pred_act_peak_bytes"),
                   tuple(r.get("decisions") or ()))
            groups.setdefault(key, []).append(r)
    return sorted(groups.values(), key=lambda g: min(r["t_step_ms"] for r in g))


def _panel(ax, rows, frontier, measured_key, predicted_key, front_key, ylabel) -> str:
    """Draw one panel; returns the note on the variants drawn off scale ("" if none)."""
    low, high = _x_range(rows)
    planner = sorted((r for r in rows if r["variant"].startswith("planner")), key=lambda r: r["t_step_ms"])
    if frontier:
        ax.plot([f["step_ms"] for f in frontier], [f[front_key] / GIB for f in frontier], "--", color="grey",
                linewidth=0.9)
    if planner and all(r[measured_key] is not None for r in planner):
        ax.plot([r["t_step_ms"] for r in planner], [r[measured_key] / GIB for r in planner], "-",
                color=PLANNER_COLOR, linewidth=0.9)
    off = []
    for r in rows:
        marker, color = HAND_STYLE.get(r["variant"], ("o", PLANNER_COLOR))
        for x, key, hollow in ((r["t_step_ms"], measured_key, False), (r.get("pred_step_ms"), predicted_key, True)):
            y = r.get(key)
            if x is None or y is None:
                continue
            face = {"markerfacecolor": "none"} if hollow else {}
            if not low <= x <= high:
                off.append((r["variant"], x, y / GIB, hollow))
                ax.plot(high if x > high else low, y / GIB, ">" if x > high else "<", color=color, markersize=6,
                        clip_on=False, **face)
            else:
                ax.plot(x, y / GIB, marker, color=color, markersize=6, **face)
    notes = []
    for variant, x, _, hollow in off:
        if not hollow:
            pred = next((o[1] for o in off if o[0] == variant and o[3]), None)
            notes.append(f"{variant} at {x:.0f} ms" + (f" (predicted {pred:.0f})" if pred else ""))
    if len(notes) > 2:
        notes = [f"{len(notes)} variants"]
    for i, group in enumerate(_plans(rows)):
        first = min(group, key=lambda r: r["t_step_ms"])
        if first[measured_key] is None:
            continue
        names = ", ".join(r["variant"].removeprefix("planner") or "[auto]" for r in group)
        label = f"planner {names}" + (": one plan" if len(group) > 1 else "")
        right = first["t_step_ms"] > (low + high) / 2   # a label right of the middle grows to the left
        ax.annotate(label, (first["t_step_ms"], first[measured_key] / GIB), xytext=(-8 if right else 8, 10 + 11 * i),
                    textcoords="offset points", fontsize=6.5, ha="right" if right else "left",
                    arrowprops={"arrowstyle": "-", "color": "grey", "linewidth": 0.6},
                    bbox={"boxstyle": "square,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    ax.set_xlim(low, high)
    ax.set_xlabel("step time (ms; forward, backward, optimizer)", fontsize=7)
    ax.set_ylabel(ylabel, fontsize=7)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    return f"\n{', '.join(notes)}: off scale (at the edge)" if notes else ""


def _legend(fig, plt):
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], marker=m, color=c, linestyle="none", label=v) for v, (m, c) in HAND_STYLE.items()]
    handles += [Line2D([], [], marker="o", color=PLANNER_COLOR, label="planner at each budget\n"
                       "([auto]: default time budget,\n[+N%]: time budget,\n[fx]: memory budget;\none label "
                       "per plan chosen)"),
                Line2D([], [], marker=">", color="black", linestyle="none", label="off scale (at the edge;\n"
                       "measured times in the title)"),
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
        note = _panel(left, mine, frontier, "peak_bytes", "pred_peak_bytes", "peak_bytes",
                      "peak device memory (GiB)\nweights, grads, activations")
        _panel(right, mine, frontier, "act_peak_bytes", "pred_act_peak_bytes", "act_peak_bytes",
               "activations at their peak (GiB)\ngrads held: peak minus what existed")
        name = f"{point['model']}, {point['layers']} layers, M = {point['M']}"
        left.set_title(f"{name}: step peak{note}", fontsize=8)
        right.set_title(f"{name}: activation peak{note}", fontsize=8)
    _legend(fig, plt)
    fig.suptitle(title or "activation offload: peak memory against step time (one GPU)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.8, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
