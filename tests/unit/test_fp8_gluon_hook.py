"""The Gluon FP8 GEMM's place behind fp8_gemm (its numerics are checked on the GPU by
tests/gpu/check_fp8_gluon.py: Gluon kernels do not run under the interpreter)."""

import pytest
import torch

from launch.gemm_tune import FP8_CANDIDATES
from overlap import fp8
from overlap._fp8_gluon_launch import gluon_block_problems
from overlap.gemm_blocks import GemmBlocks


def test_the_gl_suffix_round_trips_and_is_not_plain():
    blocks = GemmBlocks.parse("128x128x128w4s6gl")
    assert blocks.gluon and blocks.name == "128x128x128w4s6gl"
    assert not blocks.plain, "the Gluon kernel has no chunk-wait mode: flag-waiting callers must not get it"
    assert not GemmBlocks.parse("128x128x128w4s6").gluon
    assert any(GemmBlocks.parse(name).gluon for name in FP8_CANDIDATES)


def test_gluon_block_problems_name_what_the_kernel_cannot_run():
    ok = dict(block_m=128, block_n=128, block_k=128, num_warps=4, group_m=8, num_stages=4, programs_per_sm=1)
    assert gluon_block_problems(**ok) == []
    assert gluon_block_problems(**dict(ok, num_warps=8)) == ["gluon: num_warps 8 not in (4,)"]
    assert gluon_block_problems(**dict(ok, block_n=256))[0].startswith("gluon: block_n 256")
    assert gluon_block_problems(**dict(ok, block_m=64, group_m=16)) == [
        "gluon: block_m 64 not in (128,)", "gluon: group_m 16 not in (8,)"]


def _operands(m=8, n=16, k=256):
    a8, a_scales = fp8.quantize_activation(torch.randn(m, k))
    w8, w_scales = fp8.quantize_weight(torch.randn(n, k))
    return dict(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales)


def test_fp8_gemm_refuses_gluon_blocks_off_cuda_in_one_sentence():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        fp8.fp8_gemm(**_operands(), blocks=GemmBlocks.parse("128x128x128w4s4gl"))


def test_fp8_gemm_refuses_gluon_blocks_for_the_chunk_waiting_consumer():
    wait = fp8.ChunkWait(flags=torch.zeros(4, dtype=torch.int32), rows_per_rank=4, chunks_per_rank=1,
                         error_words=torch.zeros(4, dtype=torch.int32), error_code_base=0, timeout_s=1.0)
    with pytest.raises(ValueError, match="chunk_wait needs blocks without ws / fl / gl"):
        fp8.fp8_gemm(**_operands(), blocks=GemmBlocks.parse("128x128x128w4s4gl"), chunk_wait=wait)
