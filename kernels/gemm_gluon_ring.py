"""The operand ring of the Gluon GEMMs (kernels/gemm_gluon.py, gemm_gluon_boxes.py, gemm_gluon_scatter.py,
gemm_fp8_gluon.py) that links the producer warp to the consumer warpgroups: per slot, a ``ready`` mbarrier (one
arrival: the producer's expect, completed by its TMA loads' bytes) and an ``empty`` one (one arrival per
consumer warpgroup, once its MMAs have read the slot); and the producer's loads of one K step into a slot.
Initialised before the partitions start (then fenced with the kernel's other barriers), invalidated after
they end."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

__all__ = ["init_ring", "invalidate_ring", "load_stage"]


@gluon.jit
def init_ring(NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """(ready, empty): NUM_STAGES mbarriers each, `empty` counting CONSUMERS arrivals a phase."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, empty


@gluon.jit
def invalidate_ring(ready, empty):
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, empty, step, row_block, k, col_block, LOAD_A: gl.constexpr,
               LOAD_B: gl.constexpr, STAGE_BYTES: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """K step `k` of a tile into ring slot `step`: its A boxes, its B box or both. The B box claims the slot
    (waits for its release, expects the whole stage's bytes), so a stage split in two loads B first."""
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    A_BOX: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0] if B_TRANSPOSED else b_desc.block_type.shape[1]
    A_BOXES: gl.constexpr = a_bufs.type.shape[0] // NUM_STAGES
    slot = step % NUM_STAGES
    bar = ready.index(slot)
    if LOAD_B:
        # a fresh barrier counts as released: its "previous" phase (parity 1) is complete
        mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(bar, STAGE_BYTES)
    if LOAD_A:
        for box in gl.static_range(A_BOXES):
            tma.async_copy_global_to_shared(a_desc, [row_block * A_BOX * A_BOXES + box * A_BOX, k * BLOCK_K], bar,
                                            a_bufs.index(slot * A_BOXES + box))
    if LOAD_B:
        if B_TRANSPOSED:
            tma.async_copy_global_to_shared(b_desc, [col_block * BLOCK_N, k * BLOCK_K], bar, b_bufs.index(slot))
        else:
            tma.async_copy_global_to_shared(b_desc, [k * BLOCK_K, col_block * BLOCK_N], bar, b_bufs.index(slot))
