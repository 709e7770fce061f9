"""The figures of the results of record, drawn from their JSON (`python -m tp_overlap.launch.results_md --plots`;
matplotlib, Agg backend, imported lazily: the project's `plot` extra).

plot_step_speedup: the TP MLP training step's speedup over `overlap=False` per model and M (launch.tp_mlp).
plot_op_efficiency: one op's E per shape and method, next to NCCL-then-GEMM (launch.bench).
plot_gemm_ratios: a GEMM's speed against its reference per local shape and M, as a grid of numbers
(launch.gemm_bench: bf16 against cuBLAS per layout, or FP8 against `torch._scaled_mm` and bf16 cuBLAS).
plot_host_cost: the host time of one eager call per op and method, and of a training step (launch.host_cost).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .plots import _pyplot

STEP_BARS = (("t_step", "CUDA-graph replay", "tab:blue", ""), ("sustained", "CUDA-graph replay, back-to-back",
             "tab:blue", "//"), ("eager", "eager", "tab:orange", ""), ("eager_sustained", "eager, back-to-back",
             "tab:orange", "//"))
METHOD_COLORS = {"decomposed": "tab:blue", "fused": "tab:orange", "epilogue_reduce": "tab:green", "pair": "tab:purple"}
OP_NAMES = {"ag_gemm": "AllGather + GEMM", "gemm_rs": "GEMM + ReduceScatter"}
LAYOUTS = {"kn": "[K, N] row-major", "nk": "the transpose view of [N, K]"}


def _save(fig, path, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _on(doc: dict) -> str:
    tp = doc.get("tp")
    return f"{tp} x {doc.get('device')}, TP {tp}" if tp and tp > 1 else f"one {doc.get('device')}"


def _commit(doc: dict | None) -> str:
    return str((doc or {}).get("commit") or "unknown")[:7]


def plot_step_speedup(graphs: dict, eager: dict | None, path: str | Path) -> Path:
    """Bars from 1.0 (the `overlap=False` step) to each speedup, per (model, M): graphed and eager, median
    step and back-to-back blocks (`--sustained`)."""
    plt = _pyplot()
    points = [(r["model"], r["M"]) for r in graphs["rows"]]
    by = {"t_step": {(r["model"], r["M"]): r.get("speedup") for r in graphs["rows"]},
          "sustained": {(r["model"], r["M"]): r.get("speedup_sustained") for r in graphs["rows"]}}
    if eager:
        by["eager"] = {(r["model"], r["M"]): r.get("speedup") for r in eager["rows"]}
        by["eager_sustained"] = {(r["model"], r["M"]): r.get("speedup_sustained") for r in eager["rows"]}
    bars = [b for b in STEP_BARS if b[0] in by and any(by[b[0]].get(p) for p in points)]
    fig, ax = plt.subplots(figsize=(10, 5.2))
    width = 0.8 / len(bars)
    for i, (key, label, color, hatch) in enumerate(bars):
        xs = [n + (i - (len(bars) - 1) / 2) * width for n in range(len(points))]
        values = [by[key].get(p) for p in points]
        ax.bar(xs, [(v or 1.0) - 1.0 for v in values], width * 0.92, bottom=1.0, color=color, hatch=hatch,
               edgecolor="white" if hatch else color, alpha=0.9 if not hatch else 0.55, label=label)
        for x, v in zip(xs, values):
            if v:
                ax.annotate(f"{v:.3f}", (x, v), xytext=(0, 3 if v >= 1 else -10), textcoords="offset points",
                            ha="center", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(points)), [f"{m}\nM = {mm} tokens" for m, mm in points])
    ax.set_ylabel("speedup over overlap=False (x)\n(its step time / ours)")
    ax.set_xlabel("model (MLP dimensions) and tokens per step")
    ax.grid(axis="y", alpha=0.3)
    low = min(v for key, *_ in bars for v in by[key].values() if v)
    high = max(v for key, *_ in bars for v in by[key].values() if v)
    ax.set_ylim(min(0.98, low - 0.03), high + 0.045)
    eager_commit = f", eager {_commit(eager)}" if eager and _commit(eager) != _commit(graphs) else ""
    ax.set_title(f"TP MLP training step (forward, backward, SGD; bf16) on {_on(graphs)}\n"
                 f"ours against the same module with overlap=False (NCCL); commit {_commit(graphs)}{eager_commit}",
                 fontsize=10)
    ax.legend(loc="upper right", fontsize=8, ncol=2, title="how the step ran", title_fontsize=8)
    fig.tight_layout()
    return _save(fig, path, plt)


def _best(rows: list[dict]) -> dict[tuple, dict]:
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["layer"], r["M"])
        if key not in best or r["t_ours_ms"] < best[key]["t_ours_ms"]:
            best[key] = r
    return best


def plot_op_efficiency(graphs: dict, eager: dict | None, path: str | Path) -> Path:
    """E per shape: each method of ours and NCCL-then-GEMM (graphed) as bars, the best eager call as a marker."""
    plt = _pyplot()
    rows = graphs["rows"]
    shapes = list(dict.fromkeys((r["layer"], r["M"]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    seq = {(r["layer"], r["M"]): r["E_seq"] for r in rows}
    fig, ax = plt.subplots(figsize=(13, 5.4))
    series = [(f"ours, {m}", METHOD_COLORS.get(m, "tab:purple"),
               {(r["layer"], r["M"]): r["E_ours"] for r in rows if r["method"] == m}) for m in methods]
    series.append(("NCCL collective and GEMM one after the other", "lightgrey", seq))
    width = 0.8 / len(series)
    for i, (label, color, values) in enumerate(series):
        xs = [n + (i - (len(series) - 1) / 2) * width for n in range(len(shapes))]
        ax.bar(xs, [values.get(s, 0) for s in shapes], width * 0.92, color=color, label=label)
    if eager:
        best = _best(eager["rows"])
        xs = [n for n, s in enumerate(shapes) if s in best]
        ax.plot(xs, [best[s]["E_ours"] for s in shapes if s in best], "kx", markersize=7, linestyle="",
                label=f"ours eager, best method (commit {_commit(eager)})")
    wins = sum(1 for r in _best(rows).values() if r["speedup_vs_seq"] > 1)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_ylim(0, 1.22)
    ax.set_xticks(range(len(shapes)), [f"{layer}\nM = {m}" for layer, m in shapes], fontsize=8)
    ax.set_xlabel("layer (local GEMM of the llama8b / llama70b MLP and attention projections) and tokens M")
    ax.set_ylabel("E = max(T_gemm, T_comm) / T_op\n(1 = communication fully hidden)")
    ax.grid(axis="y", alpha=0.3)
    op = OP_NAMES.get(graphs.get("op"), graphs.get("op"))
    ax.set_title(f"{op} on {_on(graphs)}, bf16, each call a CUDA-graph replay (commit {_commit(graphs)}): "
                 f"faster than the collective then GEMM at {wins} of {len(shapes)} shapes", fontsize=10)
    ax.legend(loc="upper left", fontsize=8, ncol=len(series) + bool(eager), frameon=False)
    fig.tight_layout()
    return _save(fig, path, plt)


def _grid(ax, rows: list[dict], key: str, norm, cmap, title: str, with_labels: bool):
    shapes = sorted({(r["layer"], r["tp"], r["K"], r["N"]) for r in rows}, key=lambda s: (s[0], s[1]))
    ms = sorted({r["M"] for r in rows})
    cell = {(r["layer"], r["tp"], r["K"], r["N"], r["M"]): r.get(key) for r in rows}
    values = [[cell.get((*s, m)) for m in ms] for s in shapes]
    image = ax.imshow([[v if v is not None else float("nan") for v in line] for line in values], cmap=cmap,
                      norm=norm, aspect="auto")
    for y, line in enumerate(values):
        for x, v in enumerate(line):
            ax.text(x, y, f"{v:.2f}" if v is not None else "n/a", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(ms)), [str(m) for m in ms], fontsize=8)
    ax.set_xlabel("M (rows of the local GEMM)", fontsize=8)
    labels = [f"{layer} TP{tp}: K={k} N={n}" for layer, tp, k, n in shapes]
    ax.set_yticks(range(len(shapes)), labels if with_labels else [""] * len(shapes), fontsize=7)
    ax.set_title(title, fontsize=9)
    return image


def plot_gemm_ratios(doc: dict, path: str | Path) -> Path:
    """A grid per layout (bf16: ours over cuBLAS) or per reference (FP8: ours over `_scaled_mm`, over bf16)."""
    from matplotlib.colors import TwoSlopeNorm
    plt = _pyplot()
    rows = doc["rows"]
    fp8 = doc.get("op") == "gemm_fp8"
    if fp8:
        panels = [(rows, "best_over_scaled_mm", "torch._scaled_mm", "against torch._scaled_mm (same scales)\nn/a: it "
                   "refuses K/128 not a multiple of 4", (0.8, 1.0, 1.1)),
                  (rows, "best_over_bf16", "bf16 cuBLAS", "against bf16 cuBLAS", (0.8, 1.0, 2.0))]
        what = "FP8 block-scaled GEMM (e4m3, 1x128 / 128x128 scales), the fastest block configuration per shape,"
    else:
        layouts = list(dict.fromkeys(r["layout"] for r in rows))
        panels = [([r for r in rows if r["layout"] == lay], "table_over_cublas", "cuBLAS",
                   f"against cuBLAS, layout {lay}: B {LAYOUTS.get(lay, lay)}",
                   (0.8, 1.0, 1.1)) for lay in layouts]
        what = "bf16 GEMM with the tuned block table"
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels) + 1.6, 10.5), squeeze=False)
    for n, (ax, (items, key, ref, title, (low, mid, high))) in enumerate(zip(axes[0], panels, strict=True)):
        values = [r[key] for r in items if r.get(key) is not None]
        title += f"\nmedian {statistics.median(values):.3f}, min {min(values):.3f} over {len(values)} points"
        image = _grid(ax, items, key, TwoSlopeNorm(mid, low, high), "RdYlGn", title, n == 0)
        bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
        bar.set_label(f"speed relative to {ref}: its time / ours (> 1: ours faster)", fontsize=8)
    fig.suptitle(f"{what} on {_on(doc)} (commit {_commit(doc)})\nevery local GEMM of the llama8b / llama70b "
                 "layers at TP 2, 4, 8; L2 flushed, median of interleaved repetitions", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return _save(fig, path, plt)


def plot_host_cost(doc: dict, path: str | Path) -> Path:
    """Host microseconds of one eager call per (op, method): replayed from its plan's graph and enqueued step
    by step, each with its `torch.mm` reference; the training step rows in a panel of their own."""
    plt = _pyplot()
    ops = [r for r in doc["rows"] if r["op"] in OP_NAMES]
    steps = [r for r in doc["rows"] if r["op"] not in OP_NAMES]
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.2), gridspec_kw={"width_ratios": [2.2, 1]})
    names = list(dict.fromkeys((r["op"], r["method"]) for r in ops))
    ax = axes[0]
    for i, (graphs, label, color) in enumerate(((True, "replayed from the plan's CUDA graph (default)", "tab:blue"),
                                                (False, "enqueued step by step (OVERLAP_EAGER_GRAPHS=0)",
                                                 "tab:orange"))):
        ys = [n + (0.2 if i else -0.2) for n in range(len(names))]
        found = [next((r for r in ops if (r["op"], r["method"]) == name and r["eager_graphs"] == graphs), None)
                 for name in names]
        ax.barh(ys, [r["host_us"] if r else 0 for r in found], 0.38, color=color, label=label)
        ax.plot([r["ref_host_us"] if r else None for r in found], ys, "k|", markersize=11,
                label="torch.mm of the op's whole GEMM in the same process" if i == 0 else None)
        for y, r in zip(ys, found):
            if r:
                ax.annotate(f"{r['ratio']:.2f}x torch.mm", (max(r["host_us"], r["ref_host_us"]), y), xytext=(5, 0),
                            textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(range(len(names)), [f"{OP_NAMES[op]}\n{method}" for op, method in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(r["host_us"] for r in ops) * 1.25)
    ax.set_xlabel("host time of one eager call (us)")
    ax.set_title("one op call (bars) and its reference (tick)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower left", fontsize=8, ncol=3, frameon=False)
    ax = axes[1]
    labels, values, colors = [], [], []
    for r in steps:
        step = r["op"].split(" (")[0]   # "tp_mlp step", "decoder block step"
        labels += [f"{step}: ours ({r['method']})", f"{step}: {r['ref'].replace(' step', '')}"]
        values += [r["host_us"], r["ref_host_us"]]
        colors += ["tab:blue", "lightgrey"]
    ax.barh(range(len(values)), values, 0.6, color=colors)
    for y, v in enumerate(values):
        ax.annotate(f"{v:.0f} us", (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values or [1]) * 1.3)
    ax.set_xlabel("host time of one eager step (us)")
    ax.set_title("training steps, forward + backward: ours (blue), overlap=False (grey)", fontsize=9, wrap=True)
    ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"Host time of eager calls, {doc.get('tp')} processes sharing one {doc.get('device')} "
                 f"(commit {_commit(doc)}; the device held busy, median per rank, max over ranks)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    return _save(fig, path, plt)
