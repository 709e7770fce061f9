"""Blocks of the fused ops' Gluon GEMMs (the AllGather consumer, the scatter and scatter-reduce GEMMs of
GemmRs): the table's entry of the layout and GPU where it is a Gluon configuration those kernels run, checked
against the grid the op really has (an sm_margin leaves fewer programs than the table measured)."""

from __future__ import annotations

import dataclasses

from .blocks import WAVE_MARGIN, BlockTable, GemmBlocks, cdiv, gluon_heuristic_blocks, load_block_table, wave_efficiency
from .gluon_launch import modelled_seconds

__all__ = ["fused_gluon_blocks", "TWO_BOX_BLOCKS", "THREE_BOX_BLOCKS", "BOX_MARGIN"]

# Tiles of widths that are not powers of two the fused GEMMs may take where the cost model has whole rounds of
# them finish BOX_MARGIN sooner: two B boxes (the scatter GEMM, kernels/gemm_gluon_scatter_boxes.py, and the
# AllGather consumer) on a grid the table did not measure (the tuner's sweep has these widths), three (the
# AllGather consumer, kernels/gemm_gluon_wait_boxes.py; not in the sweep) on any grid
TWO_BOX_BLOCKS = ("128x144x64w4s5gl", "128x160x64w4s5gl", "128x192x64w4s4gl")
THREE_BOX_BLOCKS = ("128x224x64w4s3gl",)
BOX_MARGIN = 0.10


def fused_gluon_blocks(m: int, n: int, k: int, *, b_transposed: bool, gpu: str | None, sm_count: int,
                       block_m: int | None = None, table: BlockTable | None = None,
                       split_tail: bool = False, boxes: int = 1) -> GemmBlocks:
    """Blocks of the fused ops' Gluon GEMMs on a GPU (the AllGather consumer, whose waiter warp polls the
    chunks; the scatter epilogue, `block_m` 128: one row-block flag per tile). The table's entry where it
    names a Gluon configuration the caller's kernel runs (of `block_m` rows if given; B in at most `boxes`
    boxes, 128-row tiles), unless `sm_count` is below the SMs the table measured and the heuristic's tiles fill
    the last wave of those programs clearly better; else `gluon_heuristic_blocks`. The entry's split tail
    (`sk1`) is dropped unless `split_tail` (a caller with a workspace of its own: gluon_launch.split_buffers),
    which also adds one where the table did not measure this grid (fewer programs, e.g. an sm_margin, or no
    entry): split_plan decides per launch whether it pays. Then, for a caller whose kernel runs B in two
    (`boxes` 2) or three boxes, a width of TWO_BOX_BLOCKS / THREE_BOX_BLOCKS where the cost model
    (gluon_launch.modelled_seconds) has it finish at least BOX_MARGIN sooner: 128x144 tiles fill two whole
    waves of 116 programs where 128x128 take a third (M = 1024, N = 4096), 128x224 one wave of 132 where 128x256
    leave 20 SMs idle (N = 3584)."""
    table = table if table is not None else load_block_table(gpu) if gpu else None
    entry = table.lookup(m, n, k, "nk" if b_transposed else "kn") if table is not None else None
    runs = entry is not None and entry.blocks.gluon and block_m in (None, entry.blocks.block_m) and \
        (not entry.blocks.gluon_boxes or (entry.blocks.block_m == 128 and len(entry.blocks.gluon_boxes) <= boxes))
    measured = runs and sm_count >= table.num_sms
    if not runs:
        chosen = gluon_heuristic_blocks(m, n, sm_count=sm_count, split_tail=split_tail)
    elif measured:
        chosen = entry.blocks
    else:  # the table measured every SM; on fewer programs (an sm_margin) its last wave may leave many idle
        chosen, other = entry.blocks, gluon_heuristic_blocks(m, n, sm_count=sm_count)
        fill = wave_efficiency(cdiv(m, chosen.block_m) * cdiv(n, chosen.block_n), sm_count)
        if wave_efficiency(cdiv(m, 128) * cdiv(n, other.block_n), sm_count) > fill + WAVE_MARGIN:
            chosen = other
    if not (measured and split_tail):  # a split tail: the table's own where it measured this grid
        chosen = dataclasses.replace(chosen, stream_k=1 if split_tail and not chosen.gluon_boxes else 0)
    candidates = (TWO_BOX_BLOCKS if boxes >= 2 and not measured else ()) + (THREE_BOX_BLOCKS if boxes >= 3 else ())
    return _box_width(chosen, m, n, k, sm_count, candidates)


def _box_width(chosen: GemmBlocks, m: int, n: int, k: int, programs: int, candidates: tuple) -> GemmBlocks:
    """`chosen`, or the blocks of `candidates` the cost model has finish soonest, where that is at least
    BOX_MARGIN sooner than `chosen` (`fused_gluon_blocks`)."""
    if not candidates:
        return chosen
    best, best_s = chosen, (1 - BOX_MARGIN) * modelled_seconds(chosen, m, n, k, programs)
    for name in candidates:
        blocks = GemmBlocks.parse(name)
        seconds = modelled_seconds(blocks, m, n, k, programs)
        if seconds <= best_s:
            best, best_s = blocks, seconds
    return best
