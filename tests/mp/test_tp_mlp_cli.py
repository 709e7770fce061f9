"""`tp_overlap.launch.tp_mlp` end to end under torchrun on 2 CPU ranks (gloo + host pool)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tp_overlap.launch.output.report import CPU_NOTE
from tests.multiproc import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]


def _run(args, tmp_path, timeout=240):
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OVERLAP_PROGRESS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tp_overlap.launch.tp_mlp", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_tp_mlp_cli_runs_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "tp_mlp.json"
    proc = _run(["--tokens", "64,128", "--steps", "3", "--warmup", "1", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["tp"] == 2 and doc["device"] == "cpu" and doc["op"] == "tp_mlp"
    assert doc["preset"].endswith("cpu.yaml") and "tp_overlap.launch.tp_mlp --tokens 64,128" in doc["command"]
    assert [(r["model"], r["M"]) for r in doc["rows"]] == [("tiny", 64), ("tiny", 128)]
    for row in doc["rows"]:
        assert row["hidden"] == 64 and row["ffn_hidden"] == 176 and row["activation"] == "swiglu"
        assert row["rel_err_max"] <= 2e-2 and row["dtype"] == "bf16"
        assert row["t_step_overlap_ms"] > 0 and row["t_step_baseline_ms"] > 0
        assert abs(row["speedup"] - row["t_step_baseline_ms"] / row["t_step_overlap_ms"]) < 1e-9
        assert row["t_step_overlap_min_ms"] <= row["t_step_overlap_ms"] <= row["t_step_overlap_max_ms"]
        assert row["t_step_torch_symm_ms"] is None  # CUDA only
        for key in ("k_comm_fc1_fwd_ag", "k_comp_fc1_fwd_ag", "k_comm_fc2_bwd_ag", "k_comp_fc2_bwd_ag"):
            assert row[key] > 0 and math.isfinite(row[key]), (key, row[key])  # host-clock spans on CPU
        assert row["speedup_sustained"] is None and row["t_step_overlap_sustained_ms"] is None  # not asked
        assert set(row["ops"]) == {"fc1.fwd.ag", "fc1.bwd.rs", "fc2.fwd.rs", "fc2.bwd.ag"}
        assert row["ops"]["fc1.fwd.ag"]["method"] == "decomposed"
    assert "| run_kind | model | M |" in proc.stdout and "point 2/2 tiny M=128: step" in proc.stderr
    # a functional check on CPU, said above the table and in a column
    assert CPU_NOTE in proc.stdout.splitlines() and doc["run_kind"] == "CPU check"
    assert all(row["run_kind"] == "CPU check" for row in doc["rows"]) and "| CPU check | tiny | 64 |" in proc.stdout
    # progress within every point, in order: never silent for a whole point
    phases = ["building the MLPs", "numerics check: one training step", "numerics check: overlap", "warm-up 1/1",
              "timed step 1/3", "timed step 3/3", "k: each AllGather and GEMM alone", "k: traced training step 1/5",
              "k: traced training step 5/5", "step "]
    for point in ("point 1/2 tiny M=64: ", "point 2/2 tiny M=128: "):
        lines = [line for line in proc.stderr.splitlines() if point in line]
        found = [next((i for i, line in enumerate(lines) if point + phase in line), None) for phase in phases]
        assert None not in found and found == sorted(found), (point, found, lines)


def test_tp_mlp_cli_sustained_blocks_time_every_variant(tmp_path):
    out = tmp_path / "sustained.json"
    proc = _run(["--tokens", "64", "--steps", "2", "--warmup", "1", "--sustained", "0.05", "--out", str(out)],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert doc["sustained_s"] == 0.05
    for name in ("overlap", "baseline"):  # per step, not per block (tests/unit/test_sustained.py: exact)
        blocks = row[f"t_step_{name}_sustained_blocks_ms"]
        assert len(blocks) == 2 and row[f"t_step_{name}_sustained_ms"] == sum(blocks) / 2
        # a wide band: both are a few ms of host time on a loaded 2-core machine, one of them from 2 steps
        assert 0.05 < row[f"t_step_{name}_sustained_ms"] / row[f"t_step_{name}_ms"] < 20, row
    assert abs(row["speedup_sustained"]
               - row["t_step_baseline_sustained_ms"] / row["t_step_overlap_sustained_ms"]) < 1e-9
    assert row["sm_clock_overlap_mhz"] is None and row["power_baseline_w"] is None  # no GPU to sample
    assert row["t_step_torch_symm_sustained_ms"] is None and row["speedup_sustained_vs_torch_symm"] is None
    assert "(overlap baseline baseline overlap)" in proc.stderr and ", sustained " in proc.stderr
    for bad in ("-1", "nan"):
        proc = _run(["--tokens", "64", "--sustained", bad, "--out", str(tmp_path / "x.json")], tmp_path)
        assert proc.returncode != 0 and "--sustained must be a finite number of seconds >= 0" in proc.stderr


def test_tp_mlp_cli_takes_the_model_and_partition_from_the_yaml(tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / "cpu.yaml").read_text())
    raw["ops"]["ag_gemm"]["chunks_per_rank"] = 3
    raw["model"] = {"name": "mini", "hidden": 72, "ffn_hidden": 88, "activation": "gelu"}
    config = tmp_path / "mini.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = tmp_path / "mini.json"
    proc = _run(["--config", str(config), "--tokens", "74", "--dtype", "fp32", "--steps", "2", "--warmup", "0",
                 "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["model"], row["hidden"], row["ffn_hidden"], row["activation"]) == ("mini", 72, 88, "gelu")
    assert row["rel_err_max"] <= 1e-5 and row["ops"]["fc2.bwd.ag"]["chunks_per_rank"] == 3


def test_tp_mlp_cli_refuses_tokens_not_divisible_by_tp(tmp_path):
    proc = _run(["--tokens", "65", "--out", str(tmp_path / "x.json")], tmp_path)
    assert proc.returncode != 0 and "--tokens=65 is not divisible by the TP size 2" in proc.stderr


def test_tp_mlp_cli_fp8_and_offload_columns(tmp_path):
    out = tmp_path / "fp8_offload.json"
    proc = _run(["--tokens", "64", "--steps", "2", "--warmup", "1", "--fp8", "--offload", "auto", "--out", str(out)],
                tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert doc["fp8"] is True and "auto" in doc["offload"]
    # FP8 is its own variant, checked against overlap=False within the FP8 tolerance and timed with the others
    assert 0 < row["rel_err_overlap_fp8_max"] <= 0.15, row["rel_err_overlap_fp8_max"]
    assert row["rel_err_overlap_fp8_max"] > row["rel_err_max"]  # e4m3 is coarser than bf16: it really ran
    assert abs(row["speedup_fp8"] - row["t_step_baseline_ms"] / row["t_step_overlap_fp8_ms"]) < 1e-9
    assert abs(row["speedup_fp8_vs_bf16"] - row["t_step_overlap_ms"] / row["t_step_overlap_fp8_ms"]) < 1e-9
    assert "numerics check: overlap_fp8" in proc.stderr and "| speedup_fp8 |" in proc.stdout
    # offload: the plan and both steps timed; peaks only on CUDA
    assert row["offload_plan"] and row["t_step_offload_on_ms"] > 0 and row["t_step_offload_off_ms"] > 0
    assert abs(row["offload_time_ratio"] - row["t_step_offload_on_ms"] / row["t_step_offload_off_ms"]) < 1e-9
    assert row["offload_peak_ratio"] is None and "activation offload: rates, plan" in proc.stderr
    proc = _run(["--tokens", "64", "--fp8", "--dtype", "fp32", "--out", str(tmp_path / "x.json")], tmp_path)
    assert proc.returncode != 0 and "tp_overlap.launch.tp_mlp: --fp8 needs --dtype bf16" in proc.stderr
