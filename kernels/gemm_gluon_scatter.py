"""The Gluon GEMM with the scatter epilogue of GEMM+ReduceScatter (EPILOGUE 1 of kernels/gemm.py, `fused`).

The producer warp and the K loop of kernels/gemm_gluon.py (BLOCK_M 128: two consumer warpgroups of 64 rows);
the epilogue stores each warpgroup's 64-row slab of the tile into its owners' partials buffers by TMA and
publishes finished 128-row blocks with the same flags as the @triton.jit kernel, so the owner-side reduction
(`reduce_partials_kernel`) and the host protocol are unchanged:

* owner ``o`` holds rows ``[o * rows_per_rank, (o + 1) * rows_per_rank)``; ``dst<o>`` is a host TMA
  descriptor of exactly this source's slab ``[rows_per_rank, N]`` in owner o's buffer, in [64, BLOCK_N] boxes.
  The owner of a slab's first row gets the slab by TMA (rows past its slab are clipped, so nothing lands in
  another source's slab); a slab that straddles owners gives each later owner its rows by masked stores from
  the registers through ``dst_ptrs`` (a TMA store at a negative row is an illegal instruction on an H100);
* counting, one tile late (as the @triton.jit kernel): a warpgroup waits until its previous tile's stores have
  read the staging tile (``store_wait(0)``, before reusing it) and have written every row
  (``cp.async.bulk.wait_group 0``), fences the async proxy, meets its warps at a barrier, and one thread adds
  1 to ``tile_counters[row_block]`` (acq_rel, scope sys). The arrival completing ``2 * num_col_blocks`` (every
  column tile, both warpgroups) zeroes the counter and writes the call's M into each covered owner's flag
  ``[src_rank, row_block - (o * rows_per_rank) // 128]`` (release, scope sys). Nothing waits inside the kernel;
* a split tail (kernels/gemm_gluon.py: the last partial wave's tiles cut by K, for a grid an sm_margin
  leaves short of whole waves): a split item stores and counts its fp32 partial; the last of a (tile,
  warpgroup)'s pieces sums them into the staging tile and scatters it as a whole tile's, so each tile is
  stored, and counted, once per warpgroup as before.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

from .gemm_gluon import _barrier, _count_partial, _k_loop, _load_kn, _load_nk, _staging_free, _sum_partials
from .gemm_gluon_ring import init_ring, invalidate_ring
from .gemm_gluon_walk import tile_coordinates as _tile_coordinates, work_item as _work_item
from .gemm_gluon_wait import init_chunk_barriers, invalidate_chunk_barriers

__all__ = ["gluon_scatter_gemm_kernel"]

ROWS = gl.constexpr(128)  # the tile's rows: one row-block flag (kernels/constants.py ROW_BLOCK_M)
WG_M = gl.constexpr(64)


@gluon.jit
def _publish(row_block, M, num_col_blocks, scatter_args):
    """Count this warpgroup's share of a tile of `row_block` (its stores complete); the last arrival releases
    the row block's flag on every owner its rows belong to."""
    rows_per_rank, src_rank, flag_ptrs, tile_counters, flags_per_source, _ = scatter_args
    threads: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    lane = gl.arange(0, 128, layout=threads)
    # the stores' writes complete (store_wait's `.read` form only waits for the staging tile to be read: the
    # flag could be seen before the rows landed), then the async proxy's view is ordered before the release
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, $1;", "=r,r",
                              [lane], dtype=gl.int32, is_pure=False, pack=1)
    _barrier()  # every warp's view of the completed stores precedes the single-thread release
    first = lane == 0
    counter = tile_counters + row_block + lane * 0
    before = gl.atomic_add(counter, lane * 0 + 1, mask=first, sem="acq_rel", scope="sys")
    if gl.max(gl.where(first, before, -1), axis=0) == 2 * num_col_blocks - 1:
        gl.atomic_xchg(counter, lane * 0, mask=first, sem="relaxed", scope="gpu")
        first_row = row_block * ROWS
        last_row = gl.minimum(first_row + ROWS, M) - 1
        for owner in range(first_row // rows_per_rank, last_row // rows_per_rank + 1):
            owner_flags = gl.load(flag_ptrs + owner + lane * 0).to(gl.pointer_type(gl.int32))
            index = src_rank * flags_per_source + row_block - (owner * rows_per_rank) // ROWS
            gl.atomic_xchg(owner_flags + index, lane * 0 + M, mask=first, sem="release", scope="sys")


@gluon.jit
def _store_owners(out_smem, dst_descs, first_row, first_col, M, rows_per_rank):
    """TMA-store the staged 64-row slab into the owner of its first row (module docstring)."""
    fence_async_shared()
    _barrier()  # every warp's rows are in the staging tile before the stores are issued
    first_owner = first_row // rows_per_rank
    for owner in gl.static_range(len(dst_descs)):
        if (first_row < M) & (first_owner == owner):
            tma.async_copy_shared_to_global(dst_descs[owner], [first_row - owner * rows_per_rank, first_col],
                                            out_smem)


@gluon.jit
def _store_later_owners(acc, out_smem, first_row, first_col, M, N, scatter_args):
    """The rows of a straddling slab past its first owner's: masked stores from the registers into each later
    owner's slab of this source (rare: at most one slab per owner boundary and column block)."""
    _store_rows(acc, out_smem, first_row, first_col, first_row // scatter_args[0] + 1, M, N, scatter_args)


@gluon.jit
def _store_rows(acc, out_smem, first_row, first_col, first_owner, M, N, scatter_args):
    """Masked stores of a 64-row slab `acc` (registers, stored in `out_smem`'s dtype) at (first_row, first_col)
    into the owners' slabs of this source, from owner `first_owner` to the owner of the slab's last row."""
    rows_per_rank, src_rank, _, _, _, dst_ptrs = scatter_args
    layout: gl.constexpr = acc.type.layout
    last_row = gl.minimum(first_row + WG_M, M) - 1
    rows = first_row + gl.arange(0, WG_M, layout=gl.SliceLayout(1, layout))
    cols = first_col + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, layout))
    values = acc.to(out_smem.dtype)
    for owner in range(first_owner, last_row // rows_per_rank + 1):
        lo = owner * rows_per_rank
        base = gl.load(dst_ptrs + owner).to(gl.pointer_type(out_smem.dtype))
        slot_rows = (src_rank * rows_per_rank + rows - lo).to(gl.int64)
        mask = gl.expand_dims((rows >= lo) & (rows < lo + rows_per_rank) & (rows < M), 1) & \
            gl.expand_dims(cols < N, 0)
        gl.store(base + gl.expand_dims(slot_rows * N, 1) + gl.expand_dims(cols, 0), values, mask=mask)


@gluon.jit
def _scatter_tile(values, out_smem, dst_descs, row_block, col_block, M, N, scatter_args, HALF: gl.constexpr):
    """Store this warpgroup's slab of a finished tile (`out_smem` holds it; `values` the same rows in registers,
    read only for a slab that straddles owners) into its owners. Returns the row block to count next (once
    the staging tile is free again, the stores are complete)."""
    BLOCK_N: gl.constexpr = dst_descs[0].block_type.shape[1]
    rows_per_rank = scatter_args[0]
    first_row = row_block * ROWS + HALF * WG_M
    _store_owners(out_smem, dst_descs, first_row, col_block * BLOCK_N, M, rows_per_rank)
    _store_later_owners(values, out_smem, first_row, col_block * BLOCK_N, M, N, scatter_args)
    return row_block


@gluon.jit
def _scatter_partition(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args,
                       split_args, HALF: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """One consumer warpgroup: rows [HALF * 64, HALF * 64 + 64) of every work item (whole tiles, then the split
    tail's K pieces as kernels/gemm_gluon.py walks them), each finished tile scattered to its owners."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = dst_descs[0].block_type.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_row_blocks = gl.cdiv(M, ROWS)
    num_col_blocks = gl.cdiv(N, BLOCK_N)
    num_k = gl.cdiv(K, BLOCK_K)
    num_whole_tiles, splits, workspace, counters = split_args
    num_items = num_whole_tiles + (num_row_blocks * num_col_blocks - num_whole_tiles) * splits
    out_smem = c_smem.index(HALF)
    pending = gl.program_id(0) * 0 - 1
    step = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        tile_id, first_k, end_k, unit = _work_item(item, num_whole_tiles, splits, num_k)
        row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        acc = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
        acc = _k_loop(a_bufs, b_bufs, ready, empty, acc, end_k - first_k, step, HALF, B_TRANSPOSED)
        step += end_k - first_k
        if unit < 0:
            _staging_free()  # the previous tile's stores are complete: count it now
            if pending >= 0:
                _publish(pending, M, num_col_blocks, scatter_args)
            out_smem.store(acc.to(out_smem.dtype))
            pending = _scatter_tile(acc, out_smem, dst_descs, row_block, col_block, M, N, scatter_args, HALF)
        elif _count_partial(acc, unit, tile_id, num_whole_tiles, splits, workspace, counters, HALF, 2):
            _staging_free()
            if pending >= 0:
                _publish(pending, M, num_col_blocks, scatter_args)
            _sum_partials(workspace, (unit - unit % splits) * 2 + HALF, splits, out_smem, WG_M, BLOCK_N, 2)
            _barrier()  # every warp's columns are in the staging tile before any thread reads rows of it back
            pending = _scatter_tile(out_smem.load(mma_layout), out_smem, dst_descs, row_block, col_block, M, N,
                                    scatter_args, HALF)
    _staging_free()
    if pending >= 0:
        _publish(pending, M, num_col_blocks, scatter_args)


@gluon.jit
def _scatter0_kn(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args,
                 split_args):
    _scatter_partition(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args,
                       split_args, 0, False)


@gluon.jit
def _scatter1_kn(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args,
                 split_args):
    _scatter_partition(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args,
                       split_args, 1, False)


@gluon.jit
def _scatter0_nk(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args,
                 split_args):
    _scatter_partition(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args,
                       split_args, 0, True)


@gluon.jit
def _scatter1_nk(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args,
                 split_args):
    _scatter_partition(a_bufs, b_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args,
                       split_args, 1, True)


@gluon.jit(do_not_specialize=["M", "tile_row_offset", "rows_per_rank", "src_rank", "num_whole_tiles", "splits"])
def gluon_scatter_gemm_kernel(a_desc, b_desc, dst0, dst1, dst2, dst3, dst4, dst5, dst6, dst7, M, N, K,
                              tile_row_offset, num_whole_tiles, splits, workspace, counters, rows_per_rank, src_rank,
                              flag_ptrs, tile_counters, flags_per_source, dst_ptrs, chunk_args,
                              NUM_STAGES: gl.constexpr, B_TRANSPOSED: gl.constexpr, LOAD_REGS: gl.constexpr = 40):
    """A [M, K] @ B scattered to the owners (module docstring): ``dst<o>`` owner o's descriptor, any descriptor
    past the group (never stored to; the launcher cannot pass descriptors inside a tuple, and a None among a
    partition's arguments does not compile); ``dst_ptrs`` int64 [W] the owners' partials
    buffers [W, rows_per_rank, N] (for straddling slabs); ``chunk_args`` are kernels/gemm_gluon_wait.py's
    with 0 chunks per rank (the producer warp is gemm_gluon.py's); ``num_whole_tiles``, ``splits``,
    ``workspace`` and ``counters`` the split tail's, as kernels/gemm_gluon.py takes them (``splits == 1``: every
    tile whole, ``num_whole_tiles`` = cdiv(M, 128) * cdiv(N, BLOCK_N))."""
    dst_descs = (dst0, dst1, dst2, dst3, dst4, dst5, dst6, dst7)
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = dst_descs[0].block_type.shape[1]
    gl.static_assert(a_desc.block_type.shape[0] == ROWS, "A in [128, BLOCK_K] boxes: two consumer warpgroups")
    gl.static_assert(dst_descs[0].block_type.shape[0] == WG_M, "the partials in 64-row boxes, one per consumer")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one warpgroup")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, ROWS, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dst_descs[0].dtype, [2, WG_M, BLOCK_N], dst_descs[0].layout)
    ready, empty = init_ring(NUM_STAGES, 2)  # one `empty` arrival per consumer warpgroup
    chunks_ok, chunks_free = init_chunk_barriers()  # the producer's arguments; no waits (0 chunks per rank)
    fence_async_shared()

    scatter_args = (rows_per_rank, src_rank, flag_ptrs, tile_counters, flags_per_source, dst_ptrs)
    split_args = (num_whole_tiles, splits, workspace, counters)
    mma_args = (a_bufs, b_bufs, ready, empty, dst_descs, c_smem, M, N, K, tile_row_offset, scatter_args, split_args)
    load_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles, splits,
                 chunk_args, chunks_ok, chunks_free)
    if B_TRANSPOSED:
        gl.warp_specialize([(_scatter0_nk, mma_args), (_scatter1_nk, mma_args), (_load_nk, load_args)], [4, 1],
                           [232, LOAD_REGS])
    else:
        gl.warp_specialize([(_scatter0_kn, mma_args), (_scatter1_kn, mma_args), (_load_kn, load_args)], [4, 1],
                           [232, LOAD_REGS])
    invalidate_ring(ready, empty)
    invalidate_chunk_barriers(chunks_ok, chunks_free)
