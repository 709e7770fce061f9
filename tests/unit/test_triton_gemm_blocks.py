"""The block heuristic of the GEMM launcher (a pure function of the shape and the program count)."""

from overlap.triton_gemm import GemmBlocks, choose_blocks


def test_wide_tiles_unless_narrow_ones_fill_the_last_wave_clearly_better():
    # M = 1024, N = 5120 on 132 programs: 160 wide tiles (1.21 waves, 61 % busy) vs 320 narrow (81 %)
    assert choose_blocks(1024, 5120, 8192).block_n == 128
    # N = 4096: 128 wide tiles fit one wave (97 %), as do 256 narrow ones: a tie goes to the wider tile
    assert choose_blocks(1024, 4096, 2048).block_n == 256
    assert choose_blocks(16384, 14336, 4096) == GemmBlocks(128, 256, 64, 8, 8, 3, True)


def test_the_program_count_changes_the_choice_and_flag_waiting_callers_get_no_warp_specialisation():
    # the same 160 wide tiles are exactly 2 waves of 80 programs (a fused op with a large sm_margin)
    assert choose_blocks(1024, 5120, 8192, sm_count=80).block_n == 256
    assert not choose_blocks(4096, 4096, 4096, warp_specialize=False).warp_specialize
    assert choose_blocks(4096, 4096, 4096, device_type="cpu").block_m == 16
