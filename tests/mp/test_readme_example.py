"""The Python examples of README.md and docs/API.md, extracted and run as written on 2 CPU ranks under torchrun."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.multiproc import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]
MARKER = "# example.py: torchrun --standalone --nproc-per-node 2 example.py"


def readme_example(marker: str = MARKER) -> str:
    """The one Python block of the README or of docs/ that starts with `marker`."""
    texts = [(ROOT / "README.md").read_text(), *(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))]
    blocks = [b for text in texts for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)]
    (example,) = [b for b in blocks if b.startswith(marker)]
    return example


def test_the_readme_example_runs_on_two_cpu_ranks(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in (0, 1):  # tiny model on CPU: hidden 64, ffn 176 (fc1 holds gate and up: 2 x 176 / 2 columns)
        assert f"rank {rank}: y (128, 64), x.grad (128, 64), fc1.weight.grad (64, 176)" in proc.stdout, proc.stdout


def test_the_readme_model_example_runs_on_two_cpu_ranks_in_at_most_15_lines(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    example = readme_example("# use_it.py: torchrun --standalone --nproc-per-node 2 use_it.py")
    code = [line for line in example.splitlines()[1:] if line.strip()]
    assert len(code) <= 15, code
    script = tmp_path / "use_it.py"
    script.write_text(example)
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = {}
    # the two ranks' lines may interleave on torchrun's stdout: find each wherever it is
    for match in re.finditer(r"rank (\d) step (\d): loss ([\d.]+), pool (\d+) bytes", proc.stdout):
        losses[(int(match[1]), int(match[2]))] = float(match[3])
        assert int(match[4]) > 0
    assert len(losses) == 6, proc.stdout
    assert all(losses[(0, s)] == losses[(1, s)] for s in range(3)), losses   # the same loss on every rank
