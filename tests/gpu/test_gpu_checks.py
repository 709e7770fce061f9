"""The one-GPU correctness scripts as `gpu` tests: `check_fp8` (FP8 quantisers and GEMM, the chunk-wait mode,
stream-K), `check_offload` (activation offload eager and in a CUDA graph), `check_splitk` (the split-K
GEMM) and `check_swiglu` (the one-kernel swiglu against ATen's). Each runs in its own process, as `tests/gpu/run_one_gpu.sh` runs it, and must exit 0 with no FAIL line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.multiproc import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.parametrize("script,limit_s", [("check_fp8", 300), ("check_offload", 300), ("check_splitk", 300),
                                             ("check_swiglu", 120)])
def test_gpu_check_script_passes(script, limit_s):
    if not torch.cuda.is_available():
        pytest.fail("this check needs a CUDA GPU")   # never a silent skip
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    env.pop("TRITON_INTERPRET", None)   # compiled kernels, not the interpreter
    done = subprocess.run([sys.executable, "-m", f"tests.gpu.{script}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=limit_s)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "FAIL" not in done.stdout, output[-4000:]
    assert "PASS" in done.stdout, output[-4000:]   # the checks ran
