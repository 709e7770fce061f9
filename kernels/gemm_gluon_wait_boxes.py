"""The AllGather consumer's Gluon GEMM (chunk waits, kernels/gemm_gluon_wait.py) on 128-row tiles two or three B
boxes wide: widths that are not powers of two, as sums of descending powers of two (224 = 128 + 64 + 32,
144 = 128 + 16).

    gluon_wait_boxes_gemm_kernel[(num_programs,)](a_desc, b0_desc, b1_desc, b2_desc, c0_desc, c1_desc, c2_desc,
                                                  M, N, K, tile_row_offset, chunk_args, NUM_STAGES=...,
                                                  B_TRANSPOSED=..., num_warps=4)

Computes ``C[M, N] = A[M, K] @ B`` as kernels/gemm_gluon.py does (B row-major [K, N] or the rows of an
``nn.Linear`` weight [N, K]; fp32 accumulation; TMA zero-fills past M, N and K and clips the stores), the tile's
columns in B boxes ``b<i>`` and C boxes ``c<i>`` of the same widths (``b2_desc`` and ``c2_desc`` None: two).

Why: at M = 1024 a grid of 132 programs gets 112 tiles of 128x256 from N = 3584 (TP 8's llama8b fc1), one
round with 20 SMs idle; 128 tiles of 128x224 keep all but 4 busy for 12.5 % less work each.

Partitions (as kernels/gemm_gluon_boxes.py, plus the waiter warp of kernels/gemm_gluon.py): a producer warp
fills the ring (A and every B box of a K step per slot, one tx-counted ``ready`` barrier), each tile's loads once
the waiter warp handed it over (its rows' chunks acquired; nothing to wait for with ``chunk_args[1] == 0``); a
consumer warpgroup per 64 rows chains one async MMA per box into an accumulator each, keeps one K step of
MMAs in flight, releases each slot once the MMAs reading it retired, and stores its boxes of C through shared
memory by TMA while the next tile's K loop runs. Tiles are walked persistently in GROUP_M = 8 order, row
blocks rotated by ``tile_row_offset``. Whole tiles only (no split tail). Precondition (the launcher's): K >= 1.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .gemm_gluon import _barrier, _staging_free
from .gemm_gluon_ring import init_ring, invalidate_ring
from .gemm_gluon_wait import (_publish_chunk_rows, init_chunk_barriers, invalidate_chunk_barriers,
                              take_chunk_rows)
from .gemm_gluon_walk import tile_coordinates as _tile_coordinates

__all__ = ["gluon_wait_boxes_gemm_kernel"]

ROWS = gl.constexpr(128)  # two consumer warpgroups
WG_M = gl.constexpr(64)


@gluon.jit
def _load_partition(a_desc, b_descs, c_descs, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, chunk_args,
                    chunks_ok, chunks_free, B_TRANSPOSED: gl.constexpr):
    """The producer warp: TMA loads of A and every B box of each K step of this program's tiles into the ring,
    each tile's once the waiter warp handed it over (with chunk waits)."""
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BN0: gl.constexpr = c_descs[0].block_type.shape[1]
    BN1: gl.constexpr = c_descs[1].block_type.shape[1]
    BN2: gl.constexpr = c_descs[2].block_type.shape[1] if len(c_descs) == 3 else 0
    BLOCK_N: gl.constexpr = BN0 + BN1 + BN2
    B2_BYTES: gl.constexpr = b_descs[2].block_type.nbytes if len(b_descs) == 3 else 0
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_descs[0].block_type.nbytes + \
        b_descs[1].block_type.nbytes + B2_BYTES
    num_row_blocks = gl.cdiv(M, ROWS)
    num_col_blocks = gl.cdiv(N, BLOCK_N)
    num_k = gl.cdiv(K, BLOCK_K)
    waits = chunk_args[1] > 0
    step = 0
    index = 0
    for tile_id in range(gl.program_id(0), num_row_blocks * num_col_blocks, gl.num_programs(0)):
        row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        if waits:
            take_chunk_rows(index, chunks_ok, chunks_free)
        index += 1
        for k in range(num_k):
            slot = step % NUM_STAGES
            mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)  # fresh: parity 1 counts as done
            bar = ready.index(slot)
            mbarrier.expect(bar, STAGE_BYTES)
            tma.async_copy_global_to_shared(a_desc, [row_block * ROWS, k * BLOCK_K], bar, a_bufs.index(slot))
            col = col_block * BLOCK_N
            for i in gl.static_range(len(b_descs)):
                if B_TRANSPOSED:
                    tma.async_copy_global_to_shared(b_descs[i], [col, k * BLOCK_K], bar, b_bufs[i].index(slot))
                else:
                    tma.async_copy_global_to_shared(b_descs[i], [k * BLOCK_K, col], bar, b_bufs[i].index(slot))
                col += c_descs[i].block_type.shape[1]
            step += 1


@gluon.jit
def _zero(c_smem):
    """A fp32 accumulator of one consumer's 64 rows of the box `c_smem` stages ([CONSUMERS, 64, BN])."""
    BN: gl.constexpr = c_smem.type.shape[2]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    return gl.zeros([WG_M, BN], gl.float32, layout)


@gluon.jit
def _mma_step(a_rows, b_bufs, slot, accs, B_TRANSPOSED: gl.constexpr):
    """accs[i] += a_rows @ B box i of ring slot `slot`, one async MMA per box."""
    out = ()
    for i in gl.static_range(len(b_bufs)):
        if B_TRANSPOSED:
            b_tile = b_bufs[i].index(slot).permute((1, 0))
        else:
            b_tile = b_bufs[i].index(slot)
        out = out + (warpgroup_mma(a_rows, b_tile, accs[i], is_async=True), )
    return out


@gluon.jit
def _k_loop(a_bufs, b_bufs, ready, empty, accs, num_k, step, HALF: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """accs += this warpgroup's 64 rows of A @ the B boxes over the tile's K steps; one step of MMAs stays in
    flight, each slot is released once the MMAs reading it retired."""
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    for k in range(num_k):
        slot = (step + k) % NUM_STAGES
        mbarrier.wait(ready.index(slot), ((step + k) // NUM_STAGES) & 1)
        accs = _mma_step(a_bufs.index(slot).slice(HALF * WG_M, WG_M, dim=0), b_bufs, slot, accs, B_TRANSPOSED)
        accs = warpgroup_mma_wait(num_outstanding=len(b_bufs), deps=accs)
        if k > 0:
            _barrier()  # every warp of this warpgroup is past the MMA wait before the slot is released
            mbarrier.arrive(empty.index((step + k - 1) % NUM_STAGES))
    accs = warpgroup_mma_wait(num_outstanding=0, deps=accs)
    _barrier()
    mbarrier.arrive(empty.index((step + num_k - 1) % NUM_STAGES))
    return accs


@gluon.jit
def _mma_partition(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset, HALF: gl.constexpr,
                   B_TRANSPOSED: gl.constexpr):
    """One consumer warpgroup: rows [HALF * 64, HALF * 64 + 64) of every tile, one accumulator per box."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BN0: gl.constexpr = c_descs[0].block_type.shape[1]
    BN1: gl.constexpr = c_descs[1].block_type.shape[1]
    BN2: gl.constexpr = c_descs[2].block_type.shape[1] if len(c_descs) == 3 else 0
    BLOCK_N: gl.constexpr = BN0 + BN1 + BN2
    num_row_blocks = gl.cdiv(M, ROWS)
    num_col_blocks = gl.cdiv(N, BLOCK_N)
    num_k = gl.cdiv(K, BLOCK_K)
    step = 0
    for tile_id in range(gl.program_id(0), num_row_blocks * num_col_blocks, gl.num_programs(0)):
        row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        accs = ()
        for i in gl.static_range(len(c_smems)):
            accs = accs + (_zero(c_smems[i]), )
        accs = _k_loop(a_bufs, b_bufs, ready, empty, accs, num_k, step, HALF, B_TRANSPOSED)
        step += num_k
        _staging_free()  # this warpgroup's previous stores have read its staging boxes
        for i in gl.static_range(len(c_smems)):
            c_smems[i].index(HALF).store(accs[i].to(c_descs[i].dtype))
        fence_async_shared()
        _barrier()  # every warp's rows are in the staging boxes before the stores are issued
        col = col_block * BLOCK_N
        for i in gl.static_range(len(c_smems)):
            tma.async_copy_shared_to_global(c_descs[i], [row_block * ROWS + HALF * WG_M, col], c_smems[i].index(HALF))
            col += c_descs[i].block_type.shape[1]
    tma.store_wait(pendings=0)


@gluon.jit
def _waiter_partition(a_desc, c_descs, M, N, K, tile_row_offset, chunk_args, chunks_ok, chunks_free):
    """The waiter warp: the chunks of this program's tiles' rows, in the producer's order (kernels/gemm_gluon_wait.py
    `chunk_wait_partition` for whole tiles of these widths); nothing without chunk waits."""
    BN0: gl.constexpr = c_descs[0].block_type.shape[1]
    BN1: gl.constexpr = c_descs[1].block_type.shape[1]
    BN2: gl.constexpr = c_descs[2].block_type.shape[1] if len(c_descs) == 3 else 0
    num_row_blocks = gl.cdiv(M, ROWS)
    num_col_blocks = gl.cdiv(N, BN0 + BN1 + BN2)
    if chunk_args[1] > 0:
        ready = chunk_args[1] > 0
        known = chunk_args[1] * 0
        index = 0
        for tile_id in range(gl.program_id(0), num_row_blocks * num_col_blocks, gl.num_programs(0)):
            row_block, _ = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
            first_row = row_block * ROWS
            ready, known = _publish_chunk_rows(chunk_args, first_row, gl.minimum(first_row + ROWS, M) - 1, ready,
                                               known, index, chunks_ok, chunks_free)
            index += 1


# One function per (partition, B layout): partitions receive no compile-time arguments (kernels/gemm_gluon.py).
@gluon.jit
def _mma0_kn(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset, 0, False)


@gluon.jit
def _mma1_kn(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset, 1, False)


@gluon.jit
def _mma0_nk(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset, 0, True)


@gluon.jit
def _mma1_nk(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset, 1, True)


@gluon.jit
def _load_kn(a_desc, b_descs, c_descs, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, chunk_args, chunks_ok,
             chunks_free):
    _load_partition(a_desc, b_descs, c_descs, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, chunk_args,
                    chunks_ok, chunks_free, False)


@gluon.jit
def _load_nk(a_desc, b_descs, c_descs, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, chunk_args, chunks_ok,
             chunks_free):
    _load_partition(a_desc, b_descs, c_descs, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, chunk_args,
                    chunks_ok, chunks_free, True)


@gluon.jit(do_not_specialize=["M", "tile_row_offset"])
def gluon_wait_boxes_gemm_kernel(a_desc, b0_desc, b1_desc, b2_desc, c0_desc, c1_desc, c2_desc, M, N, K,
                                 tile_row_offset, chunk_args, NUM_STAGES: gl.constexpr, B_TRANSPOSED: gl.constexpr,
                                 LOAD_REGS: gl.constexpr = 40):
    gl.static_assert(a_desc.block_type.shape[0] == ROWS, "A in [128, BLOCK_K] boxes: two consumer warpgroups")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one warpgroup")
    gl.static_assert(NUM_STAGES >= 2, "a ring of at least two slots")
    if b2_desc is None:
        b_descs = (b0_desc, b1_desc)
        c_descs = (c0_desc, c1_desc)
    else:
        b_descs = (b0_desc, b1_desc, b2_desc)
        c_descs = (c0_desc, c1_desc, c2_desc)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, ROWS, a_desc.block_type.shape[1]], a_desc.layout)
    b_bufs = ()
    c_smems = ()
    for i in gl.static_range(len(b_descs)):
        gl.static_assert(c_descs[i].block_type.shape[0] == WG_M, "C is stored in 64-row boxes, one per consumer")
        b_bufs = b_bufs + (gl.allocate_shared_memory(b_descs[i].dtype, [NUM_STAGES] + b_descs[i].block_type.shape,
                                                     b_descs[i].layout), )
        c_smems = c_smems + (gl.allocate_shared_memory(c_descs[i].dtype, [2, WG_M, c_descs[i].block_type.shape[1]],
                                                       c_descs[i].layout), )
    ready, empty = init_ring(NUM_STAGES, 2)  # one `empty` arrival per consumer warpgroup
    chunks_ok, chunks_free = init_chunk_barriers()
    fence_async_shared()

    mma_args = (a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset)
    load_args = (a_desc, b_descs, c_descs, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, chunk_args,
                 chunks_ok, chunks_free)
    wait_args = (a_desc, c_descs, M, N, K, tile_row_offset, chunk_args, chunks_ok, chunks_free)
    # registers as kernels/gemm_gluon.py: two consumer warpgroups 232 a thread, the producer and waiter warps 40
    if B_TRANSPOSED:
        gl.warp_specialize([(_mma0_nk, mma_args), (_mma1_nk, mma_args), (_load_nk, load_args),
                            (_waiter_partition, wait_args)], [4, 1, 1], [232, LOAD_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([(_mma0_kn, mma_args), (_mma1_kn, mma_args), (_load_kn, load_args),
                            (_waiter_partition, wait_args)], [4, 1, 1], [232, LOAD_REGS, LOAD_REGS])
    invalidate_ring(ready, empty)
    invalidate_chunk_barriers(chunks_ok, chunks_free)
