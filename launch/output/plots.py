"""PNG plots of the k-factor sweeps and of per-stream timelines (matplotlib, Agg backend, imported lazily: the
project's `plot` extra). Every plot says what its axes are, with units, and what each colour and line means.

plot_sweep: per (op, shape), k_comm and k_comp (how much overlap slows the comm path and the GEMM; log scale,
so that one large k does not flatten the rest) above E (how well the comm is hidden) against the swept
setting (sm_margin, or chunks_per_rank); when nothing numeric was swept, one point per shape and method
instead of a line of one point.
plot_timeline: per step, a bar per lane (a stream, or a thread on CPU) from the step's start; lanes of a
profiled trace are named by what they run and their bars coloured by kind (GEMM, copy, NCCL, ...).
"""

from __future__ import annotations

import math
from pathlib import Path

METHOD_COLORS = {"decomposed": "tab:blue", "fused": "tab:orange", "epilogue_reduce": "tab:green", "pair": "tab:purple",
                 "bulk": "tab:brown"}
KIND_COLORS = {"GEMM": "tab:orange", "NCCL collective": "tab:red", "copy": "tab:blue",
               "flag wait / signal": "tab:purple", "reduction of partials": "tab:green",
               "device hold (spin)": "lightgrey", "memset": "silver", "elementwise / other": "tab:olive"}
LANE_COLORS = ("tab:orange", "tab:blue", "tab:purple", "tab:green", "tab:red")
MARKERS = ("o", "s", "^", "D", "v", "P")
K_LINES = (("k_comm", "-", "k_comm: comm path's time overlapped / alone"),
           ("k_comp", "--", "k_comp: GEMM's time overlapped / alone"))
E_TEXT = "E = max(comm alone, GEMM alone) / both overlapped (1 = comm fully hidden)"
SWEPT = {"sm_margin": "sm_margin: SMs the GEMM leaves free", "chunks_per_rank": "chunks_per_rank: chunks per rank"}
K_TICKS = (0.8, 0.9, 1.0, 1.25, 1.5, 2, 3, 5, 10, 20, 50)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")   # no display on the GPU machine or in CI
    import matplotlib.pyplot as plt
    return plt


def _color(method: str, i: int) -> str:
    return METHOD_COLORS.get(method, LANE_COLORS[i % len(LANE_COLORS)])


def _log_k_axis(ax, values, max_k) -> None:
    """k on a log scale with plain tick labels; the range covers every value, 1.0 and the gate."""
    finite = [v for v in values if v and math.isfinite(v)] + [1.0] + ([max_k] if max_k else [])
    low, high = min(finite) * 0.93, max(finite) * 1.08
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    ticks = [t for t in K_TICKS if low <= t <= high]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.axhline(1.0, color="grey", linewidth=0.6)
    if max_k:
        ax.axhline(max_k, color="tab:red", linestyle=":", linewidth=1)


def _legend(fig, methods: list[str], chunks: list, max_k, with_lines: bool) -> float:
    """Draw the legend below the panels; returns the bottom margin (a fraction of the height) it needs."""
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=_color(m, i), linewidth=3, label=f"method {m}") for i, m in enumerate(methods)]
    if with_lines:
        handles += [Line2D([], [], color="black", linestyle=style, label=text) for _, style, text in K_LINES]
    else:
        handles += [Line2D([], [], color="black", marker=MARKERS[i], linestyle="", label=text)
                    for i, (_, _, text) in enumerate(K_LINES)]
    shown = [c for c in chunks if c is not None]   # GEMM+RS rows have no chunks_per_rank
    handles += [Line2D([], [], color="black", marker=_marker(chunks, c), linestyle="", label=f"chunks_per_rank={c}")
                for c in shown if len(shown) > 1]
    if max_k:
        handles.append(Line2D([], [], color="tab:red", linestyle=":", label=f"gate: k <= {max_k}"))
    handles.append(Line2D([], [], color="grey", linewidth=0.6, label="k = 1: no slow-down"))
    ncol = max(1, min(4, len(handles), int(fig.get_figwidth() // 3.2)))
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    return (0.65 + 0.2 * math.ceil(len(handles) / ncol)) / fig.get_figheight()


def _marker(chunks: list, value) -> str:
    shown = [c for c in chunks if c is not None]
    return MARKERS[shown.index(value) % len(MARKERS)] if value in shown else MARKERS[0]


def _swept_key(rows: list[dict]) -> str | None:
    for key in SWEPT:
        if len({r.get(key) for r in rows}) > 1:
            return key
    return None


def plot_sweep(rows: list[dict], path: str | Path, *, max_k: float | None, title: str = "") -> Path:
    """k_comm, k_comp (log) and E per (op, layer, M, K, N) against the swept setting; returns the path."""
    rows = [r for r in rows if r.get("op") != "ag_regime"]
    key = _swept_key(rows)
    return (_plot_lines(rows, key, path, max_k, title) if key else _plot_points(rows, path, max_k, title))


def _panels(rows: list[dict]) -> dict[tuple, list[dict]]:
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        panels.setdefault((r["op"], r["layer"], r["M"], r["K"], r["N"]), []).append(r)
    return panels


def _plot_lines(rows, key: str, path, max_k, title) -> Path:
    plt = _pyplot()
    panels = _panels(rows)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    other = next(k for k in SWEPT if k != key)
    chunks = sorted({r.get(other) for r in rows}, key=str)
    cols = min(4, len(panels))
    grid_rows = math.ceil(len(panels) / cols)
    fig = plt.figure(figsize=(max(8.0, 4.4 * cols), 4.4 * grid_rows + 1.6))
    outer = fig.add_gridspec(grid_rows, cols, hspace=0.3, wspace=0.3)
    xs_all = sorted({r[key] for r in rows})
    for n, ((op, layer, m, k, nn), items) in enumerate(panels.items()):
        col = n % cols
        inner = outer[n // cols, col].subgridspec(2, 1, height_ratios=[2.2, 1], hspace=0.08)
        ax_k, ax_e = fig.add_subplot(inner[0]), fig.add_subplot(inner[1])
        for i, method in enumerate(methods):
            for c in chunks:
                pts = sorted((r for r in items if r["method"] == method and r.get(other) == c), key=lambda r: r[key])
                if not pts:
                    continue
                xs, marker = [r[key] for r in pts], _marker(chunks, c)
                for metric, style, _ in K_LINES:
                    ax_k.plot(xs, [r[metric] for r in pts], color=_color(method, i), linestyle=style, marker=marker,
                              markersize=4)
                ax_e.plot(xs, [r["E"] for r in pts], color=_color(method, i), marker=marker, markersize=4)
        _log_k_axis(ax_k, [r[m_] for r in items for m_ in ("k_comm", "k_comp")], max_k)
        ax_k.set_title(f"{op} {layer}: M={m} K={k} N={nn}", fontsize=9)
        ax_k.tick_params(labelbottom=False, labelsize=8)
        ax_e.set_ylim(0, 1.05)
        ax_e.axhline(1.0, color="grey", linewidth=0.6)
        ax_e.tick_params(labelsize=8)
        ax_e.set_xticks(xs_all)
        ax_k.set_xticks(xs_all)
        ax_e.set_xlabel(SWEPT[key], fontsize=8)
        if col == 0:
            ax_k.set_ylabel("k (log scale)", fontsize=8)
            ax_e.set_ylabel("E", fontsize=8)
    fig.suptitle(f"{title}: slow-down of each side under overlap (k, top) and comm hidden (E, bottom)\n{E_TEXT}",
                 fontsize=10)
    bottom = _legend(fig, methods, chunks, max_k, with_lines=True)
    fig.subplots_adjust(top=1 - 1.0 / fig.get_figheight(), bottom=bottom)
    return _save(fig, path, plt)


def _plot_points(rows, path, max_k, title) -> Path:
    """Nothing numeric swept: per op, k_comm, k_comp (log) and E for every shape (x) and method (colour)."""
    plt = _pyplot()
    ops = list(dict.fromkeys(r["op"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(2 * len(ops), 1, figsize=(max(8.0, 0.9 * len(_panels(rows)) + 3), 6.2 * len(ops) + 1),
                             squeeze=False, gridspec_kw={"height_ratios": [2.2, 1] * len(ops)})
    for o, op in enumerate(ops):
        items = [r for r in rows if r["op"] == op]
        shapes = list(dict.fromkeys((r["layer"], r["M"]) for r in items))
        ax_k, ax_e = axes[2 * o][0], axes[2 * o + 1][0]
        for i, method in enumerate(methods):
            pts = [r for r in items if r["method"] == method]
            xs = [shapes.index((r["layer"], r["M"])) + (i - (len(methods) - 1) / 2) * 0.12 for r in pts]
            for j, (metric, _, _) in enumerate(K_LINES):
                ax_k.plot(xs, [r[metric] for r in pts], color=_color(method, i), marker=MARKERS[j], linestyle="")
            ax_e.plot(xs, [r["E"] for r in pts], color=_color(method, i), marker="o", linestyle="")
        _log_k_axis(ax_k, [r[m] for r in items for m in ("k_comm", "k_comp")], max_k)
        labels = [f"{layer}\nM={m}" for layer, m in shapes]
        ax_k.set_xticks(range(len(shapes)), [""] * len(shapes))
        ax_e.set_xticks(range(len(shapes)), labels, fontsize=7)
        ax_e.set_ylim(0, 1.05)
        ax_e.axhline(1.0, color="grey", linewidth=0.6)
        fixed = ", ".join(f"{k}={items[0].get(k)}" for k in SWEPT)
        ax_k.set_title(f"{op}: one configuration per method ({fixed}); shape on the x axis", fontsize=9)
        ax_k.set_ylabel("k (log scale)", fontsize=8)
        ax_e.set_ylabel("E", fontsize=8)
    fig.suptitle(f"{title}: slow-down of each side under overlap (k, top) and comm hidden (E, bottom)\n{E_TEXT}",
                 fontsize=10)
    bottom = _legend(fig, methods, [], max_k, with_lines=False)
    fig.subplots_adjust(top=1 - 1.0 / fig.get_figheight(), bottom=bottom + 0.3 / fig.get_figheight(), hspace=0.25)
    return _save(fig, path, plt)


def _save(fig, path, plt) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(steps: list[tuple[str, dict]], path: str | Path, *,
                  xlabel: str = "ms from the start of the step") -> Path:
    """Gantt of one step per entry: (title, {lane: [(start_ms, end_ms)] or [(start_ms, end_ms, event name)]}).
    Named events (a profiled trace) are coloured by kind and their lanes named by what they run."""
    from matplotlib.patches import Patch

    from .trace_lanes import event_kind, lane_roles
    plt = _pyplot()
    count = max(1, len(steps))
    height = sum(1.0 + 0.42 * max(1, len(lanes)) for _, lanes in steps) + 1.0
    fig, axes = plt.subplots(count, 1, figsize=(11, height), squeeze=False)
    kinds_seen: dict[str, None] = {}
    for ax, (title, lanes) in zip(axes.flat, steps):
        named = any(len(span) == 3 for spans in lanes.values() for span in spans)
        labels = lane_roles(lanes) if named else {lane: lane for lane in lanes}
        right = max([e for spans in lanes.values() for _, e, *_ in spans] or [1.0])
        for i, lane in enumerate(lanes):
            for span in lanes[lane]:
                start, end = span[0], span[1]
                kind = event_kind(span[2]) if named else None
                if kind:
                    kinds_seen[kind] = None
                color = KIND_COLORS[kind] if kind else LANE_COLORS[i % len(LANE_COLORS)]
                ax.broken_barh([(start, max(end - start, right * 1e-3))], (i - 0.35, 0.7), color=color)
                if not named and end - start > 0.04 * right:
                    ax.text(end, i, f" {end - start:.3f} ms", va="center", fontsize=7)
        ax.set_yticks(range(len(lanes)), [labels[lane] for lane in lanes], fontsize=8)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, right * (1.02 if named else 1.18))
    if kinds_seen:
        fig.legend(handles=[Patch(color=KIND_COLORS[k], label=k) for k in kinds_seen], loc="lower center",
                   ncol=min(5, len(kinds_seen)), fontsize=8, frameon=False, title="bar colour: what the GPU ran",
                   title_fontsize=8)
    fig.tight_layout(rect=(0, 0.45 / height if kinds_seen else 0, 1, 1))
    return _save(fig, path, plt)
