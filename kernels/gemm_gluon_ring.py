"""The operand ring of the Gluon GEMMs (kernels/gemm_gluon.py, gemm_gluon_boxes.py, gemm_gluon_scatter.py,
gemm_fp8_gluon.py) that links the producer warp to the consumer warpgroups: per slot, a ``ready`` mbarrier (one
arrival: the producer's expect, completed by its TMA loads' bytes) and an ``empty`` one (one arrival per
consumer warpgroup, once its MMAs have read the slot). Initialised before the partitions start (then fenced
with the kernel's other barriers), invalidated after they end."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

__all__ = ["init_ring", "invalidate_ring"]


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
