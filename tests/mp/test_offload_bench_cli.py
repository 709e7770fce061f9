"""tp_overlap.launch.offload_bench end to end on CPU (a real process): rows for every variant, bitwise-equal gradients,
peaks counted on CPU equal to the planner's prediction for every variant, the planner's table, the budget
sweep, a JSON with provenance and the plot; a tiny time budget skips points with a note."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tp_overlap.launch.cli.common import UsageError
from tp_overlap.launch.offload_bench import budget_item, parse_args
from tests.multiproc import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *extra, timeout=300):
    out = tmp_path / "offload.json"
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), OVERLAP_PROGRESS="0", MASTER_PORT=str(29600 + os.getpid() % 300))
    cmd = [sys.executable, "-m", "tp_overlap.launch.offload_bench", "--cpu", "--reps", "2", "--warmup", "1", "--out", str(out),
           *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout, out


def test_offload_bench_runs_every_variant_on_cpu_and_predicts_every_peak(tmp_path):
    doc, stdout, out = _run(tmp_path, "--points", "tiny:3:96", "--budget", "auto,+0%,0.8x")
    assert {"device", "commit", "command", "rows", "points", "notes", "host_pool"} <= set(doc)
    variants = [r["variant"] for r in doc["rows"]]
    assert variants == ["none", "none_again", "keep", "recompute", "recompute_s", "offload_all", "planner",
                        "planner[+0%]", "planner[0.8x]"], variants
    for row in doc["rows"]:
        assert row["bitwise"] is True, row
        assert row["t_step_ms"] > 0 and row["spread"] >= 0 and row["pred_step_ms"] > 0
        # the host path runs the same engine: what it holds is what the plan predicts, to the byte
        assert row["peak_bytes"] == row["pred_peak_bytes"] and row["act_peak_bytes"] == row["pred_act_peak_bytes"], row
    by = {r["variant"]: r for r in doc["rows"]}
    assert by["offload_all"]["engine"]["offloaded"] > 0 and by["offload_all"]["demand_fetches"] == 0
    assert by["recompute"]["engine"]["recomputed"] > 0 and by["recompute"]["engine"]["offloaded"] == 0
    # the engine's activation alone: nothing moved, silu(gate) not saved (less than keep at the activation peak)
    assert by["recompute_s"]["engine"]["offloaded"] == 0 and by["recompute_s"]["engine"]["recomputed"] == 0
    assert by["recompute_s"]["act_peak_bytes"] < by["keep"]["act_peak_bytes"]
    assert by["planner[0.8x]"]["peak_bytes"] <= 0.8 * by["none"]["peak_bytes"]
    assert by["keep"]["peak_bytes"] == by["none"]["peak_bytes"]  # keeping everything runs the plain stack
    point = doc["points"][0]
    assert point["copies"]["d2h_gbps"] > 0 and point["frontier"] and set(point["targets"]) == {
        "act_vs_none", "peak_vs_none", "time_vs_none", "keep_vs_none", "peak_error", "time_error", "copy_gbps"}
    assert point["targets"]["peak_error"][0] == 0.0
    assert "| L2.a |" in point["planner_table"] and "| L2.a |" in stdout
    assert "wrote" in stdout and out.with_suffix(".png").stat().st_size > 10_000


def test_a_short_time_budget_skips_with_a_note(tmp_path):
    doc, stdout, _ = _run(tmp_path, "--layers", "3", "--tokens", "96", "--time-budget-s", "0.001")
    assert doc["rows"] == [] and any("time budget" in note for note in doc["notes"]), doc["notes"]
    assert "note:" in stdout


def test_budget_items_and_points_parse_or_are_refused_naming_what_is_allowed():
    assert budget_item("auto")[1:] == ("time", 0.02) and budget_item("+1.5%") == ("+1.5%", "time", 0.015)
    assert budget_item("0.7x") == ("0.7x", "fraction", 0.7) and budget_item("40GiB") == ("40GiB", "bytes", 40 << 30)
    assert budget_item("12345") == ("12345", "bytes", 12345)
    with pytest.raises(ValueError, match="allowed: auto, \\+N%"):
        budget_item("lots")
    args = parse_args(["--points", "llama8b:16:4096,llama70b:8:4096"])
    assert args.point_list == [("llama8b", 16, 4096), ("llama70b", 8, 4096)]
    for bad, says in ((["--points", "llama8b:16"], "MODEL:LAYERS:M"), (["--points", "gpt9:1:2"], "unknown model"),
                      (["--budget", "auto,auto"], "twice"), (["--budget", "soon"], "allowed: auto"),
                      (["--layers", "0"], "must be > 0")):
        with pytest.raises(UsageError, match=says):
            parse_args(bad)
