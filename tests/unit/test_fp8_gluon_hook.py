"""The Gluon FP8 GEMM's place behind fp8_gemm (its numerics are checked on the GPU by
tests/gpu/check_fp8_gluon.py: Gluon kernels do not run under the interpreter)."""

import dataclasses
import re

import pytest
import torch

from tp_overlap.launch.measure.tune import FP8_CANDIDATES
from tp_overlap.gemm import fp8
from tp_overlap.gemm.blocks import GemmBlocks, load_block_table


def test_the_gl_suffix_round_trips_and_is_not_plain():
    blocks = GemmBlocks.parse("128x128x128w4s5gl")
    assert blocks.gluon and blocks.name == "128x128x128w4s5gl"
    assert not blocks.plain, "plain: the @triton.jit kernel's configurations (flag-waiting without warp specialisation)"
    assert not GemmBlocks.parse("128x128x128w4s6").gluon
    assert any(GemmBlocks.parse(name).gluon for name in FP8_CANDIDATES)


def _operands(m=8, n=16, k=256):
    a8, a_scales = fp8.quantize_activation(torch.randn(m, k))
    w8, w_scales = fp8.quantize_weight(torch.randn(n, k))
    return dict(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales)


def test_fp8_gemm_refuses_gluon_blocks_off_cuda_in_one_sentence():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        fp8.fp8_gemm(**_operands(), blocks=GemmBlocks.parse("128x128x128w4s4gl"))


@pytest.mark.parametrize("name,problem", [
    ("128x128x128w8s4gl", "num_warps 8 not in (4,)"),
    ("128x32x128w4s3gl", "block_n 32 not in (64, 128, 256)"),
    ("128x256x128w4s3sk1gl", "block_n 256 runs whole tiles only (no sk1)"),
    ("128x256x128w4s4gl", "block_n 256 fits at most 3 stages"),
    ("64x128x128w4s4gl", "block_m 64 not in (128,)"),
    ("128x128x128w4s4g16gl", "group_m 16 not in (8,)"),
])
def test_fp8_gemm_names_what_the_gluon_kernel_cannot_run(name, problem):
    with pytest.raises(ValueError, match=re.escape(f"gluon: {problem}")):
        fp8.fp8_gemm(**_operands(), blocks=GemmBlocks.parse(name))


def test_the_chunk_waiting_consumer_runs_gluon_blocks_or_plain_ones_never_warp_specialised_jit_ones(monkeypatch):
    wait = fp8.ChunkWait(flags=torch.ones(4, dtype=torch.int32), rows_per_rank=4, chunks_per_rank=1,
                         error_words=torch.zeros(4, dtype=torch.int32), error_code_base=0, timeout_s=1.0)
    with pytest.raises(ValueError, match="chunk_wait needs blocks without ws / fl"):
        fp8.fp8_gemm(**_operands(), blocks=GemmBlocks.parse("128x128x128w4s4ws"), chunk_wait=wait)
    with pytest.raises(ValueError, match="needs a CUDA device"):  # accepted with a wait: the Gluon kernel waits too
        fp8.fp8_gemm(**_operands(), blocks=GemmBlocks.parse("128x128x128w4s4gl"), chunk_wait=wait)
    chosen = []

    def choose(m, n, k, *, warp_specialize=True, device_type="cuda", gpu="h200"):
        chosen.append(warp_specialize)
        return GemmBlocks.parse("128x128x128w4s4ws" if warp_specialize else "16x32x128w4s1")

    monkeypatch.setattr(fp8, "choose_fp8_blocks", choose)
    ops = _operands()
    out = fp8.fp8_gemm(**ops, chunk_wait=wait)  # the table's ws entry cannot wait: its plain blocks run
    assert chosen == [True, False]
    assert torch.allclose(out.float(), fp8.scaled_mm_reference(**ops).float(), rtol=1e-2, atol=1e-2)


def test_the_table_choice_falls_back_to_plain_blocks_where_tma_cannot_read_the_scales(monkeypatch):
    """A table entry naming Gluon blocks is used only where TMA can read the operands (A scale rows are
    16-byte aligned when M % 4 == 0); else the entry's plain blocks run."""
    chosen = []

    def choose(m, n, k, *, warp_specialize=True, device_type="cuda", gpu="h200"):
        chosen.append(warp_specialize)
        return GemmBlocks.parse("128x128x128w4s5gl" if warp_specialize else "16x32x128w4s1")

    monkeypatch.setattr(fp8, "choose_fp8_blocks", choose)
    ops = _operands(m=7)
    out = fp8.fp8_gemm(**ops)  # plain blocks: runs here, under the interpreter
    ref = fp8.scaled_mm_reference(**ops)
    assert chosen == [True, False] and torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    chosen.clear()
    with pytest.raises(ValueError, match="needs a CUDA device"):  # M 8: the Gluon blocks stay chosen
        fp8.fp8_gemm(**_operands(m=8))
    assert chosen == [True]


def test_gluon_operand_problems_name_the_unaligned_scale_rows():
    from tp_overlap.gemm.fp8_gluon_launch import gluon_operand_problems

    out = torch.empty(8, 16, dtype=torch.bfloat16)
    assert gluon_operand_problems(**_operands(m=8), out=out) == []
    problems = gluon_operand_problems(**_operands(m=6), out=out[:6])
    assert len(problems) == 1 and "a_scales needs a 16-byte aligned" in problems[0]
    ops = _operands(m=8, n=256)  # weight scales as a plain contiguous [2, 2]: rows of 8 bytes
    problems = gluon_operand_problems(**(ops | {"w_scales": ops["w_scales"].contiguous()}),
                                      out=torch.empty(8, 256, dtype=torch.bfloat16))
    assert len(problems) == 1 and "w_scales needs a 16-byte aligned" in problems[0]


def test_row_major_a_scales_with_padded_rows_are_read_as_they_are():
    """An AllGather pool keeps the gathered scales row-major, rows padded to 4 (16 bytes): TMA reads those
    rows directly (boxes [128, 4]); unpadded row-major rows are refused."""
    from tp_overlap.gemm.fp8_gluon_launch import _a_scale_rows, gluon_operand_problems

    ops = _operands(m=8)
    padded = torch.zeros(8, fp8.padded_scale_groups(256))[:, :2]
    padded.copy_(ops["a_scales"])
    out = torch.empty(8, 16, dtype=torch.bfloat16)
    assert _a_scale_rows(padded) is padded and _a_scale_rows(ops["a_scales"]).shape == (2, 8)
    assert gluon_operand_problems(**(ops | {"a_scales": padded}), out=out) == []
    problems = gluon_operand_problems(**(ops | {"a_scales": ops["a_scales"].contiguous()}), out=out)
    assert len(problems) == 1 and "a_scales needs a 16-byte aligned" in problems[0]


def test_every_gluon_choice_of_the_fp8_table_and_the_candidates_is_runnable():
    """A stale entry (e.g. a ring depth the kernel no longer fits) would otherwise fail only on the GPU."""
    from tp_overlap.gemm.blocks import load_block_table
    from tp_overlap.gemm.fp8_gluon_launch import gluon_block_problems

    table = load_block_table("h200_fp8")
    names = {e.blocks.name for e in table.entries} | {n for n in FP8_CANDIDATES if GemmBlocks.parse(n).gluon}
    gluon = [GemmBlocks.parse(name) for name in sorted(names) if GemmBlocks.parse(name).gluon]
    assert gluon, "the table names no Gluon blocks"
    for b in gluon:
        assert gluon_block_problems(b) == [], b.name
    assert gluon_block_problems(GemmBlocks.parse("128x128x128w4s4sk1gl")) == []
    assert any("stream_k 2" in p for p in gluon_block_problems(GemmBlocks.parse("128x128x128w4s4sk2gl")))


def test_the_fp8_consumer_keeps_the_tables_gluon_entry_with_a_split_tail_and_the_ops_bench_records_it():
    """With chunk waits the H200 table's Gluon entry stays chosen (its waiter warp waits), with a split tail
    (the op owns the buffers); a plain entry stays plain; the ops bench records the blocks through the same
    function."""
    from tp_overlap.launch.measure import gemm_bench_ops
    from tp_overlap.ops.ag_consumers import consumer_fp8_blocks

    chosen = fp8.fp8_default_blocks(4096, 768, 4096, chunk_wait=True, device_type="cuda", gpu="h200")
    assert chosen.name == "128x128x128w4s4gl" and chosen == fp8.choose_fp8_blocks(4096, 768, 4096, gpu="h200")
    assert consumer_fp8_blocks(4096, 768, 4096, device_type="cuda", gpu="h200").name == "128x128x128w4s4sk1gl"
    assert consumer_fp8_blocks(4096, 768, 4096, device_type="cpu", gpu=None) == \
        fp8.choose_fp8_blocks(4096, 768, 4096, device_type="cpu", warp_specialize=False)
    assert gemm_bench_ops.consumer_fp8_blocks is consumer_fp8_blocks


def test_plain_fp8_blocks_run_one_program_per_sm_where_the_table_measured_o2():
    # tables written since gemm_bench's plain column holds one-program blocks only have none (the H100's)
    table = load_block_table("h200_fp8")
    o2 = [e for e in table.entries if e.plain.programs_per_sm == 2]
    assert o2, "the H200 FP8 table has o2 plain entries: the case this guards"
    for e in o2:
        got = fp8.choose_fp8_blocks(e.m, e.n, e.k, warp_specialize=False, gpu="h200")
        assert got.programs_per_sm == 1 and got.block_m == 128 and got.plain
        assert fp8.choose_fp8_blocks(e.m, e.n, e.k, gpu="h200") == e.blocks


class _LaunchRecorder:
    """Stands in for the Gluon kernel: records each launch's (grid, arguments, keyword arguments)."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@pytest.mark.parametrize("m, n, k, blocks, whole_tiles, splits", [
    (1024, 7168, 8192, "128x128x128w4s4sk1gl", 396, 2),   # 448 tiles on 132 programs: the last 52 cut in two
    (1024, 7168, 4096, "128x128x128w4s4sk1gl", 396, 2),   # the same with K 4096 (measured: the cut pays)
    (1024, 7168, 8192, "128x128x128w4s4gl", 448, 1),      # no split tail asked for
    (1024, 3584, 4096, "128x128x128w4s4sk1gl", 224, 1),   # one partial wave that a split would not shorten
    (8192, 7168, 4096, "128x128x128w4s4sk1gl", 3584, 1),  # 27 waves: the split build's slowdown costs more
])
def test_only_a_launch_that_cuts_a_split_tail_runs_the_build_with_the_split_path(monkeypatch, m, n, k, blocks,
                                                                                 whole_tiles, splits):
    import tp_overlap.kernels.gemm_fp8_gluon as kernel_module
    from tp_overlap.gemm.fp8_gluon_launch import launch_fp8_gluon_gemm
    from tp_overlap.gemm.gluon_launch import split_buffers

    recorder = _LaunchRecorder()
    monkeypatch.setattr(kernel_module, "fp8_gluon_gemm_kernel", recorder)
    launch_fp8_gluon_gemm(a8=torch.zeros(m, k, dtype=torch.float8_e4m3fn), a_scales=torch.ones(k // 128, m),
                          w8=torch.zeros(n, k, dtype=torch.float8_e4m3fn), w_scales=torch.ones(n // 128, k // 128),
                          out=torch.empty(m, n, dtype=torch.bfloat16), blocks=GemmBlocks.parse(blocks),
                          num_programs=132, checked=True, split_buffers=split_buffers(torch.device("cpu"), 132))
    ((grid, args, kwargs),) = recorder.launches
    assert (args[9], args[10]) == (whole_tiles, splits) and grid == (min(132, -(-m // 128) * (n // 128)),)
    assert kwargs["SPLIT_TAIL"] is (splits > 1)


def test_a_256_wide_tile_reads_a_b_scale_row_per_128_columns_and_runs_whole():
    import tp_overlap.kernels.gemm_fp8_gluon as kernel_module
    from tp_overlap.gemm.fp8_gluon_launch import launch_fp8_gluon_gemm

    recorder = _LaunchRecorder()
    m, n, k = 1024, 7168, 4096
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel_module, "fp8_gluon_gemm_kernel", recorder)
        launch_fp8_gluon_gemm(a8=torch.zeros(m, k, dtype=torch.float8_e4m3fn), a_scales=torch.ones(k // 128, m),
                              w8=torch.zeros(n, k, dtype=torch.float8_e4m3fn), w_scales=torch.ones(n // 128, k // 128),
                              out=torch.empty(m, n, dtype=torch.bfloat16), blocks=GemmBlocks.parse("128x256x128w4s3gl"),
                              num_programs=132, checked=True)
    ((grid, args, kwargs),) = recorder.launches
    assert grid == (132,) and (args[9], args[10]) == (8 * 28, 1) and kwargs["SPLIT_TAIL"] is False
    assert list(args[1].block_shape) == [256, 128] and list(args[2].block_shape) == [64, 256]
    assert list(args[4].block_shape) == [2, 4]  # the B scales of both 128-column sub-tiles


def test_the_fp8_consumer_adds_a_split_tail_to_128_wide_tiles_only():
    from tp_overlap.ops.ag_consumers import consumer_fp8_blocks

    table = {(e.m, e.n, e.k): e.blocks for e in load_block_table("h100_fp8").entries}
    wide = [key for key, blocks in table.items() if blocks.block_n == 256]
    narrow = [key for key, blocks in table.items() if blocks.gluon and blocks.block_n == 128]
    assert wide and narrow, "the H100 FP8 table names both widths: the cases this guards"
    for (m, n, k), split in [(wide[0], 0), (narrow[0], 1)]:
        blocks = consumer_fp8_blocks(m, n, k, device_type="cuda", gpu="h100")
        assert blocks == dataclasses.replace(table[(m, n, k)], stream_k=split), (m, n, k, blocks)
