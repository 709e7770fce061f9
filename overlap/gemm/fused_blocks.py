"""Blocks of the fused ops' Gluon GEMMs (the AllGather consumer, the scatter and scatter-reduce GEMMs of
GemmRs): the table's entry of the layout and GPU where it is a Gluon configuration those kernels run, checked
against the grid the op really has (an sm_margin leaves fewer programs than the table measured)."""

from __future__ import annotations

import dataclasses

from .blocks import WAVE_MARGIN, BlockTable, GemmBlocks, cdiv, gluon_heuristic_blocks, load_block_table, wave_efficiency
from .gluon_launch import modelled_seconds

__all__ = ["fused_gluon_blocks", "BOX_SCATTER_BLOCKS", "BOX_MARGIN"]

# The scatter GEMM's two-box widths (kernels/gemm_gluon_scatter_boxes.py), taken on a grid the table did not
# measure where the cost model has them finish BOX_MARGIN sooner than the one-box choice (H100, 116 programs,
# M = 1024, N = 4096: modelled 23-25 % sooner at K = 1792, measured 6-12 % faster; 13 % at K = 3584, measured
# 3 % faster with B [N, K] and 4-8 % slower with B [K, N], whose 16-column box is a 32-byte TMA row)
BOX_SCATTER_BLOCKS = ("128x144x64w4s5gl", "128x160x64w4s5gl", "128x192x64w4s4gl")
BOX_MARGIN = 0.15


def fused_gluon_blocks(m: int, n: int, k: int, *, b_transposed: bool, gpu: str | None, sm_count: int,
                       block_m: int | None = None, table: BlockTable | None = None,
                       split_tail: bool = False, boxes: bool = False) -> GemmBlocks:
    """Blocks of the fused ops' Gluon GEMMs on a GPU (the AllGather consumer, whose waiter warp polls the
    chunks; the scatter epilogue, `block_m` 128: one row-block flag per tile). The table's entry where it
    names a one-box Gluon configuration (of `block_m` rows if given), unless `sm_count` is below the SMs the
    table measured and the heuristic's tiles fill the last wave of those programs clearly better; else
    `gluon_heuristic_blocks`. The entry's split tail (`sk1`) is dropped unless `split_tail` (a caller with a
    workspace of its own: gluon_launch.split_buffers), which also adds one where the table did not measure this
    grid (fewer programs, e.g. an sm_margin, or no entry): split_plan decides per launch whether it pays.
    `boxes` (a kernel that also runs tiles two B boxes wide, the scatter GEMM's): the table's two-box entries
    too, and on a grid the table did not measure, a width of `BOX_SCATTER_BLOCKS` where the cost model
    (gluon_launch.modelled_seconds) has it finish at least BOX_MARGIN sooner (whole waves of 128x144 tiles
    on 116 programs where 128x128 tiles take a third round)."""
    table = table if table is not None else load_block_table(gpu) if gpu else None
    entry = table.lookup(m, n, k, "nk" if b_transposed else "kn") if table is not None else None
    if entry is None or not entry.blocks.gluon or (entry.blocks.gluon_boxes and not boxes) or \
            block_m not in (None, entry.blocks.block_m):
        chosen = gluon_heuristic_blocks(m, n, sm_count=sm_count, split_tail=split_tail)
    elif sm_count >= table.num_sms:  # as the table measured it
        return entry.blocks if split_tail else dataclasses.replace(entry.blocks, stream_k=0)
    else:  # the table measured every SM; on fewer programs (an sm_margin) its last wave may leave many idle
        chosen, other = entry.blocks, gluon_heuristic_blocks(m, n, sm_count=sm_count)
        fill = wave_efficiency(cdiv(m, chosen.block_m) * cdiv(n, chosen.block_n), sm_count)
        if wave_efficiency(cdiv(m, 128) * cdiv(n, other.block_n), sm_count) > fill + WAVE_MARGIN:
            chosen = other
    chosen = dataclasses.replace(chosen, stream_k=1 if split_tail and not chosen.gluon_boxes else 0)
    return _box_width(chosen, m, n, k, sm_count) if boxes else chosen


def _box_width(chosen: GemmBlocks, m: int, n: int, k: int, programs: int) -> GemmBlocks:
    """`chosen`, or the two-box width of `BOX_SCATTER_BLOCKS` the cost model has finish soonest, where that is at
    least BOX_MARGIN sooner than `chosen` (`fused_gluon_blocks`)."""
    best, best_s = chosen, (1 - BOX_MARGIN) * modelled_seconds(chosen, m, n, k, programs)
    for name in BOX_SCATTER_BLOCKS:
        blocks = GemmBlocks.parse(name)
        seconds = modelled_seconds(blocks, m, n, k, programs)
        if seconds <= best_s:
            best, best_s = blocks, seconds
    return best
