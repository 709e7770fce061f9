"""The persistent walk of the Gluon GEMMs (kernels/gemm_gluon.py, gemm_gluon_scatter.py, gemm_gluon_boxes.py,
gemm_fp8_gluon.py, gemm_gluon_stream.py): the order a program takes its tiles in, and the work items of a split
or a streamed tail."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# A module constant: partitions of warp_specialize take no compile-time arguments (kernels/gemm_gluon.py)
GROUP_M = gl.constexpr(8)

__all__ = ["GROUP_M", "tile_coordinates", "owner_last_coordinates", "work_item", "streamed_items", "streamed_item"]


@gluon.jit
def tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset):
    """(row block, column block) of the walk's `tile_id`-th tile: GROUP_M row blocks share each B column panel
    while it is hot in L2; row blocks rotated by `tile_row_offset` so that a caller starts at the rows it needs
    first (the AllGather consumer: its own rows, already there)."""
    tiles_per_group = GROUP_M * num_col_blocks
    first_row_block = (tile_id // tiles_per_group) * GROUP_M
    rows_in_group = gl.minimum(num_row_blocks - first_row_block, GROUP_M)
    index_in_group = tile_id % tiles_per_group
    row_block = (first_row_block + index_in_group % rows_in_group + tile_row_offset) % num_row_blocks
    return row_block, index_in_group // rows_in_group


@gluon.jit
def owner_last_coordinates(tile_id, num_row_blocks, num_col_blocks, own_first_row_block, own_row_blocks):
    """(row block, column block) of the `tile_id`-th tile of the walk that takes the other owners' row blocks first
    (from the next owner's on, wrapping) and this rank's `own_row_blocks` from `own_first_row_block` last, each
    segment GROUP_M-swizzled on its own, so that no tile of the own rows comes before another owner's
    (kernels/gemm_gluon_reduce.py: every tile it scatters is published before its first wait)."""
    other_row_blocks = num_row_blocks - own_row_blocks
    other_tiles = other_row_blocks * num_col_blocks
    if tile_id < other_tiles:
        row, col_block = tile_coordinates(tile_id, other_row_blocks, num_col_blocks, 0)
        row_block = (own_first_row_block + own_row_blocks + row) % num_row_blocks
    else:
        row, col_block = tile_coordinates(tile_id - other_tiles, own_row_blocks, num_col_blocks, 0)
        row_block = own_first_row_block + row
    return row_block, col_block


@gluon.jit
def work_item(item, num_whole_tiles, splits, num_k):
    """(tile, first K step, end K step, split unit or -1) of work item `item`: the first `num_whole_tiles` tiles
    of the walk are whole items, each later tile `splits` items of consecutive, balanced K ranges
    (kernels/gemm_gluon.py, "Split tail")."""
    unit = item - num_whole_tiles
    if unit < 0:
        tile = item
        first_k = unit * 0  # an int32 like the other branch's (a literal 0 would be a constexpr)
        end_k = num_k
    else:
        tile = num_whole_tiles + unit // splits
        split = unit % splits
        first_k = split * num_k // splits
        end_k = (split + 1) * num_k // splits
    return tile, first_k, end_k, unit


@gluon.jit
def streamed_items(num_whole_tiles, num_tiles, num_k):
    """(whole items, first step, end step, items) of this program in the streamed walk (kernels/gemm_gluon_stream.py):
    whole tiles p, p + programs, ... below `num_whole_tiles`, then the steps [first, end) of the later tiles' K
    steps laid end to end, cut evenly among all programs (every program at least one step: the launcher's)."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    whole = gl.cdiv(gl.maximum(num_whole_tiles - pid, 0), programs)
    total = (num_tiles - num_whole_tiles) * num_k
    first = pid * total // programs
    end = (pid + 1) * total // programs
    return whole, first, end, whole + gl.cdiv(end, num_k) - first // num_k


@gluon.jit
def _step_owner(step, total):
    """The program whose streamed range holds `step` (the largest p with p * total // programs <= step)."""
    return ((step + 1) * gl.num_programs(0) + total - 1) // total - 1


@gluon.jit
def streamed_item(i, whole, first, end, num_whole_tiles, num_tiles, num_k):
    """(tile, first K step, end K step, slot, pieces, first slot) of this program's `i`-th item of the streamed
    walk (`streamed_items`). A streamed tile t (counted from `num_whole_tiles`) is cut where the programs'
    ranges cut it: the piece of program p is in partials slot p + t (unique: both grow along the walk), the
    tile's `pieces` in slots first slot .. first slot + pieces - 1 in K order. Slot -1: a whole tile."""
    pid = gl.program_id(0)
    if i < whole:
        tile = pid + i * gl.num_programs(0)
        first_k = i * 0  # an int32 like the other branch's (a literal 0 would be a constexpr)
        end_k = num_k + i * 0
        slot = i * 0 - 1
        pieces = i * 0 + 1
        first_slot = slot
    else:
        total = (num_tiles - num_whole_tiles) * num_k
        # the program's pieces last to first: its head piece (K steps 0..) first, so that at any time every
        # program reads K steps at most 64 - L apart and their A and B boxes stay shared in L2 (first to last,
        # each program starts at another K offset: measured 1.7-2x slower on an H100)
        t = gl.cdiv(end, num_k) - 1 - (i - whole)
        tile = num_whole_tiles + t
        first_k = gl.maximum(first - t * num_k, 0)
        end_k = gl.minimum(end - t * num_k, num_k)
        first_owner = _step_owner(t * num_k, total)
        pieces = _step_owner((t + 1) * num_k - 1, total) - first_owner + 1
        slot = gl.where(pieces > 1, pid + t, -1)
        first_slot = first_owner + t
    return tile, first_k, end_k, slot, pieces, first_slot
