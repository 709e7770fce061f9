"""The numbers of results/README.md, one kind per results file (launch/results_md.py assembles the page).

`file_tables(name, doc)` gives the markdown blocks of one results JSON: a summary of a few lines, and a table
only where it is short (the per-shape detail of the long files is in their figures and in the JSON).
`suite_line` summarises one JUnit XML of the GPU test suite.
"""

from __future__ import annotations

import json
import re
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

from tp_overlap.launch.output.report import format_table

COLUMNS = {  # file-name prefix -> columns of its table (those no row has are left out)
    "pool_bw": ["pool_backend", "size_bytes", "ce_pull_median_ms", "ce_pull_GBps", "allgather_median_ms",
                "allgather_GBps"],
    "tp_mlp": ["cuda_graphs", "model", "M", "t_step_overlap_ms", "t_step_baseline_ms", "t_step_torch_symm_ms",
               "speedup", "speedup_vs_torch_symm", "speedup_sustained", "sm_clock_overlap_mhz", "sm_clock_baseline_mhz",
               "k_comm_fc1_fwd_ag", "k_comp_fc1_fwd_ag", "rel_err_max"],
}


def current_command(recorded: str) -> str:
    """A recorded command as it runs from this checkout: files written before the import names moved under
    `tp_overlap` recorded `-m launch.<name>`."""
    return re.sub(r"(-m )launch\.", r"\1tp_overlap.launch.", recorded)


def short_commit(commit) -> str:
    return str(commit or "unknown")[:7] + ("+dirty" if str(commit).endswith("+dirty") else "")


def _prefix(name: str) -> str:
    return max((p for p in COLUMNS if name.startswith(p + "_")), key=len, default="")


def _table(rows: list[dict], columns: list[str]) -> str:
    return format_table(rows, [c for c in columns if any(r.get(c) is not None for r in rows)])


def _span(values, digits: int = 2) -> str:
    values = [v for v in values if v is not None]
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def best_rows(rows: list[dict]) -> list[dict]:
    """One row per shape point: the fastest of our methods/configs."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row.get("layer"), row.get("M"), row.get("K"), row.get("N"))
        if key not in best or row["t_ours_ms"] < best[key]["t_ours_ms"]:
            best[key] = row
    return list(best.values())


def _bench(rows: list[dict]) -> str:
    best = best_rows(rows)
    methods = ", ".join(f"{m} {sum(r['method'] == m for r in best)}" for m in dict.fromkeys(r["method"] for r in rows))
    e = [r["E_ours"] for r in best]
    rs = rows[0].get("op") == "gemm_rs"
    plain = "the GEMM then the collective" if rs else "the collective then the GEMM"
    text = (f"Best method per point: median E {statistics.median(e):.3f} (min {min(e):.3f}, max {max(e):.3f}) over "
            f"{len(best)} points, against {statistics.median(r['E_seq'] for r in best):.3f} for {plain}; fastest "
            f"method: {methods}.")
    for key, what in (("speedup_vs_seq", "GEMM-then-NCCL" if rs else "NCCL-then-GEMM"),
                      ("speedup_vs_torch", "PyTorch's async-TP op")):
        if all(r.get(key) for r in best):
            wins = [r[key] for r in best]
            text += f" Faster than {what} on {sum(w > 1 for w in wins)} of {len(best)} ({_span(wins)}x)."
    return text


def _kfactor(doc: dict) -> list[str]:
    rows = [r for r in doc["rows"] if r.get("op") != "ag_regime"]
    max_k = doc.get("max_k") or float("inf")
    out = []
    for key in dict.fromkeys((r["op"], r["method"]) for r in rows):
        mine = [r for r in rows if (r["op"], r["method"]) == key]
        out.append({"op": key[0], "method": key[1], "rows": len(mine),
                    "sm_margin": ",".join(str(s) for s in sorted({r["sm_margin"] for r in mine})),
                    "k_comm": _span(r["k_comm"] for r in mine), "k_comp": _span(r["k_comp"] for r in mine),
                    "E": _span(r["E"] for r in mine),
                    "within_gate": sum(max(r["k_comm"], r["k_comp"]) <= max_k for r in mine)})
    blocks = [f"Per op and method, over every shape and configuration (gate k <= {doc.get('max_k')}):",
              format_table(out, list(out[0]))] if out else []
    regimes = [r for r in doc["rows"] if r.get("op") == "ag_regime"]
    if regimes:
        summary = [{"comm": c, "comp": p, "points": len(mine), "k_comm": _span(r["k_comm"] for r in mine),
                    "k_comp": _span(r["k_comp"] for r in mine)}
                   for c, p in dict.fromkeys((r["comm"], r["comp"]) for r in regimes)
                   for mine in [[r for r in regimes if (r["comm"], r["comp"]) == (c, p)]]]
        blocks += ["The AllGather next to the two kinds of work (`--ops regimes`: comm `ce` = our copy-engine gather, "
                   "`nccl` = the collective; comp `gemm` = the shape's GEMM, `membound` = RMSNorm passes over the "
                   "gathered rows), over the AG shapes at each M:", format_table(summary, list(summary[0]))]
    return blocks


def _gemm(doc: dict) -> str:
    parts = [f"layout {lay}: median {s['median']:.3f}, min {s['min']:.3f}, at least 0.85 on {s['at_least_0.85']} of "
             f"{s['n']}" for lay, s in (doc.get("summary") or {}).items()]
    return "Table over cuBLAS per layout: " + "; ".join(parts) + "."


def _gemm_fp8(doc: dict) -> str:
    rows = [r for r in doc["rows"] if r.get("best_over_scaled_mm") is not None]
    big = [r["best_over_bf16"] for r in doc["rows"] if r["M"] >= 4096 and r.get("best_over_bf16")]
    return (f"Best over `torch._scaled_mm`: median {statistics.median(r['best_over_scaled_mm'] for r in rows):.3f}, "
            f"min {min(r['best_over_scaled_mm'] for r in rows):.3f} over {len(rows)} points; over bf16 cuBLAS at "
            f"M >= 4096: median {statistics.median(big):.2f}, min {min(big):.2f} over {len(big)} points.")


def _gemm_tune(doc: dict) -> str:
    s = doc.get("summary") or {}
    rows = doc.get("rows") or []
    return (f"{s.get('measured')} points measured ({s.get('elapsed_s')} s): the fastest candidate over cuBLAS, median "
            f"{s.get('median_over_cublas', 0):.3f}, min {s.get('min_over_cublas', 0):.3f}; at least 0.85 on "
            f"{sum(r['best_over_cublas'] >= 0.85 for r in rows)} of {len(rows)}; failed candidates: "
            f"{len(doc.get('failed') or {})}.")


def _host_cost(doc: dict) -> str:
    ops = [r for r in doc["rows"] if r["op"] in ("ag_gemm", "gemm_rs")]
    text = []
    for graphs, what in ((True, "replayed from its plan's graph"), (False, "enqueued step by step")):
        mine = [r for r in ops if r["eager_graphs"] == graphs]
        if mine:
            text.append(f"{what}: {_span(r['ratio'] for r in mine)}x the host time of the op's `torch.mm` "
                        f"({_span((r['host_us'] for r in mine), 0)} us, {_span((r['py_calls'] for r in mine), 0)} "
                        "Python calls)")
    text += [f"{r['op']}: {r['host_us']:.0f} us against {r['ref_host_us']:.0f} us for the {r['ref']} "
             f"({r['ratio']:.2f}x)" for r in doc["rows"] if r["op"] not in ("ag_gemm", "gemm_rs")]
    return "One eager call " + "; ".join(text) + "."


def _offload(doc: dict) -> str:
    out = []
    for point in doc.get("points") or []:
        mine = [r for r in doc["rows"] if (r["model"], r["layers"], r["M"]) == (point["model"], point["layers"],
                                                                             point["M"])]
        auto = next((r for r in mine if r["variant"] == "planner"), None)
        none = next((r for r in mine if r["variant"] == "none"), None)
        if not (auto and none):
            continue
        errors = [abs(r["time_error"]) for r in mine if r.get("time_error") is not None]
        out.append({"model": point["model"], "layers": point["layers"], "M": point["M"],
                    "t_none_ms": round(none["t_step_ms"], 1), "planner_time_vs_none": round(auto["time_vs_none"], 3),
                    "planner_act_vs_none": round(auto["act_vs_none"], 3),
                    "planner_peak_vs_none": round(auto["peak_vs_none"], 3),
                    "max_time_error": f"{100 * max(errors):.1f} %",
                    "peaks_exact": all(r.get("peak_error") == 0 for r in mine),
                    "bitwise": all(r.get("bitwise") for r in mine)})
    return ("The planner at its default budget against `none`, per point; every variant's step time against the "
            "step model's prediction (the table per variant is in the JSON):\n\n" + format_table(out, list(out[0]))
            if out else "")


def _offload_heat(doc: dict) -> str:
    """tests/unit/test_offload_heat_out_of_sample.py: the step model with and without heat, out of sample."""
    scales = {"own_plain_step": "the predicted point's plain step", "fit_point": "the fit point"}
    rows = [{"model": r["model"], "compute scale from": scales[r["scale"]], "predictions": r["predictions"],
             "mean error": f"{100 * r['mean_abs_error']:.2f} %", "worst": f"{100 * r['max_abs_error']:.2f} %",
             "within 3 %": r["within_3pct"]} for r in doc["rows"]]
    plans = doc.get("plans") or []
    text = format_table(rows, list(rows[0]))
    if plans:
        text += (f"\n\nThe planner's default plan with and without heat: the same decisions at "
                 f"{sum(p['same_plan'] for p in plans)} of {len(plans)} points, the same predicted peak at "
                 f"{sum(p['same_peak'] for p in plans)}.")
    return text


SMOKE_GROUPS = {  # a smoke case's first word -> its row
    "pool": "ops (every method, FP8)", "ag_gemm": "ops (every method, FP8)", "gemm_rs": "ops (every method, FP8)",
    "captured": "CUDA graphs (captured, capture idioms, eager replays)", "capture": "CUDA graphs (captured, capture "
    "idioms, eager replays)", "eager": "CUDA graphs (captured, capture idioms, eager replays)",
    "refusals": "refusals and failures", "reliability": "refusals and failures", "a": "refusals and failures",
    "TPMLP": "TPMLP (eager, captured, compiled)", "converted": "converted model", "FSDP2": "FSDP2 probe"}


def _smoke(doc: dict) -> str:
    """One row per kind of case (its first words), one column per process count: cases ok of cases run."""
    kinds: dict[str, dict] = {}
    for world, lines in doc["lines"].items():
        for line in lines:
            found = re.search(r": (ok|FAIL)\b", line)   # a case's name may hold ": " itself
            head, status = (line[:found.start()], found.group(1)) if found else (line, "")
            case = head.split(" ", 1)[1] if " " in head else head
            words = case.split(" ")
            kind = SMOKE_GROUPS.get(words[0], words[0])
            cell = kinds.setdefault(kind, {}).setdefault(f"W={world}", [0, 0])
            cell[0] += status.startswith("ok")
            cell[1] += 1
    rows = [{"cases": kind} | {w: f"{ok} of {n}" for w, (ok, n) in cells.items()} for kind, cells in kinds.items()]
    return format_table(rows, ["cases", *[f"W={w}" for w in doc["lines"]]])


def _gemm_fused(doc: dict) -> str:
    """launch.gemm_bench --ops: per op, its own GEMM over cuBLAS under the same carveout, against the targets."""
    rows = [{"op": variant, "points": v["n"], "median": round(v["median"], 3), "min": round(v["min"], 3),
             "min at M >= 4096": "-" if v["min_at_m_4096"] is None else round(v["min_at_m_4096"], 3),
             "below 0.90 at M >= 4096": v["below_0.90_at_m_4096"],
             "targets met": ", ".join(k for k, ok in v["targets_met"].items() if ok) or "none"}
            for variant, v in (doc.get("summary") or {}).items()]
    return ("Each op's time over cuBLAS's (the table per point is in the JSON):\n\n" + format_table(rows, list(rows[0]))
            if rows else "")


def file_tables(name: str, doc: dict) -> list[str]:
    """Markdown blocks for one results JSON: a summary where there is one, then a short table."""
    rows = doc.get("rows") if isinstance(doc.get("rows"), list) else []
    op = doc.get("op")
    if name.startswith("smoke_"):
        return [_smoke(doc)]
    if name.startswith("zero_sm_wait"):
        return [f"Median start of the copy after the GEMM's start: {doc['median_start_us']:.1f} us over {len(rows)} "
                f"repeats (limit {doc['limit_us']:.0f} us: {'met' if doc['ok'] else 'NOT met'}); {doc['gemm']}, copy "
                f"{doc['copy']}, wait {doc['wait']}."]
    if name.startswith("swiglu_check"):
        t = doc["times_ms"]
        return [f"{sum(c['passed'] for c in doc['checks'])} of {len(doc['checks'])} checks bitwise equal. Forward "
                f"{t['forward_fused_ms']:.3f} ms against {t['forward_unfused_ms']:.3f} ms; backward "
                f"{t['backward_fused_ms']:.3f} ms against {t['backward_autograd_ms']:.3f} ms."]
    if name.startswith("gemm_fp8_gluon"):
        s = doc["summary"]
        return [f"{sum(c.get('ok', False) for c in doc['correctness'])} of {len(doc['correctness'])} correctness cases "
                f"pass; over `torch._scaled_mm` median {s['over_scaled_mm_median']:.3f}, min "
                f"{s['over_scaled_mm_min']:.3f} ({s['timed_points']} points); over bf16 cuBLAS at M >= 4096 at least "
                f"{s['over_bf16_min_at_m_ge_4096']:.2f}."]
    if name.startswith("launch_overhead"):   # its caption gives every launch kind's cost
        return []
    if doc.get("kind") == "kfactor":
        return _kfactor(doc)
    if op in ("ag_gemm", "gemm_rs") and rows:
        return [_bench(rows)]
    blocks = {"gemm": _gemm, "gemm_fp8": _gemm_fp8, "gemm_tune": _gemm_tune, "host_cost": _host_cost,
              "offload_bench": _offload, "offload_heat": _offload_heat, "gemm_fused_ops": _gemm_fused}
    if op in blocks:
        return [blocks[op](doc)]
    columns = COLUMNS.get(_prefix(name))
    return [_table(rows, columns or list(rows[0]))] if rows else []


def suite_line(path: Path) -> str:
    """One JUnit XML of the GPU test suite: tests, failures, errors, skipped, seconds."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")}
    return (f"{counts['tests']} tests, {counts['failures']} failures, {counts['errors']} errors, {counts['skipped']} "
            f"skipped, {float(counts['time'] or 0):.0f} s")


def load(path: Path) -> dict:
    return json.loads(path.read_text())
