"""What torchrun prints for a bad argument (docs/USAGE.md, "Errors and exit status"): our one line once, and a
failure report that names rank 0 with exit code 2 and no other rank. The other ranks exit 0 before rank 0
does (rank 0 waits for them, bounded): a rank torchrun still finds running when rank 0 fails is stopped with
SIGTERM and listed as a failure of its own. Here ranks 1 and 2 start 3 s late (a sitecustomize that sleeps),
which without that wait makes torchrun stop them every time."""

import os
import subprocess
import sys
import time
from pathlib import Path
from tests.multiproc import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]


LATE_START = "import os, time\nif os.environ.get('RANK', '0') != '0':\n    time.sleep(3)\n"


def test_a_usage_error_under_torchrun_reports_rank_0_alone(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LATE_START)
    env = {**os.environ, "PYTHONPATH": child_pythonpath(site), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "tp_overlap.launch.tp_mlp", "--tokens", "0"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out   # torchrun's own status for a failed job
    assert out.splitlines().count("tp_overlap.launch.tp_mlp: --tokens must be > 0, got 0") == 1, out
    assert "SIGTERM" not in out and "Signal 15" not in out, out
    assert "<NO_OTHER_FAILURES>" in out and out.count("exitcode  : 2 ") == 1, out
    assert time.monotonic() - start < 120 and not (tmp_path / "runs").exists()
