"""Persistent bf16/fp16 GEMM in Gluon for 64-row tiles and widths that are not powers of two: B in two boxes.

Computes ``C[M, N] = A[M, K] @ B[K, N]`` as kernels/gemm_gluon.py does (B row-major [K, N], or the rows of an
``nn.Linear`` weight [N, K] read as their transpose; fp32 accumulation; TMA zero-fills past M, N and K and clips
the store), for the tiles that kernel cannot run: BLOCK_M 64 (one consumer warpgroup) and tile widths that
are not powers of two. Gluon shapes are powers of two, so a [BLOCK_M, BN0 + BN1] tile comes as two B boxes
([BN0, BLOCK_K] and [BN1, BLOCK_K], or [BLOCK_K, BN0] and [BLOCK_K, BN1]) with an accumulator and a C box
each: 96 = 64 + 32, 160 = 128 + 32, 192 = 128 + 64.

    gluon_boxes_gemm_kernel[(num_programs,)](a_desc, b0_desc, b1_desc, c0_desc, c1_desc, M, N, K,
                                             tile_row_offset, NUM_STAGES=..., B_TRANSPOSED=..., num_warps=4)

Why: at the narrow shapes (M 1024-2048, N 768-1536) power-of-two tiles either leave SMs idle (48-96 tiles of
128x128) or are too small to run at the tensor cores' rate; widths like 96, 160 or 192 (cuBLAS's choice there)
give about one full wave. Both MMAs of a K step read the warpgroup's A rows from shared memory (loading them
into registers once for both measured 30-40 % slower).

Partitions as kernels/gemm_gluon.py: a producer warp fills a ring of NUM_STAGES slots (``ready`` mbarrier per
slot, tx-counted) and refills a slot once every consumer released it (``empty``); a consumer warpgroup per
64 rows keeps one K step of MMAs in flight, releases each slot once the MMAs reading it retired, and stores
its two C boxes through shared memory with TMA stores that complete while the next tile's K loop runs. Tiles
are walked persistently in GROUP_M = 8 order, row blocks rotated by ``tile_row_offset``. No split tail.
Precondition (the launcher's): K >= 1.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from tp_overlap.kernels.gemm_gluon import _barrier, _staging_free
from tp_overlap.kernels.gemm_gluon_ring import init_ring, invalidate_ring
from tp_overlap.kernels.gemm_gluon_walk import tile_coordinates as _tile_coordinates

# Fixed for the reason kernels/gemm_gluon.py gives: partitions take no compile-time arguments, so the shapes come
# from the buffers' types and the B layout and the warpgroup from which partition function runs.
WG_M = gl.constexpr(64)


@gluon.jit
def _load_partition(a_desc, b0_desc, b1_desc, a_bufs, b0_bufs, b1_bufs, ready, empty, M, N, K, tile_row_offset,
                    B_TRANSPOSED: gl.constexpr):
    """The producer warp: TMA loads of every K step of this program's tiles into the ring."""
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BN0: gl.constexpr = b0_desc.block_type.shape[0] if B_TRANSPOSED else b0_desc.block_type.shape[1]
    BN1: gl.constexpr = b1_desc.block_type.shape[0] if B_TRANSPOSED else b1_desc.block_type.shape[1]
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b0_desc.block_type.nbytes + b1_desc.block_type.nbytes
    num_row_blocks = gl.cdiv(M, BLOCK_M)
    num_col_blocks = gl.cdiv(N, BN0 + BN1)
    num_k = gl.cdiv(K, BLOCK_K)
    step = 0
    for tile_id in range(gl.program_id(0), num_row_blocks * num_col_blocks, gl.num_programs(0)):
        row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        first_col = col_block * (BN0 + BN1)
        for k in range(num_k):
            slot = step % NUM_STAGES
            mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)  # fresh: parity 1 counts as done
            bar = ready.index(slot)
            mbarrier.expect(bar, STAGE_BYTES)
            tma.async_copy_global_to_shared(a_desc, [row_block * BLOCK_M, k * BLOCK_K], bar, a_bufs.index(slot))
            if B_TRANSPOSED:
                tma.async_copy_global_to_shared(b0_desc, [first_col, k * BLOCK_K], bar, b0_bufs.index(slot))
                tma.async_copy_global_to_shared(b1_desc, [first_col + BN0, k * BLOCK_K], bar, b1_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(b0_desc, [k * BLOCK_K, first_col], bar, b0_bufs.index(slot))
                tma.async_copy_global_to_shared(b1_desc, [k * BLOCK_K, first_col + BN0], bar, b1_bufs.index(slot))
            step += 1


@gluon.jit
def _k_loop(a_bufs, b0_bufs, b1_bufs, ready, empty, acc0, acc1, num_k, step, HALF: gl.constexpr,
            B_TRANSPOSED: gl.constexpr):
    """(acc0, acc1) += this warpgroup's 64 rows of A @ (B box 0, B box 1) over the tile's K steps; one step of
    MMAs stays in flight, each slot is released once the MMAs reading it retired."""
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    for k in range(num_k):
        slot = (step + k) % NUM_STAGES
        mbarrier.wait(ready.index(slot), ((step + k) // NUM_STAGES) & 1)
        a_rows = a_bufs.index(slot).slice(HALF * WG_M, WG_M, dim=0)
        if B_TRANSPOSED:
            b0 = b0_bufs.index(slot).permute((1, 0))
            b1 = b1_bufs.index(slot).permute((1, 0))
        else:
            b0 = b0_bufs.index(slot)
            b1 = b1_bufs.index(slot)
        acc0 = warpgroup_mma(a_rows, b0, acc0, is_async=True)
        acc1 = warpgroup_mma(a_rows, b1, acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
        if k > 0:
            _barrier()  # every warp of this warpgroup is past the MMA wait before the slot is released
            mbarrier.arrive(empty.index((step + k - 1) % NUM_STAGES))
    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    _barrier()
    mbarrier.arrive(empty.index((step + num_k - 1) % NUM_STAGES))
    return acc0, acc1


@gluon.jit
def _mma_partition(a_bufs, b0_bufs, b1_bufs, ready, empty, c0_desc, c1_desc, c0_smem, c1_smem, M, N, K,
                   tile_row_offset, HALF: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """One consumer warpgroup: rows [HALF * 64, HALF * 64 + 64) of every tile."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BN0: gl.constexpr = c0_desc.block_type.shape[1]
    BN1: gl.constexpr = c1_desc.block_type.shape[1]
    layout0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN0, 16])
    layout1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN1, 16])
    num_row_blocks = gl.cdiv(M, BLOCK_M)
    num_col_blocks = gl.cdiv(N, BN0 + BN1)
    num_k = gl.cdiv(K, BLOCK_K)
    out0 = c0_smem.index(HALF)
    out1 = c1_smem.index(HALF)
    step = 0
    for tile_id in range(gl.program_id(0), num_row_blocks * num_col_blocks, gl.num_programs(0)):
        row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        acc0 = gl.zeros([WG_M, BN0], gl.float32, layout0)
        acc1 = gl.zeros([WG_M, BN1], gl.float32, layout1)
        acc0, acc1 = _k_loop(a_bufs, b0_bufs, b1_bufs, ready, empty, acc0, acc1, num_k, step, HALF, B_TRANSPOSED)
        step += num_k
        _staging_free()
        out0.store(acc0.to(c0_desc.dtype))
        out1.store(acc1.to(c1_desc.dtype))
        fence_async_shared()
        _barrier()  # every warp's rows are in the staging tiles before the stores are issued
        first_row = row_block * BLOCK_M + HALF * WG_M
        tma.async_copy_shared_to_global(c0_desc, [first_row, col_block * (BN0 + BN1)], out0)
        tma.async_copy_shared_to_global(c1_desc, [first_row, col_block * (BN0 + BN1) + BN0], out1)
    tma.store_wait(pendings=0)


# One function per (partition, B layout): partitions receive no compile-time arguments.
@gluon.jit
def _mma0_nk(a_bufs, b0_bufs, b1_bufs, ready, empty, c0_desc, c1_desc, c0_smem, c1_smem, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b0_bufs, b1_bufs, ready, empty, c0_desc, c1_desc, c0_smem, c1_smem, M, N, K,
                   tile_row_offset, 0, True)


@gluon.jit
def _mma1_nk(a_bufs, b0_bufs, b1_bufs, ready, empty, c0_desc, c1_desc, c0_smem, c1_smem, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b0_bufs, b1_bufs, ready, empty, c0_desc, c1_desc, c0_smem, c1_smem, M, N, K,
                   tile_row_offset, 1, True)


@gluon.jit
def _mma0_kn(a_bufs, b0_bufs, b1_bufs, ready, empty, c0_desc, c1_desc, c0_smem, c1_smem, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b0_bufs, b1_bufs, ready, empty, c0_desc, c1_desc, c0_smem, c1_smem, M, N, K,
                   tile_row_offset, 0, False)


@gluon.jit
def _mma1_kn(a_bufs, b0_bufs, b1_bufs, ready, empty, c0_desc, c1_desc, c0_smem, c1_smem, M, N, K, tile_row_offset):
    _mma_partition(a_bufs, b0_bufs, b1_bufs, ready, empty, c0_desc, c1_desc, c0_smem, c1_smem, M, N, K,
                   tile_row_offset, 1, False)


@gluon.jit
def _load_nk(a_desc, b0_desc, b1_desc, a_bufs, b0_bufs, b1_bufs, ready, empty, M, N, K, tile_row_offset):
    _load_partition(a_desc, b0_desc, b1_desc, a_bufs, b0_bufs, b1_bufs, ready, empty, M, N, K, tile_row_offset, True)


@gluon.jit
def _load_kn(a_desc, b0_desc, b1_desc, a_bufs, b0_bufs, b1_bufs, ready, empty, M, N, K, tile_row_offset):
    _load_partition(a_desc, b0_desc, b1_desc, a_bufs, b0_bufs, b1_bufs, ready, empty, M, N, K, tile_row_offset, False)


@gluon.jit(do_not_specialize=["M", "tile_row_offset"])
def gluon_boxes_gemm_kernel(a_desc, b0_desc, b1_desc, c0_desc, c1_desc, M, N, K, tile_row_offset,
                            NUM_STAGES: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    CONSUMERS: gl.constexpr = BLOCK_M // 64
    gl.static_assert((BLOCK_M == 64) or (BLOCK_M == 128), "one consumer warpgroup per 64 rows: BLOCK_M 64 or 128")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one warpgroup")
    gl.static_assert((c0_desc.block_type.shape[0] == 64) and (c1_desc.block_type.shape[0] == 64),
                     "C is stored in 64-row boxes, one per consumer")
    gl.static_assert(NUM_STAGES >= 2, "a ring of at least two slots")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b0_bufs = gl.allocate_shared_memory(b0_desc.dtype, [NUM_STAGES, b0_desc.block_type.shape[0],
                                                        b0_desc.block_type.shape[1]], b0_desc.layout)
    b1_bufs = gl.allocate_shared_memory(b1_desc.dtype, [NUM_STAGES, b1_desc.block_type.shape[0],
                                                        b1_desc.block_type.shape[1]], b1_desc.layout)
    c0_smem = gl.allocate_shared_memory(c0_desc.dtype, [CONSUMERS, 64, c0_desc.block_type.shape[1]], c0_desc.layout)
    c1_smem = gl.allocate_shared_memory(c1_desc.dtype, [CONSUMERS, 64, c1_desc.block_type.shape[1]], c1_desc.layout)
    ready, empty = init_ring(NUM_STAGES, CONSUMERS)  # one `empty` arrival per consumer warpgroup
    fence_async_shared()

    mma_args = (a_bufs, b0_bufs, b1_bufs, ready, empty, c0_desc, c1_desc, c0_smem, c1_smem, M, N, K, tile_row_offset)
    load_args = (a_desc, b0_desc, b1_desc, a_bufs, b0_bufs, b1_bufs, ready, empty, M, N, K, tile_row_offset)
    # registers: two consumer warpgroups get 232 a thread (as kernels/gemm_gluon.py); the producer warp 40
    if B_TRANSPOSED:
        if CONSUMERS == 1:
            gl.warp_specialize([(_mma0_nk, mma_args), (_load_nk, load_args)], [1], [40])
        else:
            gl.warp_specialize([(_mma0_nk, mma_args), (_mma1_nk, mma_args), (_load_nk, load_args)], [4, 1],
                               [232, 40])
    else:
        if CONSUMERS == 1:
            gl.warp_specialize([(_mma0_kn, mma_args), (_load_kn, load_args)], [1], [40])
        else:
            gl.warp_specialize([(_mma0_kn, mma_args), (_mma1_kn, mma_args), (_load_kn, load_args)], [4, 1],
                               [232, 40])
    invalidate_ring(ready, empty)
