"""The ReduceScatter side of the persistent GEMM: tile walks and epilogues, and the owner-side reduction.

Only ``@triton.jit`` code. ``kernels/gemm.py`` documents the epilogues (EPILOGUE 1: scatter every tile to its
owner and release a flag per finished row block; EPILOGUE 2: the same for the other owners' rows, then the
own rows reduced in the epilogue); this module holds their device code so that the GEMM file stays one kernel.

``reduce_partials_kernel`` runs on owner o (a small persistent grid, e.g. 16 programs, so it leaves SMs
to the GEMM). For each owner-local tile it waits (``waits`` given) until, for every source and every GEMM
row block overlapping the tile's rows, the device flag is SET (acquire, scope sys); then it sums the
``world_size`` partials in fp32 and stores into ``out`` [rows_per_rank, N] (row stride ``ld_out``)::

    reduce_partials_kernel[(programs,)](
        partials, out, rows_per_rank, N, ld_out, world_size, owner_rank,
        (flags, flags_per_source, error, error_code_base, timeout_ns),   # or None: no waits
        BLOCK_M=..., BLOCK_N=..., GEMM_BLOCK_M=..., USE_TIMER=True)

The awaited value is the call's M (``rows_per_rank * world_size``, what the scatter epilogue stores). It
never resets the flags (several tiles read one): the launcher does, after the kernel. An expired wait (or a
flag at another nonzero value) stores ``error_code_base + src * flags_per_source + flag`` into the control
page ``error``, and that tile is skipped; ``out`` is then incomplete and the host raises. Compile and warm
both kernels on every rank before the first cross-rank wait, so that JIT time does not eat into ``timeout_ns``.
"""

import triton
import triton.language as tl

from .flags import TIMER_AVAILABLE, await_flag
from .gemm_mainloop import grouped_tile


@triton.jit
def owner_last_tile(tile_id, num_row_blocks, num_col_blocks, own_first_row_block, own_row_blocks,
                    GROUP_M: tl.constexpr):
    """EPILOGUE 2's walk: the other owners' row blocks first (from the next owner on, wrapping), each
    segment swizzled on its own, so that no group mixes own and other rows."""
    other_row_blocks = num_row_blocks - own_row_blocks
    other_tiles = other_row_blocks * num_col_blocks
    if tile_id < other_tiles:
        row, col_block = grouped_tile(tile_id, other_row_blocks, num_col_blocks, GROUP_M)
        row_block = (own_first_row_block + own_row_blocks + row) % num_row_blocks
    else:
        row, col_block = grouped_tile(tile_id - other_tiles, own_row_blocks, num_col_blocks, GROUP_M)
        row_block = own_first_row_block + row
    return row_block, col_block


@triton.jit
def scatter_stores(result, rows, cols, first_row, M, N, rows_per_rank, src_rank, dst_ptrs, BLOCK_M: tl.constexpr):
    """Store a finished tile into its owners' buffers (NVLink stores for other owners). Not yet counted:
    `publish_row_block` does that, one tile later (see persistent_gemm_kernel)."""
    out_dtype: tl.constexpr = result.dtype
    # One store per owner the tile covers (two when rows_per_rank % BLOCK_M != 0), each from a scalar base:
    # a per-row pointer tensor doubled the GEMM time. The alignment hint (the buffers are 16-byte aligned
    # allocations) is what lets the stores vectorise.
    last_row = tl.minimum(first_row + BLOCK_M, M) - 1
    col_in_range = (cols < N)[None, :]
    for store_owner in range(first_row // rows_per_rank, last_row // rows_per_rank + 1):
        owner_base = tl.multiple_of(tl.load(dst_ptrs + store_owner).to(tl.pointer_type(out_dtype)), 16)
        owner_first_row = store_owner * rows_per_rank
        in_owner = (rows >= owner_first_row) & (rows < owner_first_row + rows_per_rank) & (rows < M)
        dst_row = (src_rank * rows_per_rank - owner_first_row + rows).to(tl.int64)
        tl.store(owner_base + dst_row[:, None] * N + cols[None, :], result, mask=in_owner[:, None] & col_in_range)


@triton.jit
def publish_row_block(row_block, M, rows_per_rank, src_rank, scatter, num_col_blocks, BLOCK_M: tl.constexpr):
    """Count one tile of `row_block` whose stores this program issued earlier; the row block's last tile
    releases the flags of every owner its rows belong to, with the call's M."""
    _, flag_ptrs, tile_counters_ptr, flags_per_source, _, _, _ = scatter
    # Every thread's stores must precede the single-thread release below.
    tl.debug_barrier()
    counter = tile_counters_ptr + row_block
    tiles_done_before = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")
    if tiles_done_before == num_col_blocks - 1:
        # Last column tile of this row block in this launch: the acquire above made all other programs'
        # stores for the row block visible to us, so our release publishes them too.
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        first_row = row_block * BLOCK_M
        last_row = tl.minimum(first_row + BLOCK_M, M) - 1
        for flag_owner in range(first_row // rows_per_rank, last_row // rows_per_rank + 1):
            owner_flags = tl.load(flag_ptrs + flag_owner).to(tl.pointer_type(tl.int32))
            flag_index = src_rank * flags_per_source + row_block - (flag_owner * rows_per_rank) // BLOCK_M
            tl.atomic_xchg(owner_flags + flag_index, M, sem="release", scope="sys")


@triton.jit
def reduce_own_tile(acc, rows, cols, local_row_block, M, N, ldc, c_ptr, scatter, rows_per_rank, src_rank, failed,
                    USE_TIMER: tl.constexpr):
    """EPILOGUE 2, own rows: wait for every other source's partial of this row block (its flag holds the
    call's M), add them to the fp32 accumulator, store the sum into C (the output shard). Returns False
    (nothing stored) if a wait expired."""
    dst_ptrs, flag_ptrs, _, flags_per_source, error_ptr, error_code_base, timeout_ns = scatter
    out_dtype: tl.constexpr = c_ptr.dtype.element_ty
    world_size = M // rows_per_rank
    own_flags = tl.load(flag_ptrs + src_rank).to(tl.pointer_type(tl.int32))
    arrived = not failed  # a wait of this program already expired: skip its remaining own tiles
    for src in range(world_size):
        if arrived & (src != src_rank):
            flag_index = src * flags_per_source + local_row_block
            arrived = await_flag(own_flags + flag_index, M, error_ptr, error_code_base + flag_index, timeout_ns,
                                 USE_TIMER)
    # Order the other threads' partial loads after the single-thread acquire.
    tl.debug_barrier()
    if arrived:
        own_slots = tl.multiple_of(tl.load(dst_ptrs + src_rank).to(tl.pointer_type(out_dtype)), 16)
        local_rows = rows - src_rank * rows_per_rank
        mask = (local_rows < rows_per_rank)[:, None] & (cols < N)[None, :]
        offsets = local_rows.to(tl.int64)[:, None] * N + cols[None, :]
        source_stride = rows_per_rank.to(tl.int64) * N
        for src in range(world_size):
            if src != src_rank:
                acc += tl.load(own_slots + src * source_stride + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptr + local_rows.to(tl.int64)[:, None] * ldc + cols[None, :], acc.to(out_dtype), mask=mask)
    return arrived


@triton.jit(do_not_specialize=["rows_per_rank", "owner_rank"])
def reduce_partials_kernel(
    partials_ptr, out_ptr, rows_per_rank, N, ld_out, world_size, owner_rank, waits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GEMM_BLOCK_M: tl.constexpr,
    USE_TIMER: tl.constexpr = TIMER_AVAILABLE,
):
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    num_row_blocks = tl.cdiv(rows_per_rank, BLOCK_M)
    num_col_blocks = tl.cdiv(N, BLOCK_N)
    num_tiles = num_row_blocks * num_col_blocks
    source_stride = rows_per_rank.to(tl.int64) * N
    owner_first_row = owner_rank * rows_per_rank
    owner_first_gemm_block = owner_first_row // GEMM_BLOCK_M

    for tile_id in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        row_block = tile_id // num_col_blocks
        col_block = tile_id % num_col_blocks
        first_row = row_block * BLOCK_M
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)

        all_arrived = tile_id >= 0
        if waits is not None:
            flags_ptr, flags_per_source, error_ptr, error_code_base, timeout_ns = waits
            # The GEMM flags whole GEMM row blocks; this tile may overlap two of them.
            last_row = tl.minimum(first_row + BLOCK_M, rows_per_rank) - 1
            first_flag = (owner_first_row + first_row) // GEMM_BLOCK_M - owner_first_gemm_block
            last_flag = (owner_first_row + last_row) // GEMM_BLOCK_M - owner_first_gemm_block
            for src in range(world_size):
                for flag_index in range(first_flag, last_flag + 1):
                    if all_arrived:
                        word = src * flags_per_source + flag_index
                        all_arrived = await_flag(flags_ptr + word, rows_per_rank * world_size, error_ptr,
                                                 error_code_base + word, timeout_ns, USE_TIMER)
            # Order the other threads' partial loads after the single-thread acquire.
            tl.debug_barrier()

        if all_arrived:
            mask = (rows < rows_per_rank)[:, None] & (cols < N)[None, :]
            offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for src in range(world_size):
                total += tl.load(partials_ptr + src * source_stride + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * ld_out + cols[None, :], total.to(out_dtype),
                     mask=mask)
