"""Draw the PNGs of a results folder from the data next to them (`python -m tp_overlap.launch.results_md --plots`).

* `<stem>.png` next to a launch.kfactor JSON `<stem>.json`: its sweep (k and E against the swept setting).
* `tp_mlp_<gpu>_tp<W>_speedup.png` from `tp_mlp_<gpu>_tp<W>_graphs.json` (and the eager `tp_mlp_<gpu>_tp<W>.json`):
  the training step's speedup per model and M.
* `<op>_<gpu>_tp<W>_efficiency.png` from `<op>_<gpu>_tp<W>_graphs.json` (and the eager file), op ag_gemm or
  gemm_rs: E per shape and method next to the collective then the GEMM.
* `gemm_<gpu>.png`, `gemm_fp8_<gpu>.png` from the launch.gemm_bench JSON of that name: speed against the
  reference per local shape and M; `host_cost_<gpu>.png` from launch.host_cost's; `<stem>.png` next to a
  launch.offload_bench JSON: peak memory against step time per variant.
* `<prefix>_timeline<suffix>.png` next to Chrome traces `<prefix>[_<part>]<suffix>.trace.json` (part: a
  launch.tp_mlp variant `overlap_rank0` / `baseline_rank0`, or a launch.kfactor op): one panel per trace,
  lanes named by what they run, bars coloured by kind.

A PNG without such data is reported, not touched.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import plots as _plots
from . import record_plots as _record
from .trace_lanes import stream_lanes, summarise

PARTS = ("overlap_rank0", "baseline_rank0", "ag_gemm", "gemm_rs")
XLABEL = "ms from the step's first GPU activity (rank 0)"


def _kfactor_doc(path: Path) -> dict | None:
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    return doc if doc.get("kind") == "kfactor" else None


def _traces(png: Path) -> list[tuple[str, Path]]:
    prefix, _, suffix = png.stem.partition("_timeline")
    found = [(part, png.with_name(f"{prefix}_{part}{suffix}.trace.json")) for part in PARTS]
    found.append(("", png.with_name(f"{prefix}{suffix}.trace.json")))
    return [(part, path) for part, path in found if path.is_file()]


def _kfactor_title(doc: dict | None, op: str) -> str:
    """The step kfactor profiles: the last shape of the op, at its fastest configuration."""
    rows = [r for r in (doc or {}).get("rows", []) if r.get("op") == op and r.get("t_op_ms") is not None]
    if not rows:
        return op
    shape = tuple(rows[-1][k] for k in ("layer", "M", "K", "N"))
    best = min((r for r in rows if tuple(r[k] for k in ("layer", "M", "K", "N")) == shape), key=lambda r: r["t_op_ms"])
    return (f"{op} {best['layer']} M={best['M']} K={best['K']} N={best['N']}: one overlapped step, {best['method']}, "
            f"sm_margin={best['sm_margin']}, chunks_per_rank={best.get('chunks_per_rank')}")


def _title(png: Path, part: str, lanes: dict, doc: dict | None) -> str:
    span = summarise(lanes)["span_ms"]
    match = re.match(r"tp_mlp_(\w+?)_M(\d+)(_graphs)?_timeline_(\w+)$", png.stem)
    if match:
        model, m, graphs, commit = match.groups()
        variant = "ours (overlap)" if part.startswith("overlap") else "overlap=False (NCCL)"
        kind = "CUDA-graph replay" if graphs else "eager"
        return f"{model} M={m}, {variant}, one training step ({kind}, commit {commit}): span {span:.2f} ms"
    op = part or next((r["op"] for r in (doc or {}).get("rows", [])), "")
    return f"{_kfactor_title(doc, op) if op else png.stem.replace('_timeline', '')}: span {span:.2f} ms"


def _pairs(directory: Path) -> list[tuple[Path, object]]:
    """(PNG, drawer) for every figure drawn from a JSON of the folder's top level."""
    found = []
    for path in sorted(directory.glob("*.json")):
        if path.name.endswith(".trace.json"):
            continue
        name, doc = path.name, json.loads(path.read_text())
        eager = path.with_name(name.replace("_graphs.json", ".json"))
        other = json.loads(eager.read_text()) if name.endswith("_graphs.json") and eager.is_file() else None
        if doc.get("kind") == "kfactor":
            title = f"{path.stem} ({doc['device']}, TP{doc['tp']})"
            found.append((path.with_suffix(".png"),
                          lambda png, d=doc, t=title: _plots.plot_sweep(d["rows"], png, max_k=d.get("max_k"), title=t)))
        elif re.match(r"tp_mlp_\w+_graphs\.json$", name):
            found.append((eager.with_name(eager.stem + "_speedup.png"),
                          lambda png, d=doc, e=other: _record.plot_step_speedup(d, e, png)))
        elif re.match(r"(ag_gemm|gemm_rs)_\w+_graphs\.json$", name):
            found.append((eager.with_name(eager.stem + "_efficiency.png"),
                          lambda png, d=doc, e=other: _record.plot_op_efficiency(d, e, png)))
        elif re.match(r"gemm(_fp8)?_[a-z0-9]+\.json$", name) and doc.get("op") in ("gemm", "gemm_fp8"):
            found.append((path.with_suffix(".png"), lambda png, d=doc: _record.plot_gemm_ratios(d, png)))
        elif re.match(r"host_cost_[a-z0-9]+\.json$", name):
            found.append((path.with_suffix(".png"), lambda png, d=doc: _record.plot_host_cost(d, png)))
        elif doc.get("op") == "offload_bench" and doc.get("points"):
            from .offload_plot import plot_pareto
            title = (f"activation offload on one {doc.get('device')} (commit {str(doc.get('commit'))[:7]}): "
                     "peak memory against step time per variant")
            found.append((path.with_suffix(".png"),
                          lambda png, d=doc, t=title: plot_pareto(d["points"], d["rows"], png, title=t)))
    return found


def redraw(directory: Path) -> tuple[list[str], list[str]]:
    """(PNGs drawn, PNGs left as they are for want of data), as paths relative to `directory`."""
    done, missing = [], []
    drawn = {}
    for png, draw in _pairs(directory):
        draw(png)
        drawn[png] = None
        done.append(str(png.relative_to(directory)))
    for png in sorted(directory.rglob("*.png")):
        if png in drawn:
            continue
        if "_timeline" in png.stem and _traces(png):
            prefix, _, suffix = png.stem.partition("_timeline")
            owner = (_kfactor_doc(png.with_name(f"{prefix}{suffix}.json"))
                     or _kfactor_doc(png.with_name(f"{prefix}.json")))
            steps = []
            for part, path in _traces(png):
                lanes = stream_lanes(json.loads(path.read_text()))
                steps.append((_title(png, part, lanes, owner), lanes))
            _plots.plot_timeline(steps, png, xlabel=XLABEL)
        else:
            missing.append(str(png.relative_to(directory)))
            continue
        done.append(str(png.relative_to(directory)))
    return done, missing
