"""launch.offload_bench end to end on CPU (a real process): rows for every variant, bitwise-equal gradients,
the planner's table and a JSON with provenance; a tiny time budget skips points with a note."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *extra, timeout=120):
    out = tmp_path / "offload.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OVERLAP_PROGRESS="0", MASTER_PORT=str(29600 + os.getpid() % 300))
    cmd = [sys.executable, "-m", "launch.offload_bench", "--cpu", "--reps", "2", "--warmup", "1", "--layers", "3",
           "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_offload_bench_runs_every_variant_on_cpu(tmp_path):
    doc, stdout = _run(tmp_path, "--tokens", "96")
    assert {"device", "commit", "command", "rows", "points", "notes", "host_pool"} <= set(doc)
    variants = [r["variant"] for r in doc["rows"]]
    assert variants == ["none", "keep", "recompute", "offload_all", "planner"], variants
    for row in doc["rows"]:
        assert row["bitwise"] is True, row
        assert row["t_step_ms"] > 0 and row["spread"] >= 0
    full = next(r for r in doc["rows"] if r["variant"] == "offload_all")
    assert full["engine"]["offloaded"] > 0 and full["engine"]["demand_fetches"] == 0
    point = doc["points"][0]
    assert point["copies"]["d2h_gbps"] > 0 and set(point["targets"]) == {"peak_vs_none", "time_vs_none",
                                                                          "copy_gbps", "planner_vs_best"}
    assert "| L2.a |" in point["planner_table"] and "| L2.a |" in stdout
    assert "wrote" in stdout


def test_a_short_time_budget_skips_with_a_note(tmp_path):
    doc, stdout = _run(tmp_path, "--tokens", "96", "--time-budget-s", "0.001")
    assert doc["rows"] == [] and any("time budget" in note for note in doc["notes"]), doc["notes"]
    assert "note:" in stdout
