"""tests/triton_state.py: after an interpreted kernel that calls a Triton device function (which leaves the
interpreter's builtins in triton.language), restoring the language lets a real compile in the same process
generate code again, even when it misses Triton's cache (the cause of the once-flaky Gluon compile test)."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tp_overlap.gemm import GemmBlocks  # noqa: E402
from tp_overlap.launch.compile_check import compile_gluon_gemm  # noqa: E402
from tests import triton_state  # noqa: E402


@triton.jit
def _halve_up(ptr):
    tl.store(ptr, tl.cdiv(tl.load(ptr), 2))   # tl.cdiv: a device function the interpreter calls directly


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs the interpreter (CPU)")
def test_a_compile_after_an_interpreted_device_function_call_works_once_the_language_is_restored(tmp_path,
                                                                                                 monkeypatch):
    saved = triton_state.snapshot()
    x = torch.tensor([7], dtype=torch.int32)
    _halve_up[(1,)](x)
    assert x.item() == 4
    triton_state.restore(saved)
    for (obj, before), (_, after) in zip(saved, triton_state.snapshot()):
        assert {n for n in after if after[n] is not before.get(n)} <= {"__annotations__"}, obj
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))   # a cache miss: the code generator runs
    # the two-box Gluon kernel (kernels/gemm_gluon_boxes.py): Gluon code only, which compiles in a process that
    # interprets @triton.jit code
    compiled = compile_gluon_gemm(GemmBlocks.parse("64x96x64w4s8gl"), b_transposed=False)
    assert "cp.async.bulk.tensor" in compiled.asm["ptx"]   # its TMA loads: real code was generated
