"""`tp_overlap.launch.tp_mlp` as a newcomer runs it on a CPU machine (real processes): FP8 and GPU presets
refused in the argument check with advice that works, a recorded command that runs again as it ran, an
unwritable --out refused before any work, and Ctrl-C reported in one line per rank."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.multiproc import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]
PROG = "tp_overlap.launch.tp_mlp"
QUICK = ["--tokens", "64", "--steps", "1", "--warmup", "0"]


def _env(interpret: bool, **extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "PYTHONPATH": child_pythonpath(), "OVERLAP_PROGRESS": "1", "OMP_NUM_THREADS": "1",
            **({"TRITON_INTERPRET": "1"} if interpret else {}), **extra}


def _python(*args, cwd, interpret=True, timeout=240):
    return subprocess.run([sys.executable, "-m", PROG, *args], cwd=cwd, env=_env(interpret), capture_output=True,
                          text=True, timeout=timeout)


def test_fp8_on_cpu_without_the_interpreter_is_refused_first_and_with_it_runs_and_records_its_environment(tmp_path):
    t0 = time.monotonic()
    refused = _python("--fp8", *QUICK, cwd=tmp_path, interpret=False)
    assert refused.returncode == 2 and time.monotonic() - t0 < 60, refused.stderr
    assert refused.stderr.splitlines() == [
        f"{PROG}: --fp8 on CPU runs the FP8 kernels (Triton) under the Triton interpreter: put TRITON_INTERPRET=1 in "
        f"the environment (TRITON_INTERPRET=1 python -m {PROG} --fp8 ...), or leave --fp8 out"], refused.stderr
    out = tmp_path / "fp8.json"
    ran = _python("--fp8", *QUICK, "--out", str(out), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["rows"][0]["rel_err_overlap_fp8_max"] <= 0.15
    command = doc["command"]
    assert command.startswith("TRITON_INTERPRET=1 ") and f"-m {PROG} --fp8" in command, command
    out.unlink()
    again = subprocess.run(command, shell=True, cwd=tmp_path, env=_env(False), capture_output=True, text=True,
                           timeout=240)   # the recorded command alone, in an environment without the variable
    assert again.returncode == 0 and out.exists(), again.stderr[-3000:]


def test_an_unwritable_out_is_refused_before_any_work_naming_the_path_given(tmp_path):
    for path in ("/proc/x.json", str(tmp_path / "ro" / "x.json")):
        (tmp_path / "ro").mkdir(exist_ok=True)
        os.chmod(tmp_path / "ro", 0o500)
        proc = _python("--out", path, cwd=tmp_path)
        os.chmod(tmp_path / "ro", 0o700)
        if path.startswith(str(tmp_path)) and os.geteuid() == 0:
            continue   # root may write a read-only folder: only /proc refuses it
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.splitlines()
        assert line.startswith(f"{PROG}: argument --out: {path}: cannot write there (") and ".tmp" not in line, line
    assert not (tmp_path / "runs").exists()


def test_a_gpu_preset_on_cpu_is_refused_in_the_argument_check_and_its_advice_works(tmp_path):
    for interpret in (False, True):
        proc = _python("--config", str(ROOT / "configs" / "cuda_default.yaml"), *QUICK, cwd=tmp_path,
                       interpret=interpret)
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.splitlines()   # before any group or pool: no progress line, no traceback
        assert line.startswith(f"{PROG}: --config configs/cuda_default.yaml cannot run here: ops.gemm_rs at M=64: "
                               "method fused runs "), line
        assert "sm_margin <= 3" in line and "leave --config out: on CPU the default preset is configs/cpu.yaml" \
            in line, line
        assert ("TRITON_INTERPRET=1" in line) != interpret, line   # the interpreter is advised only when off
    # the advice taken: the interpreter on and sm_margin <= 3 (one reduction program, as the message's example)
    raw = yaml.safe_load((ROOT / "configs" / "cuda_default.yaml").read_text())
    raw["ops"]["gemm_rs"].update(sm_margin=1, num_comm_sms=1)
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(yaml.safe_dump(raw))
    proc = _python("--config", str(fixed), *QUICK, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ctrl_c_under_torchrun_prints_one_line_per_rank(tmp_path):
    log = tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", PROG,
           "--tokens", "256", "--steps", "100000", "--warmup", "1"]
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(True), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)   # a job of its own, as a terminal's: SIGINT reaches all
        try:
            # the first timed step's line is printed when the phase starts (later ones at most every 2 s)
            deadline = time.monotonic() + 180
            while "timed step 1/" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)
            ended_early = proc.poll()   # not None: the run ended (or crashed) before the interrupt
            time.sleep(1.0)   # inside the timed loop by now
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    lines = log.read_text().splitlines()
    # whole lines in a failure's message (pytest abbreviates a list)
    tail = f"exit status before the interrupt: {ended_early}\n" + "\n".join(lines[-60:])
    said = [[line for line in lines if line.startswith(f"{PROG}: rank {rank}: ")] for rank in (0, 1)]
    for rank in (0, 1):
        # torchrun forwards SIGINT to one worker, then the other: the first to act on it aborts the pool, and
        # the other may stop on that abort (or on a collective of the baseline's group whose peer is gone,
        # which its pool block turns into that abort) before its own signal lands
        peer = f"{PROG}: rank {rank}: interrupted (Ctrl-C on rank {1 - rank})"
        assert said[rank] in ([f"{PROG}: rank {rank}: interrupted (Ctrl-C)"], [peer]), tail
    assert any(line.endswith("interrupted (Ctrl-C)") for line in said[0] + said[1]), tail   # someone's own
    # no traceback of ours: the one left is torchrun's own (its agent raises SignalException)
    assert sum(line.startswith("Traceback") for line in lines) <= 1, tail
    assert not any("KeyboardInterrupt" in line for line in lines), tail
