"""The timing harness (interleaving, max over ranks) and the bench CLI end to end on CPU ranks."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tp_overlap.launch.bench import POOL_BW_CPU_NOTE
from tp_overlap.launch.output.report import CPU_NOTE, format_table, write_results
from tp_overlap.launch.measure.timing import bench_interleaved
from tests.multiproc import child_pythonpath, run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _slow_rank(rank, world):
    order = []
    variants = {
        "fast": lambda: order.append("fast"),
        # rank 1 is slow: the reported time must be rank 1's (max over ranks) on every rank
        "slow": lambda: (order.append("slow"), time.sleep(0.02 if rank == 1 else 0.001)),
    }
    stats = bench_interleaved(variants, group=dist.group.WORLD, device=__import__("torch").device("cpu"),
                              warmup=1, reps=6, hold_device_us=10_000)
    return stats, order


def test_interleaved_max_over_ranks():
    (s0, order0), (s1, _) = run_ranks(_slow_rank, 2)
    assert s0 == s1                       # every rank reports the same reduced numbers
    assert s0["slow"].min_ms >= 19.0      # rank 1's sleep, not rank 0's
    assert s0["fast"].median_ms < 5.0
    assert s0["slow"].reps == 6 and s0["fast"].min_ms <= s0["fast"].median_ms <= s0["fast"].max_ms
    # rank 1's calls outlast a 10 ms hold every rep (rank 0's never): the late count is max over ranks too
    assert (s0["slow"].late_reps, s0["fast"].late_reps) == (6, 0)
    assert s0["slow"].as_dict("x_")["x_late_reps"] == 6
    assert s0["slow"].host_median_ms >= 19.0 and s0["fast"].host_median_ms < 5.0  # rank 1's enqueue, reduced
    timed = order0[2:]                    # after one warm-up of each
    assert timed[:4] == ["fast", "slow", "slow", "fast"]  # order rotated every rep


def test_results_json_has_provenance(tmp_path):
    path = write_results(tmp_path / "r.json", [{"a": 1.5}], device="cpu", tp=2, extra={"op": "x"})
    doc = json.loads(path.read_text())
    assert {"device", "tp", "commit", "command", "date", "rows", "op"} <= set(doc)
    assert doc["rows"] == [{"a": 1.5}] and doc["tp"] == 2
    assert format_table([{"a": 1.23456, "b": "x"}], ["a", "b"]).splitlines()[2] == "| 1.235 | x |"


def test_bench_cli_runs_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "pool_bw.json"
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OVERLAP_PROGRESS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tp_overlap.launch.bench", "--op", "pool_bw", "--sizes-mb", "1,2", "--reps", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["tp"] == 2 and doc["device"] == "cpu" and len(doc["rows"]) == 2
    assert "tp_overlap.launch.bench --op pool_bw --sizes-mb 1,2" in doc["command"]
    for row in doc["rows"]:
        assert row["ce_pull_GBps"] > 0 and row["allgather_GBps"] > 0 and row["allgather_backend"] == "gloo"
        assert row["ce_pull_min_ms"] <= row["ce_pull_median_ms"] <= row["ce_pull_max_ms"]
    assert "| size_bytes |" in proc.stdout and "pool_bw 2/2" in proc.stderr
    # CPU: a functional check, and its "copy engine" is a memcpy (said above the table)
    assert CPU_NOTE in proc.stdout.splitlines() and POOL_BW_CPU_NOTE in proc.stdout.splitlines()
    assert doc["run_kind"] == "CPU check" and all(row["run_kind"] == "CPU check" for row in doc["rows"])


def test_bench_refuses_one_rank(tmp_path):
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "MASTER_PORT": "29731"}
    proc = subprocess.run([sys.executable, "-m", "tp_overlap.launch.bench", "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "at least 2 ranks" in proc.stderr


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
def test_op_bench_cli_writes_the_results_schema(tmp_path, op):
    out = tmp_path / f"{op}.json"
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tp_overlap.launch.bench", "--op", op, "--shape", "200x72x40", "--reps", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {"device", "tp", "commit", "command", "date", "rows"} <= set(doc)
    required = {"layer", "op", "M", "K", "N", "method", "t_ours_ms", "t_seq_nccl_ms", "t_torch_ms", "t_gemm_ms",
                "t_comm_ms", "t_ideal_ms", "E_ours", "E_seq", "E_torch", "k_comm", "k_comp"}
    for row in doc["rows"]:
        assert required <= set(row), required - set(row)
        assert row["op"] == op and (row["M"], row["K"], row["N"]) == (200, 72, 40)
        assert row["t_ideal_ms"] == max(row["t_gemm_ms"], row["t_comm_ms"])
        assert abs(row["E_ours"] - row["t_ideal_ms"] / row["t_ours_ms"]) < 1e-9
    assert "| layer |" in proc.stdout
