"""The persistent walk of the Gluon GEMMs (kernels/gemm_gluon.py, gemm_gluon_scatter.py, gemm_gluon_boxes.py,
gemm_fp8_gluon.py): the order a program takes its tiles in, and the work items of a split tail."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# A module constant: partitions of warp_specialize take no compile-time arguments (kernels/gemm_gluon.py)
GROUP_M = gl.constexpr(8)

__all__ = ["GROUP_M", "tile_coordinates", "owner_last_coordinates", "work_item"]


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
