"""The scatter epilogue of GEMM+ReduceScatter (kernels/gemm_gluon_scatter.py) on 128-row tiles whose width is
not a power of two: B in two boxes, as kernels/gemm_gluon_boxes.py reads it (144 = 128 + 16, 160 = 128 + 32,
192 = 128 + 64).

    gluon_scatter_boxes_gemm_kernel[(num_programs,)](a_desc, b0_desc, b1_desc, dst0, ..., dst7, M, N, K,
                                                     tile_row_offset, rows_per_rank, src_rank, flag_ptrs,
                                                     tile_counters, flags_per_source, dst_ptrs,
                                                     NUM_STAGES=..., B_TRANSPOSED=..., num_warps=4)

Why: under an sm_margin the grid is short of the SMs the power-of-two tiles fill in whole waves. On 116
programs at M = 1024, N = 4096 (TP 8's fc2), 128x128 tiles make 256 = 2.2 waves (three rounds) and 128x256
make 128 = 1.1; 128x144 make 232, exactly two.

The producer warp and the K loop are kernels/gemm_gluon_boxes.py's (two accumulators of BN0 and BN1 columns
per consumer warpgroup); the epilogue is kernels/gemm_gluon_scatter.py's for each 64-row slab: the first box's
columns go through the staging tile to the owner of the slab's first row by TMA (``dst<o>`` in [64, BN0]
boxes; a straddling slab's later rows by masked stores), the second box's columns by masked stores from the
registers to every owner of the slab's rows (``dst_ptrs``; BN1 <= 64 columns, an eighth of the tile at 144).
Tiles are counted one tile late and row blocks published exactly as there, so the owner-side reduction and
the host protocol are unchanged. Whole tiles only (no split tail). Precondition (the launcher's): K >= 1.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from .gemm_gluon import _staging_free
from .gemm_gluon_boxes import _k_loop, _load_kn, _load_nk
from .gemm_gluon_ring import init_ring, invalidate_ring
from .gemm_gluon_scatter import ROWS, WG_M, _publish, _store_later_owners, _store_owners, _store_rows
from .gemm_gluon_walk import tile_coordinates as _tile_coordinates

__all__ = ["gluon_scatter_boxes_gemm_kernel"]


@gluon.jit
def _scatter_partition(a_bufs, b0_bufs, b1_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset,
                       scatter_args, HALF: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """One consumer warpgroup: rows [HALF * 64, HALF * 64 + 64) of every tile, each scattered to its owners."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BN0: gl.constexpr = dst_descs[0].block_type.shape[1]
    BN1: gl.constexpr = b1_bufs.type.shape[1] if B_TRANSPOSED else b1_bufs.type.shape[2]
    layout0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN0, 16])
    layout1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN1, 16])
    num_row_blocks = gl.cdiv(M, ROWS)
    num_col_blocks = gl.cdiv(N, BN0 + BN1)
    num_k = gl.cdiv(K, BLOCK_K)
    out_smem = c_smem.index(HALF)
    pending = gl.program_id(0) * 0 - 1
    step = 0
    for tile_id in range(gl.program_id(0), num_row_blocks * num_col_blocks, gl.num_programs(0)):
        row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        acc0 = gl.zeros([WG_M, BN0], gl.float32, layout0)
        acc1 = gl.zeros([WG_M, BN1], gl.float32, layout1)
        acc0, acc1 = _k_loop(a_bufs, b0_bufs, b1_bufs, ready, empty, acc0, acc1, num_k, step, HALF, B_TRANSPOSED)
        step += num_k
        _staging_free()  # the previous tile's stores are complete: count it now
        if pending >= 0:
            _publish(pending, M, num_col_blocks, scatter_args)
        first_row = row_block * ROWS + HALF * WG_M
        first_col = col_block * (BN0 + BN1)
        out_smem.store(acc0.to(out_smem.dtype))
        _store_owners(out_smem, dst_descs, first_row, first_col, M, scatter_args[0])
        _store_later_owners(acc0, out_smem, first_row, first_col, M, N, scatter_args)
        _store_rows(acc1, out_smem, first_row, first_col + BN0, first_row // scatter_args[0], M, N, scatter_args)
        pending = row_block
    _staging_free()
    if pending >= 0:
        _publish(pending, M, num_col_blocks, scatter_args)


# One function per (partition, B layout): partitions receive no compile-time arguments (kernels/gemm_gluon.py).
@gluon.jit
def _scatter0_kn(a_bufs, b0_bufs, b1_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args):
    _scatter_partition(a_bufs, b0_bufs, b1_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset,
                       scatter_args, 0, False)


@gluon.jit
def _scatter1_kn(a_bufs, b0_bufs, b1_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args):
    _scatter_partition(a_bufs, b0_bufs, b1_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset,
                       scatter_args, 1, False)


@gluon.jit
def _scatter0_nk(a_bufs, b0_bufs, b1_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args):
    _scatter_partition(a_bufs, b0_bufs, b1_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset,
                       scatter_args, 0, True)


@gluon.jit
def _scatter1_nk(a_bufs, b0_bufs, b1_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args):
    _scatter_partition(a_bufs, b0_bufs, b1_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset,
                       scatter_args, 1, True)


@gluon.jit(do_not_specialize=["M", "tile_row_offset", "rows_per_rank", "src_rank"])
def gluon_scatter_boxes_gemm_kernel(a_desc, b0_desc, b1_desc, dst0, dst1, dst2, dst3, dst4, dst5, dst6, dst7, M, N,
                                    K, tile_row_offset, rows_per_rank, src_rank, flag_ptrs, tile_counters,
                                    flags_per_source, dst_ptrs, NUM_STAGES: gl.constexpr, B_TRANSPOSED: gl.constexpr,
                                    LOAD_REGS: gl.constexpr = 40):
    """A [M, K] @ B scattered to the owners (module docstring): B's tile columns in boxes b0 (BN0) and b1 (BN1);
    ``dst<o>`` owner o's descriptor in [64, BN0] boxes, any descriptor past the group (never stored to, as in
    kernels/gemm_gluon_scatter.py); ``dst_ptrs`` int64 [W] the owners' partials buffers [W, rows_per_rank, N]."""
    dst_descs = (dst0, dst1, dst2, dst3, dst4, dst5, dst6, dst7)
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BN0: gl.constexpr = dst_descs[0].block_type.shape[1]
    gl.static_assert(a_desc.block_type.shape[0] == ROWS, "A in [128, BLOCK_K] boxes: two consumer warpgroups")
    gl.static_assert(dst_descs[0].block_type.shape[0] == WG_M, "the partials in 64-row boxes, one per consumer")
    if B_TRANSPOSED:
        gl.static_assert(b0_desc.block_type.shape[0] == BN0, "B [N, K]: the first box [BN0, BLOCK_K]")
    else:
        gl.static_assert(b0_desc.block_type.shape[1] == BN0, "B [K, N]: the first box [BLOCK_K, BN0]")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one warpgroup")
    gl.static_assert(NUM_STAGES >= 2, "a ring of at least two slots")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, ROWS, BLOCK_K], a_desc.layout)
    b0_bufs = gl.allocate_shared_memory(b0_desc.dtype, [NUM_STAGES] + b0_desc.block_type.shape, b0_desc.layout)
    b1_bufs = gl.allocate_shared_memory(b1_desc.dtype, [NUM_STAGES] + b1_desc.block_type.shape, b1_desc.layout)
    c_smem = gl.allocate_shared_memory(dst_descs[0].dtype, [2, WG_M, BN0], dst_descs[0].layout)
    ready, empty = init_ring(NUM_STAGES, 2)  # one `empty` arrival per consumer warpgroup
    fence_async_shared()

    scatter_args = (rows_per_rank, src_rank, flag_ptrs, tile_counters, flags_per_source, dst_ptrs)
    mma_args = (a_bufs, b0_bufs, b1_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args)
    load_args = (a_desc, b0_desc, b1_desc, a_bufs, b0_bufs, b1_bufs, ready, empty, M, N, K, tile_row_offset)
    if B_TRANSPOSED:
        gl.warp_specialize([(_scatter0_nk, mma_args), (_scatter1_nk, mma_args), (_load_nk, load_args)], [4, 1],
                           [232, LOAD_REGS])
    else:
        gl.warp_specialize([(_scatter0_kn, mma_args), (_scatter1_kn, mma_args), (_load_kn, load_args)], [4, 1],
                           [232, LOAD_REGS])
    invalidate_ring(ready, empty)
