"""Block choice of the GEMM launcher: the table (configs/gemm_blocks/), its loader and the fallback heuristic
(pure functions of the shape, the layout and the program count)."""

import pytest

from tp_overlap.gemm.blocks import (LAYOUTS, PLAIN_BLOCK_M, BlockTable, BlockTableEntry, BlockTableError, GemmBlocks,
                                  block_table_path, choose_blocks, heuristic_blocks,
                                  load_block_table, parse_block_table, shared_memory_bytes, stream_k_tiles)
from tp_overlap.gemm.fused_blocks import fused_gluon_blocks
from tp_overlap.launch.cli.shapes import ag_points, rs_points

H200 = load_block_table("h200")


def test_the_h200_table_exists_and_every_entry_is_launchable():
    assert H200 is not None and H200.num_sms == 132 and H200.entries
    for entry in H200.entries:
        assert entry.layout in LAYOUTS
        assert not entry.blocks.problems() and not entry.plain.problems(), entry
        assert entry.plain.plain and entry.plain.block_m == PLAIN_BLOCK_M, entry
        assert shared_memory_bytes(entry.blocks) <= 232448
        # every entry is one of the benchmark table's local GEMMs at TP 2, 4 or 8, M = 1024 ... 16384 (the tuner's)
        ms = (1024, 2048, 4096, 8192, 16384)
        shapes = {(p.m, p.n, p.k) for w in (2, 4, 8) for p in ag_points(w, ms=ms) + rs_points(w, ms=ms)}
        assert (entry.m, entry.n, entry.k) in shapes, entry


def test_names_round_trip_and_mean_what_they_say():
    blocks = GemmBlocks.parse("128x256x64w4s3g16ws")
    assert blocks == GemmBlocks(128, 256, 64, 16, 4, 3, warp_specialize=True)
    assert GemmBlocks.parse("128x128x128w8s3es2sk2") == GemmBlocks(128, 128, 128, 8, 8, 3, epilogue_subtile=2,
                                                                   stream_k=2)
    for name in ("128x256x64w8s3", "64x128x64w4s6g4fl", "128x128x64w8s4wsflsk1", "256x128x64w8s3es2"):
        assert GemmBlocks.parse(name).name == name
    with pytest.raises(ValueError, match="does not read as"):
        GemmBlocks.parse("128x256w8s3")
    assert GemmBlocks.parse("128x256x64w8s3").plain and not GemmBlocks.parse("128x256x64w8s3sk1").plain
    assert GemmBlocks.parse("128x256x128w8s3").problems()  # 3 stages of 128-deep tiles overflow shared memory


def test_table_entries_win_for_their_shape_and_layout_and_m_picks_the_nearest_bucket():
    table = BlockTable("x", 132, (
        BlockTableEntry("kn", 1024, 3072, 4096, GemmBlocks.parse("128x128x64w8s4sk1"),
                        GemmBlocks.parse("128x128x64w4s4")),
        BlockTableEntry("kn", 16384, 3072, 4096, GemmBlocks.parse("128x256x64w4s3ws"),
                        GemmBlocks.parse("128x256x64w8s3")),
        BlockTableEntry("nk", 1024, 3072, 4096, GemmBlocks.parse("64x128x64w4s6"),
                        GemmBlocks.parse("128x128x64w8s5")),
    ))
    assert choose_blocks(1024, 3072, 4096, table=table).name == "128x128x64w8s4sk1"
    assert choose_blocks(1024, 3072, 4096, b_transposed=True, table=table).name == "64x128x64w4s6"
    assert choose_blocks(1024, 3072, 4096, warp_specialize=False, table=table).name == "128x128x64w4s4"
    assert choose_blocks(1024, 3072, 4096, b_transposed=True, warp_specialize=False, table=table).name == \
        "128x128x64w8s5"
    assert choose_blocks(2000, 3072, 4096, table=table).name == "128x128x64w8s4sk1"   # log2: nearer 1024
    assert choose_blocks(8192, 3072, 4096, table=table).name == "128x256x64w4s3ws"   # nearer 16384
    assert choose_blocks(4096, 3072, 4096, table=table).name == "128x256x64w4s3ws"   # tie: the larger M
    # another N, another K or nothing for the layout: the heuristic
    assert choose_blocks(1024, 3072, 2048, table=table) == heuristic_blocks(1024, 3072, 2048)
    assert choose_blocks(1024, 3584, 4096, table=table) == heuristic_blocks(1024, 3584, 4096)
    assert choose_blocks(16384, 3072, 4096, b_transposed=True, table=table).name == "64x128x64w4s6"


def test_unknown_gpus_and_shapes_fall_back_to_the_heuristic():
    assert load_block_table("b300") is None
    assert choose_blocks(1024, 5120, 8192, gpu="b300") == heuristic_blocks(1024, 5120, 8192)
    assert choose_blocks(1000, 1000, 1000) == heuristic_blocks(1000, 1000, 1000)
    assert choose_blocks(4096, 4096, 4096, device_type="cpu").block_m == 16


def test_heuristic_prefers_wide_tiles_unless_narrow_ones_fill_the_last_wave_clearly_better():
    # M = 1024, N = 5120 on 132 programs: 160 wide tiles (1.21 waves, 61 % busy) vs 320 narrow (81 %)
    assert heuristic_blocks(1024, 5120, 8192).block_n == 128
    # N = 4096: 128 wide tiles fit one wave (97 %), as do 256 narrow ones: a tie goes to the wider tile
    assert heuristic_blocks(1024, 4096, 2048).block_n == 256
    # the same 160 wide tiles are exactly 2 waves of 80 programs (a fused op with a large sm_margin)
    assert heuristic_blocks(1024, 5120, 8192, sm_count=80).block_n == 256
    assert not heuristic_blocks(4096, 4096, 4096, warp_specialize=False).warp_specialize


def test_flag_waiting_callers_always_get_a_plain_configuration():
    for entry in H200.entries:
        for m in (entry.m, entry.m // 2 + 1):
            got = choose_blocks(m, entry.n, entry.k, b_transposed=entry.layout == "nk", warp_specialize=False)
            assert got.plain and got.block_m == PLAIN_BLOCK_M and got.programs_per_sm == 1
    assert choose_blocks(333, 444, 555, warp_specialize=False).plain


def test_an_o2_plain_entry_gives_flag_waiting_callers_the_heuristic_they_run_one_program_per_sm():
    table = BlockTable("x", 132, (
        BlockTableEntry("kn", 1024, 4096, 1792, GemmBlocks.parse("128x128x64w4s6gl"),
                        GemmBlocks.parse("128x128x64w4s3es2o2")),
        BlockTableEntry("nk", 1024, 4096, 1792, GemmBlocks.parse("128x128x64w4s6gl"),
                        GemmBlocks.parse("128x256x64w8s4es2"))))
    assert choose_blocks(1024, 4096, 1792, warp_specialize=False, table=table) == \
        heuristic_blocks(1024, 4096, 1792, warp_specialize=False)
    assert choose_blocks(1024, 4096, 1792, table=table).name == "128x128x64w4s6gl"  # the table's fastest stays
    assert choose_blocks(1024, 4096, 1792, b_transposed=True, warp_specialize=False, table=table).name == \
        "128x256x64w8s4es2"
    assert any(e.plain.programs_per_sm == 2 for e in load_block_table("h100").entries)  # the case is real


def test_fused_gluon_blocks_are_one_box_and_drop_the_split_tail_of_callers_without_buffers():
    table = BlockTable("x", 132, (
        BlockTableEntry("kn", 4096, 3072, 4096, GemmBlocks.parse("192x128x64w4s4sk1gl"),
                        GemmBlocks.parse("128x128x64w4s4")),
        BlockTableEntry("nk", 4096, 3072, 4096, GemmBlocks.parse("64x192x64w4s6gl"),  # two B boxes: no wait
                        GemmBlocks.parse("128x128x64w8s5")),
        BlockTableEntry("kn", 4096, 5120, 4096, GemmBlocks.parse("128x256x64w8s3g16"),  # not Gluon
                        GemmBlocks.parse("128x256x64w8s3")),
    ))
    choose = dict(gpu="x", sm_count=132, table=table)
    assert fused_gluon_blocks(4096, 3072, 4096, b_transposed=False, **choose).name == "192x128x64w4s4gl"
    assert fused_gluon_blocks(4096, 3072, 4096, b_transposed=True, **choose).name == "128x256x64w4s3gl"
    assert fused_gluon_blocks(4096, 5120, 4096, b_transposed=False, **choose).name == "128x256x64w4s3gl"
    # fewer programs than the table measured: 512 wide tiles on 116 programs leave 12 % idle, 1024 narrow 2 %
    wide = BlockTable("x", 132, (BlockTableEntry("kn", 4096, 4096, 1792, GemmBlocks.parse("128x256x64w4s3gl"),
                                                 GemmBlocks.parse("128x256x64w8s3")),))
    assert fused_gluon_blocks(4096, 4096, 1792, b_transposed=False, gpu="x", sm_count=132, table=wide).block_n == 256
    assert fused_gluon_blocks(4096, 4096, 1792, b_transposed=False, gpu="x", sm_count=116, table=wide).block_n == 128
    # no table: the heuristic's wave rule on Gluon tiles (M = 1024, N = 5120: narrow tiles fill the wave)
    assert fused_gluon_blocks(1024, 5120, 8192, b_transposed=False, gpu="b300", sm_count=132).name == \
        "128x128x64w4s6gl"
    for entry in H200.entries:
        got = fused_gluon_blocks(entry.m, entry.n, entry.k, b_transposed=entry.layout == "nk", gpu="h200",
                                sm_count=116)
        assert got.gluon and not got.gluon_boxes and not got.stream_k and not got.problems(), (entry, got)


def test_the_scatter_gemm_keeps_or_adds_a_split_tail_where_the_table_did_not_measure_its_grid():
    from tp_overlap.ops.rs_scatter import scatter_gluon_blocks

    table = BlockTable("x", 132, (
        BlockTableEntry("kn", 1024, 4096, 3584, GemmBlocks.parse("128x128x64w4s6sk1gl"),
                        GemmBlocks.parse("128x256x64w8s3")),
        BlockTableEntry("nk", 1024, 4096, 1792, GemmBlocks.parse("128x128x64w4s6gl"),
                        GemmBlocks.parse("128x128x64w4s3")),
    ))
    split = dict(gpu="x", table=table, block_m=128, split_tail=True)
    assert fused_gluon_blocks(1024, 4096, 3584, b_transposed=False, sm_count=132, **split).name == \
        "128x128x64w4s6sk1gl", "the table's split tail, kept"
    assert fused_gluon_blocks(1024, 4096, 1792, b_transposed=True, sm_count=132, **split).name == \
        "128x128x64w4s6gl", "the table measured every SM and chose whole tiles"
    assert fused_gluon_blocks(1024, 4096, 1792, b_transposed=True, sm_count=116, **split).name == \
        "128x128x64w4s6sk1gl", "116 programs: 256 tiles leave a wave of 24, cut by K"
    assert fused_gluon_blocks(1024, 4096, 3584, b_transposed=False, sm_count=132, gpu="x", table=table,
                              block_m=128).name == "128x128x64w4s6gl", "no workspace of its own: whole tiles"
    assert fused_gluon_blocks(1024, 4096, 7168, b_transposed=False, sm_count=116, **split).name == \
        "128x128x64w4s6sk1gl", "no entry: the heuristic's tiles, split"
    # no entry, split: wide tiles where they fill two waves (H100, M = 1024 on 116 programs, vs cuBLASLt: N = 8192
    # wide 0.95, narrow 0.90-0.92; N = 4096 narrow 0.94-0.97, wide 0.82-0.93)
    assert fused_gluon_blocks(1024, 8192, 7168, b_transposed=True, sm_count=116, **split).name == \
        "128x256x64w4s3sk1gl"
    assert fused_gluon_blocks(1024, 8192, 7168, b_transposed=True, sm_count=116, gpu="x", table=table,
                              block_m=128).name == "128x128x64w4s6gl", "whole tiles: the wave rule (88 % vs 74 %)"
    for entry in H200.entries:
        got = scatter_gluon_blocks(entry.m, entry.n, entry.k, b_transposed=entry.layout == "nk", gpu="h200",
                                   programs=116)
        assert got.block_m == 128 and not got.problems(), (entry, got)
        assert got.stream_k == 1 if not got.gluon_boxes else got.stream_k == 0, (entry, got)


def test_the_scatter_gemm_takes_tiles_two_boxes_wide_where_whole_waves_of_them_finish_clearly_sooner():
    from tp_overlap.gemm.gluon_launch import modelled_seconds
    from tp_overlap.ops.ag_consumers import consumer_gluon_blocks
    from tp_overlap.ops.rs_scatter import reduce_gluon_blocks, scatter_gluon_blocks

    # TP 8's llama8b fc2 at M = 1024 on 116 programs: 256 tiles of 128x128 take three rounds, 232 of 128x144 two
    got = scatter_gluon_blocks(1024, 4096, 1792, b_transposed=True, gpu="h100", programs=116)
    assert got.name == "128x144x64w4s5gl" and got.gluon_boxes == (128, 16) and not got.problems()
    one_box = fused_gluon_blocks(1024, 4096, 1792, b_transposed=True, gpu="h100", sm_count=116, block_m=128,
                                 split_tail=True)
    assert one_box.name == "128x128x64w4s6sk1gl"
    assert modelled_seconds(got, 1024, 4096, 1792, 116) < 0.8 * modelled_seconds(one_box, 1024, 4096, 1792, 116)
    # every SM (the table measured that grid), whole waves already, or not 10 % sooner: the one-box choice
    assert scatter_gluon_blocks(1024, 4096, 1792, b_transposed=True, gpu="h100", programs=132).name == \
        "128x128x64w4s6gl"
    for m, n, k in ((4096, 4096, 1792), (1024, 8192, 3584), (16384, 8192, 3584)):
        assert not scatter_gluon_blocks(m, n, k, b_transposed=True, gpu="h100", programs=116).gluon_boxes, (m, n)
    # the AllGather consumer and the scatter-reduce GEMM run one-box tiles only
    for choose in (consumer_gluon_blocks, reduce_gluon_blocks):
        assert not choose(1024, 4096, 1792, b_transposed=True, gpu="h100", programs=116).gluon_boxes


def test_the_allgather_consumer_keeps_the_tables_split_tail():
    from tp_overlap.ops.ag_consumers import consumer_gluon_blocks

    h100 = load_block_table("h100")
    entry = h100.lookup(1024, 14336, 4096, "nk")
    assert entry.blocks.name == "128x256x64w4s3sk1gl"
    assert consumer_gluon_blocks(1024, 14336, 4096, b_transposed=True, gpu="h100", programs=132) == entry.blocks
    for entry in h100.entries:
        got = consumer_gluon_blocks(entry.m, entry.n, entry.k, b_transposed=entry.layout == "nk", gpu="h100",
                                    programs=132)
        assert got.gluon and not got.gluon_boxes and not got.problems(), (entry, got)
        if entry.blocks.gluon and not entry.blocks.gluon_boxes:
            assert got == entry.blocks, (entry, got)


def test_stream_k_tiles_cover_the_last_partial_wave_plus_full_waves():
    assert stream_k_tiles(96, 132, 1) == 96          # less than one wave: every tile is split
    assert stream_k_tiles(192, 132, 1) == 60
    assert stream_k_tiles(192, 132, 2) == 192
    assert stream_k_tiles(400, 132, 2) == 4 + 132
    assert stream_k_tiles(264, 132, 1) == 0          # whole waves: nothing to balance
    assert stream_k_tiles(192, 132, 0) == 0


def write(tmp_path, text):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return str(path)


GOOD = "- {layout: kn, m: 1024, n: 3072, k: 4096, blocks: 128x256x64w8s3, plain: 128x256x64w8s3}"


@pytest.mark.parametrize("entry,message", [
    ("- {layout: tn, m: 1024, n: 3072, k: 4096, blocks: 128x256x64w8s3, plain: 128x256x64w8s3}",
     r"entries\[1\].layout: got 'tn'"),
    ("- {layout: kn, m: 0, n: 3072, k: 4096, blocks: 128x256x64w8s3, plain: 128x256x64w8s3}",
     r"entries\[1\].m: got 0"),
    ("- {layout: kn, m: 1024, n: 3072, k: 4096, blocks: 128x256x64w8s13, plain: 128x256x64w8s3}",
     r"entries\[1\].blocks: got '128x256x64w8s13'; num_stages 13"),
    ("- {layout: kn, m: 1024, n: 3072, k: 4096, blocks: 128x256x64w8s3, plain: 128x256x64w8s3sk1}",
     r"entries\[1\].plain: got '128x256x64w8s3sk1'; allowed: BLOCK_M 128 without"),
    ("- {layout: kn, m: 1024, n: 3072, k: 4096, blocks: 128x256x64w8s3, plain: 64x256x64w8s3}",
     r"entries\[1\].plain: got '64x256x64w8s3'"),
    ("- {layout: kn, m: 1024, n: 3072, k: 4096, blocks: 128x256x64w8s3, plain: 128x256x64w8s3}",
     r"entries\[1\] repeats entries\[0\]"),
    ("- {layout: kn, m: 1024, n: 3072, k: 4096, blocks: 128x256x64w8s3}", r"missing keys \['plain'\]"),
])
def test_bad_tables_name_file_entry_key_and_value(tmp_path, entry, message):
    path = write(tmp_path, f"gpu: x\nnum_sms: 132\nentries:\n{GOOD}\n{entry}\n")
    with pytest.raises(BlockTableError, match=message) as info:
        load_block_table(path=path)
    assert str(info.value).startswith("t.yaml: ")


def test_a_good_table_file_loads_and_a_missing_one_is_an_error(tmp_path):
    table = load_block_table(path=write(tmp_path, f"gpu: x\nnum_sms: 100\nentries:\n{GOOD}\n"))
    assert table.num_sms == 100 and table.entries[0].blocks.name == "128x256x64w8s3"
    with pytest.raises(BlockTableError, match="no such block table"):
        load_block_table(path=str(tmp_path / "nope.yaml"))
    with pytest.raises(BlockTableError, match="num_sms"):
        parse_block_table({"entries": []}, "x.yaml")
    assert block_table_path("h200").is_file()


def test_a_cuda_device_finds_its_table_name(monkeypatch):
    # The CUDA-only branch of gpu_name (the block table's key): off CUDA it is never reached, so fake the name
    import torch

    from tp_overlap.gemm import triton_gemm
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    assert triton_gemm._cuda_gpu_name.__wrapped__(0) == "h200"
    assert load_block_table(triton_gemm._cuda_gpu_name.__wrapped__(0)) is not None


def test_the_scatter_reduce_gemm_runs_whole_one_box_128_row_tiles():
    """Its own rows wait for the other sources: no split tail; the row-block flags need 128-row tiles; the ops
    bench records what the op runs."""
    from tp_overlap.launch.measure import gemm_bench_ops
    from tp_overlap.ops.rs_scatter import reduce_gluon_blocks

    for gpu in ("h100", "h200"):
        for entry in load_block_table(gpu).entries:
            for programs in (132, 116):
                got = reduce_gluon_blocks(entry.m, entry.n, entry.k, b_transposed=entry.layout == "nk", gpu=gpu,
                                          programs=programs)
                assert got.gluon and got.block_m == 128 and not got.stream_k and not got.gluon_boxes, (entry, got)
                assert not got.problems(), (entry, got)
    assert gemm_bench_ops.reduce_gluon_blocks is reduce_gluon_blocks
