"""The Gluon bf16/fp16 GEMM of kernels/gemm_gluon.py with a streamed tail: fewer tiles than programs, cut evenly.

Computes ``C[M, N] = A[M, K] @ B`` as gluon_gemm_kernel does (BLOCK_M 128: two consumer warpgroups; B [K, N]
or [N, K]; the AllGather consumer's chunk waits), for launches whose last tiles would leave SMs idle: with 112
tiles of 128 x 256 on 132 SMs, whole tiles keep 20 SMs idle and a split into equal K pieces cannot help (224
half tiles are two rounds of 132). Here the K steps of the tiles after the first `num_whole_tiles` are laid end to end
and every program takes an equal, contiguous run of them (kernels/gemm_gluon_walk.py ``streamed_items``):
112 x 64 steps on 132 programs are 54 or 55 steps each instead of 64, each program at most two pieces.

    gluon_stream_gemm_kernel[(num_programs,)](a_desc, b_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles,
                                              workspace, counters, chunk_args, NUM_STAGES=..., B_TRANSPOSED=...,
                                              num_warps=4)

A piece that is not its whole tile is finished as gluon_gemm_kernel's split items are (``store_item``'s parts): its
fp32 partial to its slot (``streamed_item``: the piece of program p of streamed tile t in slot p + t, a tile's pieces
in consecutive slots in K order), a count on the (tile, warpgroup) counter, and the piece whose count completes the
tile's arrivals sums every partial in K order (bitwise the same whichever arrives last) and stores C. Nobody waits
for anybody. ``workspace`` is fp32 [(programs + streamed tiles - 1) * 2, 64 * BLOCK_N], ``counters`` int32
[2 * streamed tiles], zero before the launch and left at zero. Preconditions (the launcher's): K >= 1, and at
least one streamed step per program ((tiles - num_whole_tiles) * cdiv(K, BLOCK_K) >= programs).

Why a kernel of its own: partitions take no compile-time arguments (kernels/gemm_gluon.py), so another walk is
other partition functions, and gluon_gemm_kernel's builds stay what they were.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

from .gemm_gluon import _count_partial, _k_loop, _staging_free, _store_staged, _sum_partials
from .gemm_gluon_ring import init_ring, invalidate_ring, load_item
from .gemm_gluon_wait import _publish_chunk_rows, init_chunk_barriers, invalidate_chunk_barriers
from .gemm_gluon_walk import streamed_item, streamed_items, tile_coordinates

BLOCK_M = gl.constexpr(128)
WG_M = gl.constexpr(64)


@gluon.jit
def _walk(M, N, K, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """(row blocks, column blocks, K steps, tiles) of the launch."""
    num_row_blocks = gl.cdiv(M, BLOCK_M)
    num_col_blocks = gl.cdiv(N, BLOCK_N)
    return num_row_blocks, num_col_blocks, gl.cdiv(K, BLOCK_K), num_row_blocks * num_col_blocks


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles,
                    chunk_args, chunks_ok, chunks_free, B_TRANSPOSED: gl.constexpr):
    """The producer warp: kernels/gemm_gluon.py's, over the streamed walk."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0] if B_TRANSPOSED else b_desc.block_type.shape[1]
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    num_row_blocks, num_col_blocks, num_k, num_tiles = _walk(M, N, K, BLOCK_N, BLOCK_K)
    whole, first, end, items = streamed_items(num_whole_tiles, num_tiles, num_k)
    waits = chunk_args[1] > 0
    step = 0
    for i in range(items):
        tile_id, first_k, end_k, _, _, _ = streamed_item(i, whole, first, end, num_whole_tiles, num_tiles, num_k)
        row_block, col_block = tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        step = load_item(a_desc, b_desc, a_bufs, b_bufs, ready, empty, step, i, row_block, col_block, first_k, end_k,
                         waits, chunks_ok, chunks_free, STAGE_BYTES, B_TRANSPOSED)


@gluon.jit
def _store_piece(acc, slot, tile_id, pieces, first_slot, split_args, out_smem, c_desc, first_row, first_col,
                 HALF: gl.constexpr):
    """Store this warpgroup's rows of a piece: a whole tile at once; else its partial, counted, and by the tile's
    last arrival the sum of all its pieces' partials (kernels/gemm_gluon.py ``store_item``)."""
    num_whole_tiles, workspace, counters = split_args
    if slot < 0:
        _staging_free()
        out_smem.store(acc.to(c_desc.dtype))
        _store_staged(out_smem, c_desc, first_row, first_col)
    elif _count_partial(acc, slot, tile_id, num_whole_tiles, pieces, workspace, counters, HALF, 2):
        _staging_free()
        _sum_partials(workspace, first_slot * 2 + HALF, pieces, out_smem, WG_M, out_smem.type.shape[1], 2)
        _store_staged(out_smem, c_desc, first_row, first_col)


@gluon.jit
def _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args,
                   HALF: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """One consumer warpgroup: rows [HALF * 64, HALF * 64 + 64) of every piece."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_row_blocks, num_col_blocks, num_k, num_tiles = _walk(M, N, K, BLOCK_N, BLOCK_K)
    num_whole_tiles = split_args[0]
    whole, first, end, items = streamed_items(num_whole_tiles, num_tiles, num_k)
    out_smem = c_smem.index(HALF)
    step = 0
    for i in range(items):
        tile_id, first_k, end_k, slot, pieces, first_slot = streamed_item(i, whole, first, end, num_whole_tiles,
                                                                          num_tiles, num_k)
        row_block, col_block = tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        acc = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
        acc = _k_loop(a_bufs, b_bufs, ready, empty, acc, end_k - first_k, step, HALF, B_TRANSPOSED)
        step += end_k - first_k
        _store_piece(acc, slot, tile_id, pieces, first_slot, split_args, out_smem, c_desc,
                     row_block * BLOCK_M + HALF * WG_M, col_block * BLOCK_N, HALF)
    tma.store_wait(pendings=0)


@gluon.jit
def _wait_partition(a_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, chunk_args, chunks_ok, chunks_free):
    """The waiter warp (kernels/gemm_gluon_wait.py, bounded by the clock) over the streamed walk."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    num_row_blocks, num_col_blocks, num_k, num_tiles = _walk(M, N, K, BLOCK_N, BLOCK_K)
    if chunk_args[1] > 0:
        whole, first, end, items = streamed_items(num_whole_tiles, num_tiles, num_k)
        ready = chunk_args[1] > 0
        known = chunk_args[1] * 0
        for i in range(items):
            tile_id, _, _, _, _, _ = streamed_item(i, whole, first, end, num_whole_tiles, num_tiles, num_k)
            row_block, _ = tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
            first_row = row_block * BLOCK_M
            ready, known = _publish_chunk_rows(chunk_args, first_row, gl.minimum(first_row + BLOCK_M, M) - 1, ready,
                                               known, i, chunks_ok, chunks_free, True)


# One function per (partition, B layout): partitions receive no compile-time arguments.
@gluon.jit
def _mma0_kn(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args, 0, False)


@gluon.jit
def _mma1_kn(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args, 1, False)


@gluon.jit
def _load_kn(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles, chunk_args,
             chunks_ok, chunks_free):
    _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles,
                    chunk_args, chunks_ok, chunks_free, False)


@gluon.jit
def _mma0_nk(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args, 0, True)


@gluon.jit
def _mma1_nk(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args, 1, True)


@gluon.jit
def _load_nk(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles, chunk_args,
             chunks_ok, chunks_free):
    _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles,
                    chunk_args, chunks_ok, chunks_free, True)


@gluon.jit(do_not_specialize=["M", "tile_row_offset", "num_whole_tiles"])
def gluon_stream_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, workspace, counters,
                             chunk_args, NUM_STAGES: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    gl.static_assert(a_desc.block_type.shape[0] == BLOCK_M, "A in [128, BLOCK_K] boxes: two consumer warpgroups")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one warpgroup")
    gl.static_assert(c_desc.block_type.shape[0] == WG_M, "C is stored in 64-row slabs, one per consumer")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, WG_M, BLOCK_N], c_desc.layout)
    ready, empty = init_ring(NUM_STAGES, 2)  # one `empty` arrival per consumer warpgroup
    chunks_ok, chunks_free = init_chunk_barriers()
    fence_async_shared()

    mma_args = (a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset,
                (num_whole_tiles, workspace, counters))
    load_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles, chunk_args,
                 chunks_ok, chunks_free)
    wait_args = (a_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, chunk_args, chunks_ok, chunks_free)
    # registers as gluon_gemm_kernel's two consumer warpgroups: 232 a thread, the worker warps 40
    if B_TRANSPOSED:
        gl.warp_specialize([(_mma0_nk, mma_args), (_mma1_nk, mma_args), (_load_nk, load_args),
                            (_wait_partition, wait_args)], [4, 1, 1], [232, 40, 40])
    else:
        gl.warp_specialize([(_mma0_kn, mma_args), (_mma1_kn, mma_args), (_load_kn, load_args),
                            (_wait_partition, wait_args)], [4, 1, 1], [232, 40, 40])
    invalidate_ring(ready, empty)
    invalidate_chunk_barriers(chunks_ok, chunks_free)
