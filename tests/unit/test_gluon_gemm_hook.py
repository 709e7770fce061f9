"""The Gluon bf16 GEMM's place behind triton_mm (its numerics are checked on the GPU by
tests/gpu/check_gluon_gemm.py: Gluon kernels do not run under the interpreter)."""

import re

import pytest
import torch
import yaml

from tp_overlap.launch.measure.tune import GEMM_CLASSES, GLUON_CANDIDATES
from tp_overlap.gemm import BlockTableError, GemmBlocks, parse_block_table, triton_gemm, triton_mm
from tp_overlap.gemm.gluon_launch import gluon_operand_problems


def test_gluon_candidates_are_valid_bf16_blocks_in_every_class_and_not_plain():
    for name in GLUON_CANDIDATES:
        blocks = GemmBlocks.parse(name)
        assert blocks.gluon and blocks.problems() == [], (name, blocks.problems())
        assert not blocks.plain, "the Gluon kernel has no chunk-wait or scatter mode"
    assert all(set(GLUON_CANDIDATES) <= set(names) for names in GEMM_CLASSES.values())


@pytest.mark.parametrize("name,problem", [
    ("128x256x64w8s3gl", "num_warps 8 not in (4,)"),
    ("32x128x64w4s4gl", "block_m 32 not in (128, 192)"),
    ("192x256x64w4s2gl", "block_n 256 > 128 with block_m 192"),
    ("192x32x64w4s4gl", "gluon boxes: block_m 192 not in (64, 128)"),
    ("128x112x64w4s4gl", "block_n 112 is not the sum of two powers of two"),
    ("64x96x64w4s8sk1gl", "gluon boxes: stream_k 1 not in (0,)"),
    ("256x96x64w4s4gl", "gluon boxes: block_m 256 not in (64, 128)"),
    ("128x96x64w4s8gl", "shared memory"),
    ("128x128x128w4s2gl", "block_k 128 not in (64,)"),
    ("128x128x32w4s4gl", "block_k 32 not in (64,)"),
    ("128x128x64w4s4g16gl", "group_m 16 not in (8,)"),
    ("128x128x64w4s1gl", "num_stages 1 < 2"),
    ("128x256x64w4s4gl", "shared memory"),
    ("64x96x64w4s11gl", "shared memory"),
    ("64x32x64w4s13gl", "num_stages 13 not in 1..12"),
])
def test_blocks_name_what_the_gluon_kernel_cannot_run(name, problem):
    assert any(problem in p for p in GemmBlocks.parse(name).problems()), GemmBlocks.parse(name).problems()


def test_a_bf16_table_refuses_gluon_blocks_the_kernel_cannot_run():
    raw = yaml.safe_load("num_sms: 132\nentries:\n  - {layout: nk, m: 1024, n: 768, k: 4096, "
                         "blocks: 128x256x64w8s3gl, plain: 128x128x64w4s4}\n")
    with pytest.raises(BlockTableError, match=re.escape("gluon: num_warps 8 not in (4,)")):
        parse_block_table(raw, "t.yaml")
    raw["entries"][0]["blocks"] = "128x256x64w4s3gl"
    assert parse_block_table(raw, "t.yaml").entries[0].blocks.gluon


def test_operand_problems_name_alignment_layout_and_dtype():
    a = torch.empty(64, 72, dtype=torch.bfloat16)
    b = torch.empty(72, 32, dtype=torch.bfloat16)
    out = torch.empty(64, 32, dtype=torch.bfloat16)
    assert gluon_operand_problems(a, b, out) == []
    assert any("16-byte aligned base" in p for p in gluon_operand_problems(a[:, 1:65], b[:64], out))
    assert any("row stride 36 x 2 bytes" in p for p in gluon_operand_problems(torch.empty(64, 36).bfloat16(),
                                                                               torch.empty(36, 32).bfloat16(), out))
    assert any("contiguous rows" in p for p in gluon_operand_problems(a, b, torch.empty(32, 64).bfloat16().t()))
    assert any("dtypes" in p for p in gluon_operand_problems(a.float(), b.float(), out.float()))


def test_explicit_gluon_blocks_are_refused_off_cuda_and_when_invalid():
    a, b = torch.randn(32, 64).bfloat16(), torch.randn(64, 16).bfloat16()
    out = torch.empty(32, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        triton_mm(a, b, out, blocks=GemmBlocks.parse("128x128x64w4s4gl"))
    with pytest.raises(ValueError, match=re.escape("num_warps 8 not in (4,)")):
        triton_mm(a, b, out, blocks=GemmBlocks.parse("128x128x64w8s4gl"))


def test_the_table_choice_falls_back_to_plain_blocks_where_the_gluon_kernel_cannot_run(monkeypatch):
    """A table entry naming Gluon blocks runs only where TMA reads the operands; else (here: the CPU, where
    no Gluon kernel runs) the entry's plain blocks compute the product under the interpreter."""
    chosen = []

    def choose(m, n, k, *, b_transposed=False, device_type="cuda", warp_specialize=True, sm_count=132, gpu=None):
        chosen.append(warp_specialize)
        return GemmBlocks.parse("128x128x64w4s4gl" if warp_specialize else "16x16x16w1s1")

    monkeypatch.setattr(triton_gemm, "choose_blocks", choose)
    a, w = torch.randn(40, 48).bfloat16(), torch.randn(24, 48).bfloat16()
    out = torch.full((40, 24), float("nan"), dtype=torch.bfloat16)
    triton_mm(a, w.t(), out)
    assert chosen == [True, False]
    torch.testing.assert_close(out.float(), a.float() @ w.float().t(), rtol=2e-2, atol=2e-2)


def test_launch_gemm_refuses_gluon_blocks():
    from tp_overlap.gemm import launch_gemm

    a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
    with pytest.raises(ValueError, match="name a Gluon kernel"):
        launch_gemm(a=a, w=b, out=torch.empty(16, 16, dtype=torch.bfloat16), num_programs=1,
                    blocks=GemmBlocks.parse("128x128x64w4s4gl"))


def test_split_plan_cuts_only_a_partial_last_wave_and_only_when_it_pays():
    from tp_overlap.gemm.gluon_launch import split_plan

    tile = 2 * 128 * 128 * 4096
    assert split_plan(264, 132, 64, tile) == (264, 1), "full waves: nothing to split"
    assert split_plan(48, 132, 64, tile) == (0, 2), "48 tiles on 132 SMs: two K halves fill 96"
    whole, splits = split_plan(160, 132, 128, 2 * tile)
    assert whole == 132 and 28 * splits <= 132 and splits > 2
    assert split_plan(48, 132, 1, tile) == (48, 1), "one K step cannot be split"
    assert split_plan(96, 132, 64, 2 * 128 * 64 * 4096) == (96, 1), "a cheap tile gains less than the fix-up"
    for tiles in range(1, 600, 7):
        whole, splits = split_plan(tiles, 132, 16, tile)
        assert whole % 132 == 0 or splits == 1
        assert 1 <= splits <= 8 and (splits == 1) == (whole == tiles)


def test_a_split_build_slowdown_keeps_whole_tiles_where_many_waves_would_pay_it():
    from tp_overlap.gemm.gluon_launch import split_plan

    tile = 128 * 128 * 4096  # an FP8 tile (twice the bf16 rate)
    assert split_plan(3584, 132, 32, tile)[1] > 1, "27 waves: without a slowdown the tail is cut"
    assert split_plan(3584, 132, 32, tile, None, 0.05) == (3584, 1), "5 % of 27 waves outweighs the tail's gain"
    assert split_plan(448, 132, 64, 2 * tile, None, 0.05) == (396, 2), "3.4 waves of long tiles: still cut"
    for tiles in range(1, 4000, 37):  # a slowdown only ever removes splits
        whole, splits = split_plan(tiles, 132, 32, tile, None, 0.05)
        assert splits == 1 or split_plan(tiles, 132, 32, tile)[1] > 1


def test_split_plan_keeps_within_a_fixed_workspace():
    from tp_overlap.gemm.gluon_launch import split_plan

    tile = 2 * 128 * 128 * 14336  # 160 tiles on 116 programs: a tail of 44 tiles of 224 K steps
    whole, splits = split_plan(160, 116, 224, tile)
    assert whole == 116 and 44 * splits > 116, "uncapped, the model cuts the tail into more pieces than programs"
    whole, capped = split_plan(160, 116, 224, tile, 116)
    assert whole == 116 and 1 < capped < splits and 44 * capped <= 116
    assert split_plan(160, 116, 224, tile, 44) == (160, 1), "room for one piece a tile: no split"


def test_split_buffers_bound_every_plan_they_serve():
    from tp_overlap.gemm.gluon_launch import split_buffers, split_plan

    workspace, counters = split_buffers(torch.device("cpu"), 116)
    assert int(counters.abs().sum()) == 0 and counters.dtype == torch.int32
    for bn in (128, 256):
        cap = workspace.numel() // (128 * bn)
        for tiles in range(1, 700, 3):
            whole, splits = split_plan(tiles, 116, 112, 2 * 128 * bn * 7168, cap)
            assert (tiles - whole) * splits * 128 * bn <= workspace.numel() or splits == 1
            assert 2 * (tiles - whole) <= counters.numel() or splits == 1


def test_a_launch_splits_into_the_buffers_it_is_given_and_within_them():
    from tp_overlap.gemm.gluon_launch import split_tail, split_buffers, split_plan

    cpu = torch.device("cpu")
    blocks = GemmBlocks.parse("128x128x64w4s6sk1gl")
    mine = split_buffers(cpu, 116)
    programs, whole, splits, workspace, counters = split_tail(blocks, 1024, 4096, 7168, 116, cpu, mine)
    assert (whole, workspace, counters) == (232, mine[0], mine[1]) and splits > 1 and programs == 116
    assert (256 - whole) * splits * 128 * 128 <= mine[0].numel()
    small = (mine[0][:24 * 128 * 128], mine[1])  # room for one piece a tile: whole tiles, nothing borrowed
    assert split_tail(blocks, 1024, 4096, 7168, 116, cpu, small)[1:3] == (256, 1)
    wide = GemmBlocks.parse("128x256x64w4s3sk1gl")  # room for 116 such pieces (232 of 128 x 128)
    tail = 2 * 128 * 256 * 14336  # the model alone would cut 44 tail tiles into more pieces than that
    assert 44 * split_plan(160, 116, 224, tail)[1] > 116
    assert 1 < split_tail(wide, 1280, 4096, 14336, 116, cpu, mine)[2] <= 116 // 44
    assert split_tail(GemmBlocks.parse("128x128x64w4s6gl"), 1024, 4096, 7168, 116, cpu, mine)[1:3] == (256, 1)


def test_sk1_is_the_only_stream_k_the_gluon_kernel_takes():
    assert GemmBlocks.parse("128x128x64w4s6sk1gl").problems() == []
    assert any("stream_k 2 not in (0, 1)" in p for p in GemmBlocks.parse("128x128x64w4s6sk2gl").problems())


@pytest.mark.parametrize("block_n,boxes", [(96, (64, 32)), (80, (64, 16)), (160, (128, 32)), (192, (128, 64)),
                                           (128, (64, 64)), (48, (32, 16)), (112, None), (16, None), (320, None)])
def test_box_widths_split_a_width_into_two_powers_of_two(block_n, boxes):
    from tp_overlap.gemm.blocks import box_widths

    assert box_widths(block_n) == boxes


def test_the_two_box_kernel_runs_block_m_64_and_widths_that_are_not_powers_of_two():
    from tp_overlap.launch.measure.tune import GLUON_BOX_CANDIDATES

    assert GemmBlocks.parse("128x96x64w4s7gl").gluon_boxes == (64, 32)
    assert GemmBlocks.parse("64x128x64w4s7gl").gluon_boxes == (64, 64)
    assert GemmBlocks.parse("128x128x64w4s6gl").gluon_boxes is None      # kernels/gemm_gluon.py
    assert GemmBlocks.parse("128x96x64w4s7").gluon_boxes is None         # not Gluon
    for name in GLUON_BOX_CANDIDATES:
        blocks = GemmBlocks.parse(name)
        assert blocks.gluon_boxes and not blocks.problems(), (name, blocks.problems())
