"""The Gluon GEMM whose epilogue scatters the other owners' rows and reduces its own (EPILOGUE 2 of
kernels/gemm.py, GemmRs `epilogue_reduce`): no reduction kernel and no reserved SMs.

The producer warp and K loop of kernels/gemm_gluon.py (BLOCK_M 128: two consumer warpgroups of 64 rows) and the
scatter epilogue of kernels/gemm_gluon_scatter.py, in a walk that takes the other owners' row blocks first and
this rank's own `rows_per_rank / 128` row blocks last (kernels/gemm_gluon_walk.py `owner_last_coordinates`):

* a tile of another owner's rows is stored into that owner's partials buffer and counted one tile later, as the
  scatter GEMM does (its row block's flag, on the last count, holds the call's M);
* a tile of the own rows first counts the warpgroup's pending tile (so every tile a program scatters is
  published before its first wait: counting never depends on a peer), then waits, bounded, for the row block's
  flag of every other source (await_flag, kernels/gemm_gluon_wait.py: it holds M once that source's slab of
  these rows has landed), adds their bf16 partials (TMA-loaded from the own buffer ``own_desc``, the
  [W * rows_per_rank, N] slots, into the staging tile, one source at a time, in source order) to the fp32
  accumulator, and stores the sum into ``out_desc`` (the output shard [rows_per_rank, N]).

Needs ``rows_per_rank % 128 == 0`` (own row blocks never straddle owners), every tile whole (no split tail), and
every program resident at once (grid <= the SMs left free): a program waits only after all its scattered tiles
are published, and waits only for other sources' scattered tiles, which never wait. An expired wait (or a flag
at another value: a peer with another M) records ``error_code_base + src * flags_per_source + row block`` in the
control page at ``error_ptr`` (kernels/gemm_gluon_wait.py), the warpgroup skips its remaining own tiles, and
the kernel ends; the host raises.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .gemm_gluon import _barrier, _k_loop, _load_partition, _staging_free, _store_staged
from .gemm_gluon_ring import init_ring, invalidate_ring
from .gemm_gluon_scatter import ROWS, WG_M, _publish, _scatter_tile
from .gemm_gluon_wait import await_flag, init_chunk_barriers, invalidate_chunk_barriers
from .gemm_gluon_walk import owner_last_coordinates

__all__ = ["gluon_scatter_reduce_gemm_kernel"]


@gluon.jit
def _await_sources(local_row_block, M, scatter_args, reduce_args, arrived):
    """Wait (bounded) for the row-block flag of every other source; True when all hold M. Every thread then
    acquires each flag itself and fences the async proxy: the partials' TMA loads follow."""
    rows_per_rank, src_rank, flag_ptrs, _, flags_per_source, _ = scatter_args
    _, _, error_ptr, error_code_base, timeout_ns = reduce_args
    threads: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    lane = gl.arange(0, 128, layout=threads)
    own_flags = gl.load(flag_ptrs + src_rank + lane * 0).to(gl.pointer_type(gl.int32))
    for src in range(M // rows_per_rank):
        if arrived & (src != src_rank):
            index = src * flags_per_source + local_row_block
            arrived = await_flag(own_flags + index, M, error_code_base + index, error_ptr, timeout_ns, lane)
            if arrived:
                gl.atomic_add(own_flags + index, lane * 0, sem="acquire", scope="sys")
    gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, $1;", "=r,r", [lane], dtype=gl.int32,
                              is_pure=False, pack=1)
    return arrived


@gluon.jit
def _reduce_own(acc, out_smem, loaded, loads, local_row_block, col_block, M, scatter_args, reduce_args, arrived,
                HALF: gl.constexpr):
    """An own tile: this warpgroup's 64 rows of it summed over every source into the output shard. Returns
    (arrived, loads): False once a wait expired (nothing stored, later own tiles skipped); the count of
    partial loads so far (the phase of `loaded`)."""
    rows_per_rank, src_rank, _, _, _, _ = scatter_args
    own_desc, out_desc, _, _, _ = reduce_args
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    arrived = _await_sources(local_row_block, M, scatter_args, reduce_args, arrived)
    local_row = local_row_block * ROWS + HALF * WG_M
    if arrived:
        for src in range(M // rows_per_rank):
            if src != src_rank:
                fence_async_shared()  # the warps' reads of the staging tile precede its overwrite by TMA
                mbarrier.expect(loaded, own_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(own_desc, [src * rows_per_rank + local_row, col_block * BLOCK_N],
                                                loaded, out_smem)
                mbarrier.wait(loaded, loads & 1)
                loads += 1
                acc = acc + out_smem.load(acc.type.layout).to(gl.float32)
                _barrier()  # every warp has read the partial before the next load overwrites it
        out_smem.store(acc.to(out_smem.dtype))
        _store_staged(out_smem, out_desc, local_row, col_block * BLOCK_N)
    return arrived, loads


@gluon.jit
def _reduce_partition(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, loaded, M, N, K, own_first_row_block,
                      scatter_args, reduce_args, HALF: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """One consumer warpgroup: rows [HALF * 64, HALF * 64 + 64) of every tile of the owner-last walk."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = dst_descs[0].block_type.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_row_blocks = gl.cdiv(M, ROWS)
    num_col_blocks = gl.cdiv(N, BLOCK_N)
    num_k = gl.cdiv(K, BLOCK_K)
    own_row_blocks = scatter_args[0] // ROWS
    out_smem = c_smem.index(HALF)
    pending = gl.program_id(0) * 0 - 1
    arrived = gl.program_id(0) >= 0
    loads = gl.program_id(0) * 0
    step = 0
    for tile_id in range(gl.program_id(0), num_row_blocks * num_col_blocks, gl.num_programs(0)):
        row_block, col_block = owner_last_coordinates(tile_id, num_row_blocks, num_col_blocks, own_first_row_block,
                                                      own_row_blocks)
        acc = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
        acc = _k_loop(a_bufs, b_bufs, ready, empty, acc, num_k, step, HALF, B_TRANSPOSED)
        step += num_k
        _staging_free()  # the previous tile's stores are complete: count it now, before any wait
        if pending >= 0:
            _publish(pending, M, num_col_blocks, scatter_args)
        pending = gl.program_id(0) * 0 - 1
        local_row_block = row_block - own_first_row_block
        if (local_row_block >= 0) & (local_row_block < own_row_blocks):
            arrived, loads = _reduce_own(acc, out_smem, loaded.index(HALF), loads, local_row_block, col_block, M,
                                         scatter_args, reduce_args, arrived, HALF)
        else:
            out_smem.store(acc.to(out_smem.dtype))
            pending = _scatter_tile(acc, out_smem, dst_descs, row_block, col_block, M, N, scatter_args, HALF)
    _staging_free()
    if pending >= 0:
        _publish(pending, M, num_col_blocks, scatter_args)


# One function per (partition, B layout): partitions receive no compile-time arguments (kernels/gemm_gluon.py).
@gluon.jit
def _reduce0_kn(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, loaded, M, N, K, own_first_row_block, scatter_args,
                reduce_args):
    _reduce_partition(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, loaded, M, N, K, own_first_row_block,
                      scatter_args, reduce_args, 0, False)


@gluon.jit
def _reduce1_kn(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, loaded, M, N, K, own_first_row_block, scatter_args,
                reduce_args):
    _reduce_partition(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, loaded, M, N, K, own_first_row_block,
                      scatter_args, reduce_args, 1, False)


@gluon.jit
def _reduce0_nk(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, loaded, M, N, K, own_first_row_block, scatter_args,
                reduce_args):
    _reduce_partition(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, loaded, M, N, K, own_first_row_block,
                      scatter_args, reduce_args, 0, True)


@gluon.jit
def _reduce1_nk(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, loaded, M, N, K, own_first_row_block, scatter_args,
                reduce_args):
    _reduce_partition(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, loaded, M, N, K, own_first_row_block,
                      scatter_args, reduce_args, 1, True)


@gluon.jit
def _load_owner_last_kn(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, own_first_row_block, num_tiles,
                        splits, chunk_args, chunks_ok, chunks_free):
    _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, own_first_row_block, num_tiles, splits,
                    chunk_args, chunks_ok, chunks_free, False, True)


@gluon.jit
def _load_owner_last_nk(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, own_first_row_block, num_tiles,
                        splits, chunk_args, chunks_ok, chunks_free):
    _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, own_first_row_block, num_tiles, splits,
                    chunk_args, chunks_ok, chunks_free, True, True)


@gluon.jit(do_not_specialize=["M", "own_first_row_block", "rows_per_rank", "src_rank"])
def gluon_scatter_reduce_gemm_kernel(a_desc, b_desc, dst0, dst1, dst2, dst3, dst4, dst5, dst6, dst7, own_desc, out_desc,
                                     M, N, K, own_first_row_block, rows_per_rank, src_rank, flag_ptrs, tile_counters,
                                     flags_per_source, dst_ptrs, error_ptr, error_code_base, timeout_ns, chunk_args,
                                     NUM_STAGES: gl.constexpr, B_TRANSPOSED: gl.constexpr,
                                     LOAD_REGS: gl.constexpr = 40):
    """A [M, K] @ B: the other owners' rows scattered, the own rows reduced into ``out_desc`` (module docstring).
    ``dst<o>``, ``flag_ptrs``, ``tile_counters``, ``flags_per_source`` and ``dst_ptrs`` as
    kernels/gemm_gluon_scatter.py takes them; ``own_desc`` the own partials buffer [W * rows_per_rank, N] and
    ``out_desc`` the output shard [rows_per_rank, N], both in [64, BLOCK_N] boxes; ``own_first_row_block`` =
    src_rank * rows_per_rank / 128; ``chunk_args`` kernels/gemm_gluon_wait.py's with 0 chunks per rank and
    ``rows_per_rank`` (the producer's walk reads it there)."""
    dst_descs = (dst0, dst1, dst2, dst3, dst4, dst5, dst6, dst7)
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = dst_descs[0].block_type.shape[1]
    gl.static_assert(a_desc.block_type.shape[0] == ROWS, "A in [128, BLOCK_K] boxes: two consumer warpgroups")
    gl.static_assert(dst_descs[0].block_type.shape[0] == WG_M, "the partials in 64-row boxes, one per consumer")
    gl.static_assert((own_desc.block_type.shape[0] == WG_M) and (own_desc.block_type.shape[1] == BLOCK_N)
                     and (out_desc.block_type.shape[0] == WG_M) and (out_desc.block_type.shape[1] == BLOCK_N),
                     "the own partials and the output shard in the staging tile's [64, BLOCK_N] boxes")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one warpgroup")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, ROWS, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dst_descs[0].dtype, [2, WG_M, BLOCK_N], dst_descs[0].layout)
    ready, empty = init_ring(NUM_STAGES, 2)  # one `empty` arrival per consumer warpgroup
    loaded = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # a partial's TMA load, per
    for i in gl.static_range(2):                                                       # consumer warpgroup
        mbarrier.init(loaded.index(i), count=1)
    chunks_ok, chunks_free = init_chunk_barriers()  # the producer's arguments; no waits (0 chunks per rank)
    fence_async_shared()

    scatter_args = (rows_per_rank, src_rank, flag_ptrs, tile_counters, flags_per_source, dst_ptrs)
    reduce_args = (own_desc, out_desc, error_ptr, error_code_base, timeout_ns)
    mma_args = (a_bufs, b_bufs, ready, empty, dst_descs, c_smem, loaded, M, N, K, own_first_row_block, scatter_args,
                reduce_args)
    num_tiles = gl.cdiv(M, ROWS) * gl.cdiv(N, BLOCK_N)
    load_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, own_first_row_block, num_tiles, M * 0 + 1,
                 chunk_args, chunks_ok, chunks_free)
    if B_TRANSPOSED:
        gl.warp_specialize([(_reduce0_nk, mma_args), (_reduce1_nk, mma_args), (_load_owner_last_nk, load_args)],
                           [4, 1], [232, LOAD_REGS])
    else:
        gl.warp_specialize([(_reduce0_kn, mma_args), (_reduce1_kn, mma_args), (_load_owner_last_kn, load_args)],
                           [4, 1], [232, LOAD_REGS])
    invalidate_ring(ready, empty)
    for i in gl.static_range(2):
        mbarrier.invalidate(loaded.index(i))
    invalidate_chunk_barriers(chunks_ok, chunks_free)
