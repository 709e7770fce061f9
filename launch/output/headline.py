"""The README's headline table, rendered from the results of record (`python -m tp_overlap.launch.results_md
--headline` prints it; tests/unit/test_readme.py checks that the README holds it as rendered).

One row per headline result: what, the number, the hardware and commit, and the command that measured it (as
recorded, less its `--out`: without it a launcher writes a run folder).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

from .report import format_table
from .results_tables import best_rows, current_command


def _speedups(doc: dict, key: str, m: int) -> str:
    rows = {r["model"]: r[key] for r in doc["rows"] if r["M"] == m and r.get(key)}
    return ", ".join(f"{model} {value:.3f}x" for model, value in rows.items())


def _step(doc: dict) -> str:
    m = max(r["M"] for r in doc["rows"])
    return (f"MLP dimensions of {_speedups(doc, 'speedup', m)} faster than `overlap=False` (NCCL) at M = {m}; "
            f"steps run back to back (the GPU at its power cap) {_speedups(doc, 'speedup_sustained', m)}")


def _op(doc: dict) -> str:
    best = best_rows(doc["rows"])
    wins = sum(r["speedup_vs_seq"] > 1 for r in best)
    plain = "the GEMM then the collective" if doc.get("op") == "gemm_rs" else "the collective then the GEMM"
    return (f"median E {statistics.median(r['E_ours'] for r in best):.3f} ({plain}: "
            f"{statistics.median(r['E_seq'] for r in best):.3f}); faster on {wins} of {len(best)} shapes")


def _gemm(doc: dict) -> str:
    s = doc["summary"]
    return (f"median {s['kn']['median']:.3f} (B row-major) and {s['nk']['median']:.3f} (B = W.t(), nn.Linear's) of "
            f"cuBLAS; at least {min(v['min'] for v in s.values()):.3f} at all {sum(v['n'] for v in s.values())} points "
            "(local shape x M x layout)")


def _fp8(doc: dict) -> str:
    rows = [r for r in doc["rows"] if r.get("best_over_scaled_mm") is not None]
    big = [r["best_over_bf16"] for r in doc["rows"] if r["M"] >= 4096 and r.get("best_over_bf16")]
    return (f"median {statistics.median(r['best_over_scaled_mm'] for r in rows):.2f} of `torch._scaled_mm`; "
            f"median {statistics.median(big):.2f}x bf16 cuBLAS at M >= 4096")


def _floor(value: float) -> str:
    """A minimum to two decimals, rounded down: "at least 0.94" must not stand for 0.9378."""
    return f"{math.floor(round(value * 100, 6)) / 100:.2f}"  # round first: 0.57 * 100 is 56.99999999999999


def _fused(doc: dict) -> str:
    s = doc["summary"]
    bf16 = [s[v] for v in ("ag_fused", "rs_fused", "rs_epilogue_reduce")]
    text = (f"AllGather consumer median {bf16[0]['median']:.3f} of cuBLAS, ReduceScatter scatter GEMM "
            f"{bf16[1]['median']:.3f} (cuBLAS under the same SM carve-out), epilogue_reduce {bf16[2]['median']:.3f}: "
            f"at least {_floor(min(v['min_at_m_4096'] for v in bf16))} at M >= 4096, "
            f"{_floor(min(v['min'] for v in bf16))} everywhere")
    if "ag_fused_fp8" in s:
        text += f"; FP8 consumer {s['ag_fused_fp8']['median']:.3f} of `torch._scaled_mm`"
    return text


def _host(doc: dict) -> str:
    ops = [r["ratio"] for r in doc["rows"] if r["op"] in ("ag_gemm", "gemm_rs") and r["eager_graphs"]]
    steps = {r["op"].split(" (")[0]: r for r in doc["rows"] if r["op"] not in ("ag_gemm", "gemm_rs")}
    text = f"one eager op call: {min(ops):.2f}-{max(ops):.2f}x the host time of one `torch.mm`"
    for step, what in (("tp_mlp step", "an eager MLP step"), ("decoder block step", "a converted decoder block's step")):
        if step in steps:
            text += f"; {what}: {steps[step]['ratio']:.2f}x the host time of the same step with `overlap=False`"
    return text


def _offload(doc: dict) -> str:
    auto = [r for r in doc["rows"] if r["variant"] == "planner" and r["model"] == "llama8b"]
    error = max(abs(r["time_error"]) for r in doc["rows"] if r.get("time_error") is not None)
    return (f"llama8b: {min(r['act_vs_none'] for r in auto):.2f}-{max(r['act_vs_none'] for r in auto):.2f} of the "
            f"activation memory at {min(r['time_vs_none'] for r in auto):.2f}-"
            f"{max(r['time_vs_none'] for r in auto):.2f}x the step time; step times within {100 * error:.1f} % of "
            "the planner's prediction")


ROWS = (  # (results file, what, how the number reads)
    ("tp_mlp_h200_tp2_graphs.json", "TP MLP training step, CUDA-graph replay", _step),
    ("tp_mlp_h200_tp2.json", "TP MLP training step, eager", _step),
    ("ag_gemm_h200_tp2_graphs.json", "AllGather + GEMM, per shape (best method)", _op),
    ("gemm_rs_h200_tp2_graphs.json", "GEMM + ReduceScatter, per shape (best method)", _op),
    ("gemm_h200_triton371.json", "our bf16 GEMM (tuned block table, Triton 3.7.1)", _gemm),
    ("gemm_fp8_h200.json", "our FP8 GEMM (1x128 / 128x128 scales)", _fp8),
    ("gemm_fused_h100.json", "each fused op's own GEMM (`compute_alone`)", _fused),
    ("host_cost_h100.json", "host time of the eager path", _host),
    ("offload_h200.json", "activation offload, the planner's default plan", _offload),
)


def _on(doc: dict) -> str:
    tp, device = doc.get("tp"), str(doc.get("device", "GPU")).replace("NVIDIA ", "")
    if doc.get("op") == "host_cost":
        return f"{tp} processes on one {device}"
    return f"{tp} x {device}" if tp and tp > 1 else f"1 x {device}"


def headline(directory: Path) -> str:
    """The markdown table of the headline results found in `directory`."""
    rows = []
    for name, what, number in ROWS:
        path = directory / name
        if not path.is_file():
            continue
        doc = json.loads(path.read_text())
        command = re.sub(r" --out \S+", "", current_command(doc.get("command") or ""))
        rows.append({"result": what, "measured": number(doc),
                     "on, commit": f"{_on(doc)}, `{str(doc.get('commit'))[:7]}`",
                     "command": f"`{command}`" if command else "-", "data": f"[{name}](results/{name})"})
    return format_table(rows, ["result", "measured", "on, commit", "command", "data"])
