"""The new kernels compile for sm_90 without a GPU (Triton's own ptxas), without register spills and within
the shared memory of one H100/H200 block: what the interpreter cannot check (it accepted a non-constexpr
global that the compiler refuses). Compiled in a child process without TRITON_INTERPRET (the interpreter
replaces @triton.jit functions in this one). The full sweep: `python -m tp_overlap.launch.compile_check
--candidates --fp8 --table`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from tp_overlap.gemm.blocks import SHARED_MEMORY_LIMIT
from tests.multiproc import child_pythonpath  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ROOT = Path(__file__).resolve().parents[2]
# bytes: the scatter-reduce GEMM's 128x256 kn build stores one value at kernel entry and reloads it as each
# consumer warpgroup starts (SASS: one STL, two LDL; none in a loop)
SPILL_ALLOWED = {"bf16 gluon reduce kn": 12}

CHILD = """
import json
from tp_overlap.launch.compile_check import (compile_fp8_gemm, compile_fp8_gluon_gemm, compile_gemm, compile_gluon_gemm,
                                  compile_overlap_kernels, compile_quantizers, compile_swiglu, resource_usage)
from tp_overlap.gemm import GemmBlocks
out = {name: resource_usage(c) | {"div_rn": "div.rn.f32" in c.asm["ptx"]} for name, c in compile_quantizers().items()}
out["fp8 default (ws)"] = resource_usage(compile_fp8_gemm(GemmBlocks.parse("128x128x128w4s4ws")))
out["fp8 gluon"] = resource_usage(compile_fp8_gemm(GemmBlocks.parse("128x128x128w4s5gl")))
# which Gluon waiters bound their polls by the clock (kernels/gemm_gluon_wait.py): bf16 ones, not FP8's
clocked = lambda c: resource_usage(c) | {"clock": "%globaltimer" in c.asm["ptx"]}
out["fp8 gluon, row-major A scales"] = clocked(compile_fp8_gluon_gemm(GemmBlocks.parse("128x128x128w4s5gl"),
                                                                      a_scales_group_major=False))
out["fp8 gluon, whole tiles"] = resource_usage(compile_fp8_gluon_gemm(GemmBlocks.parse("128x128x128w4s4gl"),
                                                                     split_tail=False))
# two 128-column sub-tiles: 192 registers of accumulators and product (spilled while LLVM issued the second MMA first)
out["fp8 gluon 256 wide"] = resource_usage(compile_fp8_gluon_gemm(GemmBlocks.parse("128x256x128w4s3gl"),
                                                                 split_tail=False))
out["fp8 chunk wait"] = resource_usage(compile_fp8_gemm(GemmBlocks.parse("128x128x128w8s4"), wait_chunks=True))
out["bf16 stream-K"] = resource_usage(compile_gemm(GemmBlocks.parse("128x256x64w8s3sk1"), b_transposed=True))
out["bf16 gluon kn"] = clocked(compile_gluon_gemm(GemmBlocks.parse("128x256x64w4s3gl"), b_transposed=False))
out["bf16 gluon nk"] = resource_usage(compile_gluon_gemm(GemmBlocks.parse("128x128x64w4s6gl"), b_transposed=True))
out["bf16 gluon 192"] = resource_usage(compile_gluon_gemm(GemmBlocks.parse("192x128x64w4s4sk1gl"), b_transposed=True))
from tp_overlap.launch.measure.compile_gluon import compile_gluon_scatter_gemm
scatter = compile_gluon_scatter_gemm(GemmBlocks.parse("128x256x64w4s3gl"), b_transposed=False)
# a row block is published only once its stores have written (not merely read the staging tile)
out["bf16 gluon scatter kn"] = resource_usage(scatter) | {"writes_complete": "cp.async.bulk.wait_group 0;" in
                                                          scatter.asm["ptx"]}
out["bf16 gluon scatter nk"] = resource_usage(compile_gluon_scatter_gemm(GemmBlocks.parse("128x128x64w4s6gl"),
                                                                        b_transposed=True))
boxes = compile_gluon_scatter_gemm(GemmBlocks.parse("128x144x64w4s5gl"), b_transposed=True)
out["bf16 gluon scatter boxes 128x144 nk"] = resource_usage(boxes) | {
    "writes_complete": "cp.async.bulk.wait_group 0;" in boxes.asm["ptx"]}
from tp_overlap.launch.measure.compile_gluon import compile_gluon_reduce_gemm
out["bf16 gluon reduce kn"] = clocked(compile_gluon_reduce_gemm(GemmBlocks.parse("128x256x64w4s3gl"),
                                                               b_transposed=False))
out["bf16 gluon reduce nk"] = resource_usage(compile_gluon_reduce_gemm(GemmBlocks.parse("128x128x64w4s6gl"),
                                                                      b_transposed=True))
out["bf16 gluon boxes 64x96 kn"] = resource_usage(compile_gluon_gemm(GemmBlocks.parse("64x96x64w4s8gl"),
                                                                   b_transposed=False))
out["bf16 gluon boxes 128x96 nk"] = resource_usage(compile_gluon_gemm(GemmBlocks.parse("128x96x64w4s7gl"),
                                                                    b_transposed=True))
out.update({name: resource_usage(c) for name, c in compile_overlap_kernels().items()})
for name, c in compile_swiglu().items():
    ptx = c.asm["ptx"]  # ATen's arithmetic: IEEE divisions, libdevice's exp (its ex2 after a range reduction)
    exact = "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    out[name] = resource_usage(c) | {"div_rn": exact, "libdevice_exp": "fma.rm" in ptx}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no bundled ptxas")
def test_new_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = child_pythonpath()
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    usage = json.loads(lines[-1][len("RESULT "):])
    assert set(usage) == {"quantize_activation", "quantize_weight", "fp8 default (ws)", "fp8 gluon",
                          "fp8 gluon, row-major A scales", "fp8 gluon, whole tiles", "fp8 gluon 256 wide", "fp8 chunk wait",
                          "bf16 stream-K", "bf16 gluon kn", "bf16 gluon nk", "bf16 gluon 192",
                          "bf16 gluon boxes 64x96 kn", "bf16 gluon boxes 128x96 nk", "bf16 gluon scatter kn",
                          "bf16 gluon scatter nk", "bf16 gluon scatter boxes 128x144 nk", "bf16 gluon reduce kn",
                          "bf16 gluon reduce nk",
                          "gemm epilogue 0 + chunk waits",
                          "gemm epilogue 1", "gemm epilogue 2",
                          "gemm epilogue 1 + chunk waits", "reduce", "reduce (waits)", "swiglu forward",
                          "swiglu backward"}
    assert all(usage[k]["div_rn"] and usage[k]["libdevice_exp"] for k in ("swiglu forward", "swiglu backward"))
    for name, u in usage.items():
        assert u["spill"] <= SPILL_ALLOWED.get(name, 0) and 0 < u["regs"] <= 255, (name, u)
        assert u["shared"] <= SHARED_MEMORY_LIMIT, (name, u)
    for name in ("bf16 gluon scatter kn", "bf16 gluon scatter boxes 128x144 nk"):
        assert usage[name]["writes_complete"], f"{name}: a row block is published before its stores land"
    assert usage["quantize_activation"]["div_rn"] and usage["quantize_weight"]["div_rn"], \
        "scales must be correctly rounded divisions"
    # the FP8 consumer ran 4-5 % slower with a clock read in its waiter, even unexecuted (results/logs/one_gpu_a69dbb7)
    assert not usage["fp8 gluon, row-major A scales"]["clock"], "the FP8 Gluon waiter reads %globaltimer"
    assert usage["bf16 gluon kn"]["clock"] and usage["bf16 gluon reduce kn"]["clock"], \
        "a bf16 Gluon waiter is not bounded by %globaltimer"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no bundled ptxas")
def test_sass_snapshots_name_each_build_and_hold_its_machine_code(tmp_path):
    """`compile_check --sass DIR --only ...` writes one file per selected build, the kernel's SASS without
    addresses (so that two commits' files compare equal exactly when the machine code is the same)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = child_pythonpath()
    out = tmp_path / "sass"
    proc = subprocess.run([sys.executable, "-m", "tp_overlap.launch.compile_check", "--sass", str(out), "--only",
                           "fp8_128x64x128w4s4gl_group_major_whole"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.iterdir()
    text = path.read_text()
    assert path.name == "fp8_128x64x128w4s4gl_group_major_whole.sass" and "Function : fp8_gluon_gemm_kernel" in text
    assert "QGMMA.64x64x32.F32.E4M3.E4M3" in text and "/*" not in text, text[:400]
    bad = subprocess.run([sys.executable, "-m", "tp_overlap.launch.compile_check", "--only", "fp8"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--only selects builds of --sass DIR" in bad.stderr
