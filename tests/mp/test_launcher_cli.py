"""The launchers as a newcomer meets them, in real processes on CPU: one line per error (torchrun included),
outputs in a run folder and never in results/, one-rank and CPU runs labelled, small CPU defaults."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tp_overlap.launch.output.report import CPU_NOTE, ONE_RANK_NOTE
from tests.multiproc import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_LOG = re.compile(r"^[WEI]\d{4} \d\d:\d\d:\d\d")  # torchrun's own log lines


def _env(**extra):
    return {**os.environ, "PYTHONPATH": child_pythonpath(), "OVERLAP_PROGRESS": "1", **extra}


def _python(module, *args, cwd, timeout=120):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _torchrun(module, *args, cwd, timeout=180):
    # OMP_NUM_THREADS=1 is what torchrun sets anyway; given, it leaves out its 4-line banner saying so
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", module, *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=timeout)


def _results_listing():
    return sorted((p.name, p.stat().st_mtime_ns) for p in (ROOT / "results").rglob("*"))


def _own_lines(output: str) -> list[str]:
    """The lines our processes printed: torchrun's log lines and its closing failure report left out."""
    lines = output.splitlines()
    if "ChildFailedError" in output:  # torchrun's report: its traceback through the end of the output
        lines = lines[:max(i for i, line in enumerate(lines) if line.startswith("Traceback"))]
    return [line for line in lines if not TORCHRUN_LOG.match(line)]


# ----- item 3: one line per error -------------------------------------------------------------------------
def test_a_bad_argument_under_torchrun_is_one_line_from_rank_0(tmp_path):
    t0 = time.monotonic()
    proc = _torchrun("tp_overlap.launch.tp_mlp", "--tokens", "0", cwd=tmp_path)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and elapsed < 60, (proc.returncode, elapsed)
    assert _own_lines(out) == ["tp_overlap.launch.tp_mlp: --tokens must be > 0, got 0"], out
    assert "[rank" not in out and out.count("Traceback") <= 1, out  # no rank's traceback, at most torchrun's
    # the whole output: that line and torchrun's failure report (~33 lines for the failed rank, 7 more for a
    # rank it had to stop); before: 64 lines (without the OMP banner), a traceback per rank
    assert len(out.splitlines()) <= 45, out
    assert not (tmp_path / "results").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("module,args,line", [
    ("tp_overlap.launch.tp_mlp", ["--tokens", "0"], "tp_overlap.launch.tp_mlp: --tokens must be > 0, got 0"),
    ("tp_overlap.launch.tp_mlp", ["--steps", "0"], "tp_overlap.launch.tp_mlp: --steps must be > 0, got 0"),
    ("tp_overlap.launch.tp_mlp", ["--tokens", "x"],
     "tp_overlap.launch.tp_mlp: argument --tokens: expected comma-separated integers, got 'x'"),
    ("tp_overlap.launch.tp_mlp", ["--model", "llama9b"],
     "tp_overlap.launch.tp_mlp: --model: unknown model 'llama9b'; known: llama8b, llama70b, tiny"),
    ("tp_overlap.launch.tp_mlp", ["--cuda-graphs"], "tp_overlap.launch.tp_mlp: --cuda-graphs needs CUDA devices"),
    ("tp_overlap.launch.bench", ["--op", "ag_gemm", "--tokens", "1024,x"],
     "tp_overlap.launch.bench: argument --tokens: expected comma-separated integers, got '1024,x'"),
    ("tp_overlap.launch.bench", ["--cpu"], "tp_overlap.launch.bench: needs at least 2 ranks, got 1 (run it under torchrun "
                                "--nproc-per-node N, N >= 2); one rank has nothing to overlap"),
    ("tp_overlap.launch.kfactor", ["--sweep", "sm_margin=a"], "tp_overlap.launch.kfactor: --sweep: sm_margin='a' is not an int"),
    ("tp_overlap.launch.offload_bench", ["--models", "gpt"],
     "tp_overlap.launch.offload_bench: --models: unknown model 'gpt'; known: llama8b, llama70b, tiny"),
])
def test_each_bad_argument_is_one_line_and_exit_status_2(tmp_path, module, args, line):
    proc = _python(module, *args, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout)
    assert proc.stderr.splitlines() == [line], proc.stderr


def test_a_yaml_typo_prints_the_config_errors_line(tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / "cpu.yaml").read_text())
    raw["ops"]["ag_gemm"]["methd"] = raw["ops"]["ag_gemm"].pop("method")
    config = tmp_path / "typo.yaml"
    config.write_text(yaml.safe_dump(raw))
    proc = _python("tp_overlap.launch.tp_mlp", "--config", str(config), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"tp_overlap.launch.tp_mlp: {config}: ops.ag_gemm.methd: unknown key 'methd'; allowed: "
                                        "by_m, chunks_per_rank, comm_stream_priority, lead_fraction, method, sm_margin"]


def test_debug_adds_the_traceback(tmp_path):
    proc = _python("tp_overlap.launch.tp_mlp", "--steps", "0", "--debug", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback (most recent call last)" in proc.stderr
    assert "UsageError" in proc.stderr and proc.stderr.splitlines()[-1] == "tp_overlap.launch.tp_mlp: --steps must be > 0, got 0"


# ----- items 2, 4, 5: run folders, one rank, CPU labels ----------------------------------------------------
def test_one_rank_run_is_labelled_and_writes_a_run_folder_not_results(tmp_path):
    before = _results_listing()
    proc = _python("tp_overlap.launch.tp_mlp", "--tokens", "64", "--steps", "2", "--warmup", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "results").exists() and _results_listing() == before
    (written,) = tmp_path.glob("runs/tp_mlp-*/tp_mlp_cpu_tp1.json")
    assert re.fullmatch(r"tp_mlp-\d{8}T\d{6}Z", written.parent.name)
    assert f"wrote {written.relative_to(tmp_path)}" in proc.stdout
    doc = json.loads(written.read_text())
    assert doc["tp"] == 1 and doc["run_kind"] == "CPU check, 1 rank" and doc["run_notes"] == [CPU_NOTE, ONE_RANK_NOTE]
    (row,) = doc["rows"]
    assert row["run_kind"] == "CPU check, 1 rank" and row["rel_err_max"] <= 2e-2
    table = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("| run_kind |"))
    assert table[header - 2:header] == [CPU_NOTE, ONE_RANK_NOTE]
    assert table[header + 2].startswith("| CPU check, 1 rank | tiny | 64 |")


def test_bench_on_cpu_defaults_to_tiny_shapes_and_a_run_folder(tmp_path):
    proc = _torchrun("tp_overlap.launch.bench", "--op", "ag_gemm", "--reps", "2", "--warmup", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (written,) = tmp_path.glob("runs/bench-*/ag_gemm_cpu_tp2.json")
    assert not (tmp_path / "results").exists()
    rows = json.loads(written.read_text())["rows"]
    shapes = [(r["layer"], r["M"], r["K"], r["N"]) for r in rows]
    assert shapes == [("cpu.tiny", 256, 64, 64), ("cpu.tiny", 512, 64, 64)]
    assert all(r["run_kind"] == "CPU check" for r in rows)
    assert CPU_NOTE in proc.stdout.splitlines() and "| CPU check | cpu.tiny | 256 |" in proc.stdout


def test_kfactor_on_cpu_has_no_gate_by_default_and_says_so(tmp_path):
    proc = _torchrun("tp_overlap.launch.kfactor", "--ops", "ag_gemm", "--tokens", "256", "--sweep", "sm_margin=0",
                     "--sweep", "chunks_per_rank=1", "--reps", "3", "--warmup", "1", "--no-plots", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    note = "k-factor gate: off (CPU k values are host-scheduling noise, not contention; --max-k K applies one)"
    assert note in proc.stdout.splitlines() and CPU_NOTE in proc.stdout.splitlines()
    (written,) = tmp_path.glob("runs/kfactor-*/kfactor_cpu_tp2.json")
    doc = json.loads(written.read_text())
    assert doc["max_k"] is None and doc["gate_failures"] == [] and doc["run_kind"] == "CPU check"
    assert not (tmp_path / "results").exists()


def test_offload_bench_writes_a_run_folder_by_default(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tp_overlap.launch.offload_bench", "--cpu", "--tokens", "32", "--layers", "1",
                           "--reps", "1", "--warmup", "0"], cwd=tmp_path, env=_env(OVERLAP_PROGRESS="0"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (written,) = tmp_path.glob("runs/offload_bench-*/offload_cpu.json")
    doc = json.loads(written.read_text())
    assert doc["run_kind"] == "CPU check" and doc["rows"] and not (tmp_path / "results").exists()
    assert CPU_NOTE in proc.stdout.splitlines()
