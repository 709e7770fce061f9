"""The tables of results/README.md, one kind per results file (launch/results_md.py assembles the page).

`file_tables(name, doc)` gives the markdown blocks of one results JSON (a summary line and its tables);
`history_tables`, `trace_table` and `suite_table` summarise the earlier measurements, the profiled steps and
the GPU test-suite runs, one line per file.
"""

from __future__ import annotations

import json
import re
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

from tp_overlap.launch.output.report import format_table

LONG_TABLE_ROWS = 30   # longer tables fold under a <details> line
COLUMNS = {  # file-name prefix -> columns (those no row has are left out)
    "pool_bw": ["size_bytes", "ce_pull_median_ms", "ce_pull_GBps", "allgather_median_ms", "allgather_GBps"],
    "gemm_fp8": ["layer", "tp", "M", "K", "N", "t_cublas_bf16_ms", "t_scaled_mm_ms", "best_blocks", "t_best_ms",
                 "best_over_scaled_mm", "best_over_bf16", "default_rel_err"],
    "gemm": ["layer", "op", "tp", "layout", "M", "K", "N", "t_cublas_ms", "t_triton_best_ms", "best_blocks",
             "triton_over_cublas", "t_table_ms", "table_blocks", "table_over_cublas", "heuristic_over_cublas"],
    "host_cost": ["op", "method", "eager_graphs", "host_us", "mm_host_us", "ratio_to_mm", "host_min_us",
                  "host_max_us"],
    "offload": ["model", "M", "layers", "variant", "peak_gib", "peak_vs_none", "t_step_ms", "time_vs_none", "bitwise",
                "pred_step_ms", "pred_peak_gib"],
    "ag_gemm": ["layer", "M", "K", "N", "method", "t_ours_ms", "t_seq_nccl_ms", "t_torch_ms", "t_gemm_ms", "t_comm_ms",
                "E_ours", "E_seq", "E_torch", "speedup_vs_seq", "speedup_vs_torch", "k_comm", "k_comp"],
    "gemm_rs": ["layer", "M", "K", "N", "method", "sm_margin", "t_ours_ms", "t_seq_nccl_ms", "t_torch_ms", "t_gemm_ms",
                "t_comm_ms", "E_ours", "E_seq", "E_torch", "speedup_vs_seq", "speedup_vs_torch"],
    "ag_host_cost": ["layer", "M", "variant", "device_hold", "t_device_ms", "t_host_enqueue_ms"],
    "kfactor": ["op", "layer", "M", "K", "N", "method", "sm_margin", "chunks_per_rank", "t_comm_solo_ms",
                "t_comp_solo_ms", "k_comm", "k_comp", "E", "t_op_ms", "k_comm_op", "k_comp_op", "start_late_ms"],
    "kfactor_regimes": ["layer", "M", "K", "N", "comm", "comp", "membound_passes", "t_comm_solo_ms", "t_comp_solo_ms",
                        "k_comm", "k_comp", "E", "start_late_ms"],
    "tp_mlp": ["model", "M", "t_step_overlap_ms", "t_step_baseline_ms", "t_step_torch_symm_ms", "speedup",
               "speedup_vs_torch_symm", "speedup_sustained", "speedup_sustained_vs_torch_symm", "sm_clock_overlap_mhz",
               "sm_clock_baseline_mhz", "k_comm_fc1_fwd_ag", "k_comp_fc1_fwd_ag", "rel_err_max"],
    "launch_overhead": ["launch", "host_us_per_launch", "device_us_per_launch"],
    "zero_sm_wait": ["copy_start_after_gemm_start_us", "gemm_ms", "copy_ms"],
}


def short_commit(commit) -> str:
    return str(commit or "unknown")[:7] + ("+dirty" if str(commit).endswith("+dirty") else "")


def _prefix(name: str) -> str:
    return max((p for p in COLUMNS if name.startswith(p + "_")), key=len, default="")


def _table(rows: list[dict], columns: list[str]) -> str:
    present = [c for c in columns if any(r.get(c) is not None for r in rows)]
    text = format_table(rows, present)
    if len(rows) > LONG_TABLE_ROWS:
        return f"<details><summary>{len(rows)} rows</summary>\n\n{text}\n\n</details>"
    return text


def best_rows(rows: list[dict]) -> list[dict]:
    """One row per shape point: the fastest of our methods/configs."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row.get("layer"), row.get("M"), row.get("K"), row.get("N"))
        if key not in best or row["t_ours_ms"] < best[key]["t_ours_ms"]:
            best[key] = row
    return list(best.values())


def _bench_summary(rows: list[dict]) -> str:
    best = best_rows(rows)
    e = [r["E_ours"] for r in best]
    lines = [f"Best configuration per point: median E_ours {statistics.median(e):.3f} (min {min(e):.3f}, max "
             f"{max(e):.3f}) over {len(best)} points; median E_seq {statistics.median(r['E_seq'] for r in best):.3f}."]
    for key, what in (("speedup_vs_seq", "NCCL-then-GEMM"), ("speedup_vs_torch", "PyTorch async-TP")):
        if all(r.get(key) for r in best):
            lines.append(f"Faster than {what} on {sum(r[key] > 1 for r in best)} of {len(best)} points.")
    return " ".join(lines)


def _smoke_table(doc: dict) -> str:
    """One row per case, one column per process count: ok, or FAIL and the error's last line."""
    cases: dict[str, dict] = {}
    for world, lines in doc["lines"].items():
        for line in lines:
            head, _, status = line.partition(": ")
            case = head.split(" ", 1)[1] if " " in head else head
            verdict = "ok" if status.startswith("ok") else "FAIL " + status.strip().splitlines()[-1][:60]
            cases.setdefault(case, {})[f"W={world}"] = verdict
    worlds = [f"W={w}" for w in doc["lines"]]
    rows = [{"case": case} | verdicts for case, verdicts in cases.items()]
    return format_table(rows, ["case", *worlds])


def file_tables(name: str, doc: dict) -> list[str]:
    """Markdown blocks for one results JSON: a summary line where there is one, then the table(s)."""
    rows = doc.get("rows") if isinstance(doc.get("rows"), list) else []
    prefix = _prefix(name)
    if name.startswith("smoke_"):
        return [_smoke_table(doc)]
    if prefix == "zero_sm_wait":
        return [f"Median start of the copy after the GEMM's start: {doc['median_start_us']:.1f} us "
                f"(limit {doc['limit_us']:.0f} us: {'met' if doc['ok'] else 'NOT met'}); {doc['gemm']}, copy "
                f"{doc['copy']}, wait {doc['wait']}.", _table(rows, COLUMNS[prefix])]
    if prefix == "kfactor":
        ops = [r for r in rows if r.get("op") != "ag_regime"]
        regimes = [r for r in rows if r.get("op") == "ag_regime"]
        blocks = [_table(ops, COLUMNS["kfactor"])] if ops else []
        if regimes:
            blocks += ["The AllGather next to the two kinds of work (`--ops regimes`: comm `ce` = our copy-engine "
                       "gather, `nccl` = the collective; comp `gemm` = the shape's GEMM, `membound` = RMSNorm "
                       "passes over the gathered rows):", _table(regimes, COLUMNS["kfactor_regimes"])]
        return blocks
    blocks = [_bench_summary(rows)] if rows and "E_ours" in rows[0] else []
    if isinstance(doc.get("summary"), dict):
        blocks.append("Summary: " + ", ".join(f"{k} {json.dumps(v)}" for k, v in doc["summary"].items()))
    return blocks + [_table(rows, COLUMNS.get(prefix) or list(rows[0]) if rows else [])]


def _config_of(command: str | None) -> str:
    match = re.search(r"--config (\S+)", command or "")
    return Path(match.group(1)).name if match else "preset"


def history_tables(directory: Path) -> list[str]:
    """The earlier TP MLP steps (one row per point) and op benchmarks (one row per file)."""
    steps, ops, other = [], [], []
    for path in sorted(directory.glob("*.json")):
        doc = json.loads(path.read_text())
        common = {"file": path.name, "commit": short_commit(doc.get("commit"))}
        if doc.get("op") == "tp_mlp":
            steps += [common | {"config": _config_of(doc.get("command") or doc.get("command_recorded")),
                                "graphs": bool(doc.get("cuda_graphs")), **{k: r.get(k) for k in
                                ("model", "M", "t_step_overlap_ms", "t_step_baseline_ms", "speedup",
                                 "speedup_vs_torch_symm")}} for r in doc["rows"]]
        elif doc.get("op") in ("ag_gemm", "gemm_rs") and doc.get("rows"):
            best = best_rows(doc["rows"])
            ops.append(common | {"op": doc["op"], "graphs": bool(doc.get("cuda_graphs")),
                                 "median_E_ours": statistics.median(r["E_ours"] for r in best),
                                 "faster_than_seq": f"{sum(r['speedup_vs_seq'] > 1 for r in best)} of {len(best)}"})
        else:
            other.append(common | {"what": doc.get("command_note") or doc.get("command")})
    return [format_table(steps, ["file", "commit", "config", "graphs", "model", "M", "t_step_overlap_ms",
                                 "t_step_baseline_ms", "speedup", "speedup_vs_torch_symm"]),
            format_table(ops, ["file", "commit", "op", "graphs", "median_E_ours", "faster_than_seq"]),
            format_table(other, ["file", "commit", "what"])]


def trace_table(directory: Path) -> str:
    """Each profiled TP MLP step: model, M, eager or graphed, commit, and the span of ours and of the baseline."""
    from ..measure.timeline import stream_lanes, summarise
    rows: dict[tuple, dict] = {}
    for path in sorted(directory.glob("tp_mlp_*_rank0_*.trace.json")):
        match = re.match(r"tp_mlp_(\w+?)_M(\d+)(_graphs)?_(overlap|baseline)_rank0_(\w+)\.trace\.json$", path.name)
        if not match:
            continue
        model, m, graphs, variant, commit = match.groups()
        span = summarise(stream_lanes(json.loads(path.read_text())))["span_ms"]
        png = f"tp_mlp_{model}_M{m}{graphs or ''}_timeline_{commit}.png"
        row = rows.setdefault((model, int(m), bool(graphs), commit), {
            "model": model, "M": int(m), "graphs": bool(graphs), "commit": commit,
            "figure": f"[{png}](traces/{png})" if (directory / png).is_file() else "-"})
        row[f"span_{variant}_ms"] = span
    ordered = sorted(rows.values(), key=lambda r: (r["model"], r["M"], r["graphs"], r["commit"]))
    return format_table(ordered, ["model", "M", "graphs", "commit", "span_overlap_ms",
                                              "span_baseline_ms", "figure"])


def suite_table(directory: Path) -> str:
    """One row per JUnit XML of the GPU test suite: tests, failures, errors, skipped, seconds."""
    rows = []
    for path in sorted(directory.glob("gpu_tests_*.xml")):
        root = ET.parse(path).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        commit = re.search(r"_([0-9a-f]{7})\.xml$", path.name)
        rows.append({"file": path.name, "commit": commit.group(1) if commit else "-",
                     **{k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")}})
    return format_table(rows, ["file", "commit", "tests", "failures", "errors", "skipped", "time"])
