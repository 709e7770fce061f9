"""The FP8 Gluon GEMM's scaler warp (kernels/gemm_fp8_gluon.py): once a ring slot's loads have landed, each tile
row's scale of the slot's K group, a_scale * b_scale, per 128-column sub-tile, into a small shared array the
consumer warpgroups read with a plain shared load.

Where the scales are combined is what the promotion costs. A global load in the K loop stalls it (ptxas
multiplies the two scales right after the load, before the MMA wait, and an L2 round trip outlasts the MMA),
so the scales come through the ring. Picked and multiplied in the consumers' K loop, ptxas placed that
arithmetic between a group's four wgmma instructions, whose issue then waited on the shared loads: a build
reading only the A scales ran 5-6 % faster on an H100, and the scaler warp recovered 1-3 % of it. The rest is
not explained: a scaler computing nothing ran 2-4 % faster still, and starting the scaler before the operands
land (the scale loads on a barrier of their own) did not help (the scaler probes in results/logs/one_gpu_184dd85).
With 128x128 tiles the kernel ran near the L2's throughput (ncu: 82 %) and felt shared-memory traffic:
consumers reading their scales twice ran 1.3-2 % slower, yet storing them in the consumers' pair order (one
8-byte read instead of two) ran 1-4 % slower.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from . import constants
from .gemm_gluon_walk import work_item as _work_item

__all__ = ["B_SCALE_BOX", "scale_partition"]

SCALE_GROUP = gl.constexpr(constants.SCALE_GROUP)
B_SCALE_BOX = gl.constexpr(4)  # B scales per TMA load: 16 bytes, TMA's smallest box (the launcher's descriptor)
# the CTA / partition barrier: gl.thread_barrier in Triton 3.6, renamed gl.barrier in 3.7
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _row_scales(a_scale_bufs, slot, k):
    """The group's A scale of each of the tile's rows, from ring slot `slot` (rows past M read 0: their products
    are never stored): 4 rows a lane of the scaler warp."""
    rows_layout: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])  # 128 rows
    if len(a_scale_bufs.type.shape) == 2:  # group-major: a row of the tile's scales per slot
        a_scale = a_scale_bufs.index(slot).load(rows_layout)
    else:  # row-major: [rows, B_SCALE_BOX] per slot; the group's column
        boxes_layout: gl.constexpr = gl.BlockedLayout([1, B_SCALE_BOX], [32, 1], [1, 1], [1, 0])
        boxes = a_scale_bufs.index(slot).load(boxes_layout)
        column = gl.arange(0, B_SCALE_BOX, layout=gl.SliceLayout(0, boxes_layout)) == k % B_SCALE_BOX
        a_scale = gl.convert_layout(gl.sum(gl.where(gl.expand_dims(column, 0), boxes, 0.0), axis=1), rows_layout)
    return a_scale


@gluon.jit
def _b_scale(b_scale_bufs, slot, k, SUB: gl.constexpr):
    """The group's B scale of the tile's `SUB`-th 128 columns, from ring slot `slot` (its box of B_SCALE_BOX)."""
    box_layout: gl.constexpr = gl.BlockedLayout([B_SCALE_BOX], [32], [1], [0])
    b_box = b_scale_bufs.index(slot).slice(SUB * B_SCALE_BOX, B_SCALE_BOX).load(box_layout)
    in_box = gl.arange(0, B_SCALE_BOX, layout=box_layout) == k % B_SCALE_BOX
    return gl.sum(gl.where(in_box, b_box, 0.0), axis=0)


@gluon.jit
def scale_partition(b_bufs, a_scale_bufs, b_scale_bufs, scale_bufs, ready, scaled, M, N, K, num_whole_tiles,
                    splits):
    """The scaler warp: once a ring slot's loads have landed, the group's scale of each tile row (a_scale *
    b_scale) into `scale_bufs` (one fp32 per row, slot and 128-column sub-tile: row `slot * SUBS + sub`), then
    `scaled` (one arrival). A slot's products are rewritten only after its next loads landed, which needed both
    consumers to release it, after their reads."""
    BLOCK_M: gl.constexpr = scale_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    SUBS: gl.constexpr = 2 if BLOCK_N == 2 * SCALE_GROUP else 1  # sub-tiles
    NUM_STAGES: gl.constexpr = scale_bufs.type.shape[0] // SUBS
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    num_k = gl.cdiv(K, SCALE_GROUP)
    step = 0
    for item in range(gl.program_id(0), num_whole_tiles + (num_tiles - num_whole_tiles) * splits, gl.num_programs(0)):
        _, first_k, end_k, _ = _work_item(item, num_whole_tiles, splits, num_k)
        for k in range(first_k, end_k):
            slot = step % NUM_STAGES
            mbarrier.wait(ready.index(slot), (step // NUM_STAGES) & 1)
            a_scale = _row_scales(a_scale_bufs, slot, k)
            scale_bufs.index(slot * SUBS).store(a_scale * _b_scale(b_scale_bufs, slot, k, 0))
            if SUBS == 2:
                scale_bufs.index(slot * SUBS + 1).store(a_scale * _b_scale(b_scale_bufs, slot, k, 1))
            _barrier()  # every lane's products are stored before the single-thread arrival
            mbarrier.arrive(scaled.index(slot))
            step += 1
