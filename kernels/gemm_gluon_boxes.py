"""Persistent bf16/fp16 GEMM in Gluon for 64-row tiles and widths that are not powers of two: B in two or three
boxes.

Computes ``C[M, N] = A[M, K] @ B[K, N]`` as kernels/gemm_gluon.py does (B row-major [K, N], or the rows of an
``nn.Linear`` weight [N, K] read as their transpose; fp32 accumulation; TMA zero-fills past M, N and K and clips
the store), for the tiles that kernel cannot run: BLOCK_M 64 (one consumer warpgroup) and tile widths that
are not powers of two. Gluon shapes are powers of two, so a [BLOCK_M, BN0 + BN1 (+ BN2)] tile comes as two or
three B boxes ([BN, BLOCK_K], or [BLOCK_K, BN]) with an accumulator and a C box each: 96 = 64 + 32, 160 = 128
+ 32, 192 = 128 + 64, 224 = 128 + 64 + 32. A two-box launch passes its second box again as the third: the
kernel reads a third box only where it is narrower than the second (three boxes are distinct powers of two).

    gluon_boxes_gemm_kernel[(num_programs,)](a_desc, b0_desc, b1_desc, b2_desc, c0_desc, c1_desc, c2_desc,
                                             M, N, K, tile_row_offset, chunk_args, NUM_STAGES=...,
                                             B_TRANSPOSED=..., num_warps=4)

Why: at the narrow shapes (M 1024-2048, N 768-1536) power-of-two tiles either leave SMs idle (48-96 tiles of
128x128) or are too small to run at the tensor cores' rate; widths like 96, 160 or 192 (cuBLAS's choice there)
give about one full wave; at M 1024, N 3584, 112 tiles of 128x256 leave 20 of 132 SMs idle where 128 tiles of
128x224 leave 4. Every MMA of a K step reads the warpgroup's A rows from shared memory (loading them into
registers once for all measured 30-40 % slower).

Partitions as kernels/gemm_gluon.py: a producer warp fills a ring of NUM_STAGES slots (``ready`` mbarrier per
slot, tx-counted) and refills a slot once every consumer released it (``empty``); a consumer warpgroup per
64 rows keeps one K step of MMAs in flight, releases each slot once the MMAs reading it retired, and stores
its C boxes through shared memory with TMA stores that complete while the next tile's K loop runs; a waiter
warp polls the AllGather consumer's chunk flags (``chunk_args``, kernels/gemm_gluon_wait.py: each tile's A rows
are loaded once their chunks arrived; on the program's first tile the first stages' B boxes are in flight
meanwhile), idle with ``chunk_args[1] == 0``. Tiles are walked persistently in GROUP_M = 8 order, row blocks
rotated by ``tile_row_offset``. No split tail. Precondition (the launcher's): K >= 1.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from tp_overlap.kernels.gemm_gluon import _barrier, _staging_free
from tp_overlap.kernels.gemm_gluon_ring import init_ring, invalidate_ring
from tp_overlap.kernels.gemm_gluon_wait import (boxes_chunk_wait_partition, init_chunk_barriers,
                                                invalidate_chunk_barriers, take_chunk_rows)
from tp_overlap.kernels.gemm_gluon_walk import tile_coordinates as _tile_coordinates

# Fixed for the reason kernels/gemm_gluon.py gives: partitions take no compile-time arguments, so the shapes come
# from the buffers' types and the B layout and the warpgroup from which partition function runs.
WG_M = gl.constexpr(64)


@gluon.jit
def _load_b_box(b_desc, first_col, first_k, bar, dest, B_TRANSPOSED: gl.constexpr):
    if B_TRANSPOSED:
        tma.async_copy_global_to_shared(b_desc, [first_col, first_k], bar, dest)
    else:
        tma.async_copy_global_to_shared(b_desc, [first_k, first_col], bar, dest)


@gluon.jit
def _load_stage(a_desc, b_descs, a_bufs, b_bufs, ready, empty, step, row_block, k, first_col, LOAD_A: gl.constexpr,
                LOAD_B: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """K step `k` of the tile at (row_block, first_col) into ring slot `step`: its A box, its B boxes or both. The
    B boxes claim the slot (wait for its release, expect the whole stage's bytes), so a stage split in two
    loads B first."""
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BN0: gl.constexpr = b_descs[0].block_type.shape[0] if B_TRANSPOSED else b_descs[0].block_type.shape[1]
    BN1: gl.constexpr = b_descs[1].block_type.shape[0] if B_TRANSPOSED else b_descs[1].block_type.shape[1]
    BN2: gl.constexpr = b_descs[2].block_type.shape[0] if B_TRANSPOSED else b_descs[2].block_type.shape[1]
    THREE: gl.constexpr = BN2 < BN1
    STAGE_BYTES: gl.constexpr = (a_desc.block_type.nbytes + b_descs[0].block_type.nbytes + b_descs[1].block_type.nbytes
                                 + (b_descs[2].block_type.nbytes if THREE else 0))
    slot = step % NUM_STAGES
    bar = ready.index(slot)
    if LOAD_B:
        mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)  # fresh: parity 1 counts as done
        mbarrier.expect(bar, STAGE_BYTES)
    if LOAD_A:
        tma.async_copy_global_to_shared(a_desc, [row_block * BLOCK_M, k * BLOCK_K], bar, a_bufs.index(slot))
    if LOAD_B:
        _load_b_box(b_descs[0], first_col, k * BLOCK_K, bar, b_bufs[0].index(slot), B_TRANSPOSED)
        _load_b_box(b_descs[1], first_col + BN0, k * BLOCK_K, bar, b_bufs[1].index(slot), B_TRANSPOSED)
        if THREE:
            _load_b_box(b_descs[2], first_col + BN0 + BN1, k * BLOCK_K, bar, b_bufs[2].index(slot), B_TRANSPOSED)


@gluon.jit
def _load_partition(a_desc, b_descs, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, chunk_args, chunks_ok,
                    chunks_free, B_TRANSPOSED: gl.constexpr, WAITS: gl.constexpr):
    """The producer warp: TMA loads of every K step of this program's tiles into the ring; WAITS (a kernel with a
    waiter warp), with chunk waits each tile's A rows only once the waiter handed the tile over."""
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BN0: gl.constexpr = b_descs[0].block_type.shape[0] if B_TRANSPOSED else b_descs[0].block_type.shape[1]
    BN1: gl.constexpr = b_descs[1].block_type.shape[0] if B_TRANSPOSED else b_descs[1].block_type.shape[1]
    BN2: gl.constexpr = b_descs[2].block_type.shape[0] if B_TRANSPOSED else b_descs[2].block_type.shape[1]
    BLOCK_N: gl.constexpr = BN0 + BN1 + (BN2 if BN2 < BN1 else 0)
    num_row_blocks = gl.cdiv(M, BLOCK_M)
    num_col_blocks = gl.cdiv(N, BLOCK_N)
    num_k = gl.cdiv(K, BLOCK_K)
    step = 0
    index = 0
    for tile_id in range(gl.program_id(0), num_row_blocks * num_col_blocks, gl.num_programs(0)):
        row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        first_col = col_block * BLOCK_N
        start_k = 0
        if WAITS:
            if chunk_args[1] > 0:  # as kernels/gemm_gluon.py: the first tile's first B boxes before the hand-over
                ahead = gl.minimum(num_k, NUM_STAGES * (index == 0))
                for j in range(ahead):
                    _load_stage(a_desc, b_descs, a_bufs, b_bufs, ready, empty, step + j, row_block, j, first_col,
                                False, True, B_TRANSPOSED)
                take_chunk_rows(index, chunks_ok, chunks_free)
                for j in range(ahead):
                    _load_stage(a_desc, b_descs, a_bufs, b_bufs, ready, empty, step + j, row_block, j, first_col,
                                True, False, B_TRANSPOSED)
                start_k = ahead
                step += ahead
            index += 1
        for k in range(start_k, num_k):
            _load_stage(a_desc, b_descs, a_bufs, b_bufs, ready, empty, step, row_block, k, first_col, True, True,
                        B_TRANSPOSED)
            step += 1


@gluon.jit
def _b_operand(bufs, slot, B_TRANSPOSED: gl.constexpr):
    if B_TRANSPOSED:
        return bufs.index(slot).permute((1, 0))
    else:
        return bufs.index(slot)


@gluon.jit
def _k_loop_boxes(a_bufs, b_bufs, ready, empty, acc0, acc1, acc2, num_k, step, HALF: gl.constexpr,
                  B_TRANSPOSED: gl.constexpr):
    """(acc0, acc1, acc2) += this warpgroup's 64 rows of A @ (B boxes 0, 1, 2) over the tile's K steps (box 2
    and acc2 only where acc2 is narrower than acc1: else acc2 is returned as given); one step of MMAs stays
    in flight, each slot is released once the MMAs reading it retired."""
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    THREE: gl.constexpr = acc2.type.shape[1] < acc1.type.shape[1]
    for k in range(num_k):
        slot = (step + k) % NUM_STAGES
        mbarrier.wait(ready.index(slot), ((step + k) // NUM_STAGES) & 1)
        a_rows = a_bufs.index(slot).slice(HALF * WG_M, WG_M, dim=0)
        acc0 = warpgroup_mma(a_rows, _b_operand(b_bufs[0], slot, B_TRANSPOSED), acc0, is_async=True)
        acc1 = warpgroup_mma(a_rows, _b_operand(b_bufs[1], slot, B_TRANSPOSED), acc1, is_async=True)
        if THREE:
            acc2 = warpgroup_mma(a_rows, _b_operand(b_bufs[2], slot, B_TRANSPOSED), acc2, is_async=True)
            acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=3, deps=(acc0, acc1, acc2))
        else:
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
        if k > 0:
            _barrier()  # every warp of this warpgroup is past the MMA wait before the slot is released
            mbarrier.arrive(empty.index((step + k - 1) % NUM_STAGES))
    if THREE:
        acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2))
    else:
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    _barrier()
    mbarrier.arrive(empty.index((step + num_k - 1) % NUM_STAGES))
    return acc0, acc1, acc2


@gluon.jit
def _k_loop(a_bufs, b0_bufs, b1_bufs, ready, empty, acc0, acc1, num_k, step, HALF: gl.constexpr,
            B_TRANSPOSED: gl.constexpr):
    """The two-box K loop (kernels/gemm_gluon_scatter_boxes.py's)."""
    acc0, acc1, _ = _k_loop_boxes(a_bufs, (b0_bufs, b1_bufs, b1_bufs), ready, empty, acc0, acc1, acc1, num_k, step,
                                  HALF, B_TRANSPOSED)
    return acc0, acc1


@gluon.jit
def _mma_partition(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset, HALF: gl.constexpr,
                   B_TRANSPOSED: gl.constexpr):
    """One consumer warpgroup: rows [HALF * 64, HALF * 64 + 64) of every tile."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BN0: gl.constexpr = c_descs[0].block_type.shape[1]
    BN1: gl.constexpr = c_descs[1].block_type.shape[1]
    BN2: gl.constexpr = c_descs[2].block_type.shape[1]
    THREE: gl.constexpr = BN2 < BN1
    layout0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN0, 16])
    layout1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN1, 16])
    layout2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN2, 16])
    BLOCK_N: gl.constexpr = BN0 + BN1 + (BN2 if THREE else 0)
    num_row_blocks = gl.cdiv(M, BLOCK_M)
    num_col_blocks = gl.cdiv(N, BLOCK_N)
    num_k = gl.cdiv(K, BLOCK_K)
    out0 = c_smems[0].index(HALF)
    out1 = c_smems[1].index(HALF)
    out2 = c_smems[2].index(HALF)
    step = 0
    for tile_id in range(gl.program_id(0), num_row_blocks * num_col_blocks, gl.num_programs(0)):
        row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        acc0 = gl.zeros([WG_M, BN0], gl.float32, layout0)
        acc1 = gl.zeros([WG_M, BN1], gl.float32, layout1)
        if THREE:
            acc2 = gl.zeros([WG_M, BN2], gl.float32, layout2)
        else:
            acc2 = acc1
        acc0, acc1, acc2 = _k_loop_boxes(a_bufs, b_bufs, ready, empty, acc0, acc1, acc2, num_k, step, HALF,
                                         B_TRANSPOSED)
        step += num_k
        _staging_free()
        out0.store(acc0.to(c_descs[0].dtype))
        out1.store(acc1.to(c_descs[1].dtype))
        if THREE:
            out2.store(acc2.to(c_descs[2].dtype))
        fence_async_shared()
        _barrier()  # every warp's rows are in the staging tiles before the stores are issued
        first_row = row_block * BLOCK_M + HALF * WG_M
        tma.async_copy_shared_to_global(c_descs[0], [first_row, col_block * BLOCK_N], out0)
        tma.async_copy_shared_to_global(c_descs[1], [first_row, col_block * BLOCK_N + BN0], out1)
        if THREE:
            tma.async_copy_shared_to_global(c_descs[2], [first_row, col_block * BLOCK_N + BN0 + BN1], out2)
    tma.store_wait(pendings=0)


# One function per (partition, B layout): partitions receive no compile-time arguments.
@gluon.jit
def _mma0_nk(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset, 0, True)


@gluon.jit
def _mma1_nk(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset, 1, True)


@gluon.jit
def _mma0_kn(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset, 0, False)


@gluon.jit
def _mma1_kn(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_descs, c_smems, M, N, K, tile_row_offset, 1, False)


@gluon.jit
def _load_waits_nk(a_desc, b_descs, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, chunk_args, chunks_ok,
                   chunks_free):
    _load_partition(a_desc, b_descs, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, chunk_args, chunks_ok,
                    chunks_free, True, True)


@gluon.jit
def _load_waits_kn(a_desc, b_descs, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, chunk_args, chunks_ok,
                   chunks_free):
    _load_partition(a_desc, b_descs, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, chunk_args, chunks_ok,
                    chunks_free, False, True)


# The two-box producer without chunk waits (kernels/gemm_gluon_scatter_boxes.py's).
@gluon.jit
def _load_nk(a_desc, b0_desc, b1_desc, a_bufs, b0_bufs, b1_bufs, ready, empty, M, N, K, tile_row_offset):
    _load_partition(a_desc, (b0_desc, b1_desc, b1_desc), a_bufs, (b0_bufs, b1_bufs, b1_bufs), ready, empty, M, N, K,
                    tile_row_offset, None, None, None, True, False)


@gluon.jit
def _load_kn(a_desc, b0_desc, b1_desc, a_bufs, b0_bufs, b1_bufs, ready, empty, M, N, K, tile_row_offset):
    _load_partition(a_desc, (b0_desc, b1_desc, b1_desc), a_bufs, (b0_bufs, b1_bufs, b1_bufs), ready, empty, M, N, K,
                    tile_row_offset, None, None, None, False, False)


@gluon.jit
def _allocate_box(desc, NUM_STAGES: gl.constexpr):
    return gl.allocate_shared_memory(desc.dtype, [NUM_STAGES, desc.block_type.shape[0], desc.block_type.shape[1]],
                                     desc.layout)


@gluon.jit(do_not_specialize=["M", "tile_row_offset"])
def gluon_boxes_gemm_kernel(a_desc, b0_desc, b1_desc, b2_desc, c0_desc, c1_desc, c2_desc, M, N, K, tile_row_offset,
                            chunk_args, NUM_STAGES: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    CONSUMERS: gl.constexpr = BLOCK_M // 64
    THREE: gl.constexpr = c2_desc.block_type.shape[1] < c1_desc.block_type.shape[1]
    gl.static_assert((BLOCK_M == 64) or (BLOCK_M == 128), "one consumer warpgroup per 64 rows: BLOCK_M 64 or 128")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one warpgroup")
    gl.static_assert((c0_desc.block_type.shape[0] == 64) and (c1_desc.block_type.shape[0] == 64) and
                     (c2_desc.block_type.shape[0] == 64), "C is stored in 64-row boxes, one per consumer")
    gl.static_assert(NUM_STAGES >= 2, "a ring of at least two slots")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, a_desc.block_type.shape[1]], a_desc.layout)
    b0_bufs = _allocate_box(b0_desc, NUM_STAGES)
    b1_bufs = _allocate_box(b1_desc, NUM_STAGES)
    c0_smem = gl.allocate_shared_memory(c0_desc.dtype, [CONSUMERS, 64, c0_desc.block_type.shape[1]], c0_desc.layout)
    c1_smem = gl.allocate_shared_memory(c1_desc.dtype, [CONSUMERS, 64, c1_desc.block_type.shape[1]], c1_desc.layout)
    if THREE:
        b2_bufs = _allocate_box(b2_desc, NUM_STAGES)
        c2_smem = gl.allocate_shared_memory(c2_desc.dtype, [CONSUMERS, 64, c2_desc.block_type.shape[1]],
                                            c2_desc.layout)
    else:  # never read: the second box again
        b2_bufs = b1_bufs
        c2_smem = c1_smem
    ready, empty = init_ring(NUM_STAGES, CONSUMERS)  # one `empty` arrival per consumer warpgroup
    chunks_ok, chunks_free = init_chunk_barriers()
    fence_async_shared()

    b_bufs = (b0_bufs, b1_bufs, b2_bufs)
    c_descs = (c0_desc, c1_desc, c2_desc)
    mma_args = (a_bufs, b_bufs, ready, empty, c_descs, (c0_smem, c1_smem, c2_smem), M, N, K, tile_row_offset)
    load_args = (a_desc, (b0_desc, b1_desc, b2_desc), a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset,
                 chunk_args, chunks_ok, chunks_free)
    wait_args = (a_desc, c_descs, M, N, K, tile_row_offset, chunk_args, chunks_ok, chunks_free)
    # registers: two consumer warpgroups get 232 a thread (as kernels/gemm_gluon.py); the producer and waiter 40
    if B_TRANSPOSED:
        if CONSUMERS == 1:
            gl.warp_specialize([(_mma0_nk, mma_args), (_load_waits_nk, load_args),
                                (boxes_chunk_wait_partition, wait_args)], [1, 1], [40, 40])
        else:
            gl.warp_specialize([(_mma0_nk, mma_args), (_mma1_nk, mma_args), (_load_waits_nk, load_args),
                                (boxes_chunk_wait_partition, wait_args)], [4, 1, 1], [232, 40, 40])
    else:
        if CONSUMERS == 1:
            gl.warp_specialize([(_mma0_kn, mma_args), (_load_waits_kn, load_args),
                                (boxes_chunk_wait_partition, wait_args)], [1, 1], [40, 40])
        else:
            gl.warp_specialize([(_mma0_kn, mma_args), (_mma1_kn, mma_args), (_load_waits_kn, load_args),
                                (boxes_chunk_wait_partition, wait_args)], [4, 1, 1], [232, 40, 40])
    invalidate_ring(ready, empty)
    invalidate_chunk_barriers(chunks_ok, chunks_free)
