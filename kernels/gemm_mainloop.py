"""The K loop, the local tile store and the stream-K part of the persistent GEMM (``kernels/gemm.py``).

Only ``@triton.jit`` code. Kept apart from the epilogues so that the data-parallel walk of
``persistent_gemm_kernel`` and its stream-K part run the same loads and the same ``tl.dot``.

Stream-K (``STREAM_K=True`` in ``persistent_gemm_kernel``, local epilogue only): the last
``stream_k_tiles`` tiles of the walk are not given whole to programs; their K steps are laid end to end
(``stream_k_tiles * cdiv(K, BLOCK_K)`` steps) and every program takes an equal contiguous share, so a
last wave of 60 tiles on 132 programs costs ~0.45 tile per program instead of a whole tile. A tile cut
between programs is finished by the program holding its last K step (the "finisher"): the others
("contributors") store their fp32 partial tile in ``workspace[program]`` and then add 1 to
``flags[program]`` (release); the finisher waits for each contributor's flag (acquire, bounded by
``timeout_ns``), adds the partial, and subtracts 1 again, so the flags are back at 0 when the kernel ends
(no epoch to pass: CUDA-graph replays see the same zeros). A program takes at most one partial (the head
of the last tile of its share), hence one workspace slot and one flag per program. Each program does its
contributing segment first and its finishing segment last, so no finisher waits for a contributor that is
itself waiting. A contributor that is late past ``timeout_ns`` (a grid larger than the SMs left free by
another kernel) is not an error: the finisher computes that K range itself, and the late contributor's
+1 brings the flag back from -1 to 0.

Memory ordering: a contributor's threads store the partial, meet at a CTA barrier, then one thread adds
1 with release semantics at GPU scope (cumulative over the stores the barrier ordered before it); the
finisher's poll is an acquire at GPU scope by one thread whose result every thread reads after a CTA
barrier, so each thread's loads of the partial come after it. The decision to stop waiting must be the
same in every thread of the finisher: its branches hold warpgroup-wide MMAs and CTA barriers. The poll's
value is broadcast (one thread polls, all read it) and the bound's clock is reduced over the program
(``tp_overlap.kernels.flags.wait_for_count``), never read by each thread for itself: with per-thread
``%globaltimer`` reads, warps crossed the bound at different polls, took different branches and
desynchronised their barriers (the wrong tiles of the late-contributor check on the GPU).
"""

import triton
import triton.language as tl

from .flags import SET_FLAG, await_flag, wait_for_count

__all__ = ["WIDEN_DOT_OPERANDS", "COMPILED", "grouped_tile", "tile_coordinates", "wait_for_chunks", "k_loop",
           "store_tile", "stream_k_part"]

# Triton 3.6's interpreter multiplies bf16 tiles as their raw uint16 bits in tl.dot; under the
# interpreter only, operands are widened to fp32 first. Compiled kernels never see this branch.
WIDEN_DOT_OPERANDS = tl.constexpr(bool(triton.knobs.runtime.interpret))
COMPILED = tl.constexpr(not triton.knobs.runtime.interpret)  # inline PTX (the proxy fence) needs a compiled kernel


@triton.jit
def grouped_tile(local_tile, num_row_blocks, num_col_blocks, GROUP_M: tl.constexpr):
    """(row block, column block) of tile ``local_tile`` in a GROUP_M-swizzled walk of ``num_row_blocks``
    rows: column-major inside each group of GROUP_M row blocks, the groups in order."""
    tiles_per_group = GROUP_M * num_col_blocks
    first_row_block = (local_tile // tiles_per_group) * GROUP_M
    rows_in_group = tl.minimum(num_row_blocks - first_row_block, GROUP_M)
    index_in_group = local_tile % tiles_per_group
    return first_row_block + index_in_group % rows_in_group, index_in_group // rows_in_group


@triton.jit
def tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset, GROUP_M: tl.constexpr):
    # GROUP_M row blocks share each B column panel while it is hot in L2; the rotation afterwards keeps
    # the order a permutation while letting every rank begin at its own row block.
    swizzled_row_block, col_block = grouped_tile(tile_id, num_row_blocks, num_col_blocks, GROUP_M)
    row_block = (swizzled_row_block + tile_row_offset) % num_row_blocks
    return row_block, col_block


@triton.jit
def wait_for_chunks(chunk_wait, first_row, last_row, rows_per_rank, rows_per_chunk, USE_TIMER: tl.constexpr):
    """True when every gathered chunk holding rows [first_row, last_row] is SET (bounded waits; an expired or
    disagreeing one is recorded as ``error_code_base + chunk``). ``chunk_wait`` is (chunk_flags_ptr,
    chunks_per_rank, error_ptr, error_code_base, timeout_ns); the flags are owner-major."""
    chunk_flags_ptr, chunks_per_rank, error_ptr, error_code_base, timeout_ns = chunk_wait
    first_chunk = (first_row // rows_per_rank) * chunks_per_rank + (first_row % rows_per_rank) // rows_per_chunk
    last_chunk = (last_row // rows_per_rank) * chunks_per_rank + (last_row % rows_per_rank) // rows_per_chunk
    ready = first_row >= 0
    for chunk in range(first_chunk, last_chunk + 1):
        # An owner's trailing chunks can be empty (e.g. 9 rows in 4 chunks of 3); nobody needs to signal those.
        if ready & ((chunk % chunks_per_rank) * rows_per_chunk < rows_per_rank):
            ready = await_flag(chunk_flags_ptr + chunk, SET_FLAG, error_ptr, error_code_base + chunk, timeout_ns,
                               USE_TIMER)
    # The acquire above ran on one thread: order every thread's A loads after it, then (compiled code only)
    # order this thread's generic-proxy view before its async-proxy (TMA) loads of A.
    tl.debug_barrier()
    if COMPILED:
        tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
    return ready


@triton.jit
def k_loop(acc, a_desc, b_desc, a_ptr, b_ptr, first_row, first_col, M, N, K, lda, ldb, first_k_step, end_k_step,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DESCRIPTORS: tl.constexpr,
           B_TRANSPOSED: tl.constexpr):
    """acc + A[rows, ks] @ B[ks, cols] over K steps [first_k_step, end_k_step) of the tile at (first_row,
    first_col). Descriptors read zeros out of bounds; the pointer path masks."""
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = first_col + tl.arange(0, BLOCK_N)
    for k_step in range(first_k_step, end_k_step):
        first_k = k_step * BLOCK_K
        if USE_DESCRIPTORS:
            a_tile = a_desc.load([first_row, first_k])
            if B_TRANSPOSED:
                b_tile = b_desc.load([first_col, first_k]).T
            else:
                b_tile = b_desc.load([first_k, first_col])
        else:
            ks = first_k + tl.arange(0, BLOCK_K)
            k_in_range = ks < K
            a_tile = tl.load(a_ptr + rows.to(tl.int64)[:, None] * lda + ks[None, :],
                             mask=(rows < M)[:, None] & k_in_range[None, :], other=0.0)
            if B_TRANSPOSED:
                b_tile = tl.load(b_ptr + cols.to(tl.int64)[None, :] * ldb + ks[:, None],
                                 mask=k_in_range[:, None] & (cols < N)[None, :], other=0.0)
            else:
                b_tile = tl.load(b_ptr + ks.to(tl.int64)[:, None] * ldb + cols[None, :],
                                 mask=k_in_range[:, None] & (cols < N)[None, :], other=0.0)
        if WIDEN_DOT_OPERANDS:
            a_tile = a_tile.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        acc = tl.dot(a_tile, b_tile, acc)
    return acc


@triton.jit
def store_tile(c_desc, c_ptr, result, first_row, first_col, M, N, ldc, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, USE_DESCRIPTORS: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr):
    """Local store of a finished tile (already in C's dtype). EPILOGUE_SUBTILE = 2 stores two [BLOCK_M,
    BLOCK_N / 2] halves through a descriptor of that block shape: half the shared-memory staging buffer,
    which can pay for one more pipeline stage."""
    if USE_DESCRIPTORS:
        if EPILOGUE_SUBTILE == 2:
            halves = tl.permute(tl.reshape(result, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([first_row, first_col], left)
            c_desc.store([first_row, first_col + BLOCK_N // 2], right)
        else:
            c_desc.store([first_row, first_col], result)
    else:
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = first_col + tl.arange(0, BLOCK_N)
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * ldc + cols[None, :], result,
                 mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _add_partial(acc, partial_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc + the [BLOCK_M, BLOCK_N] fp32 tile at partial_ptr, added one column quarter at a time: a whole
    loaded tile (and its pointers) next to the accumulator does not fit in registers (ptxas spilled at
    128x256 / 8 warps and 128x128 / 4 warps)."""
    QUARTER: tl.constexpr = BLOCK_N // 4
    # column = half * BLOCK_N / 2 + quarter * BLOCK_N / 4 + r, split off as the two trailing dims
    parts = tl.permute(tl.reshape(acc, (BLOCK_M, 2, 2, QUARTER)), (0, 3, 1, 2))
    even_quarters, odd_quarters = tl.split(parts)
    q00, q10 = tl.split(even_quarters)
    q01, q11 = tl.split(odd_quarters)
    offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, QUARTER)[None, :]
    q00 += tl.load(partial_ptr + offsets)
    q01 += tl.load(partial_ptr + QUARTER + offsets)
    q10 += tl.load(partial_ptr + 2 * QUARTER + offsets)
    q11 += tl.load(partial_ptr + 3 * QUARTER + offsets)
    parts = tl.join(tl.join(q00, q10), tl.join(q01, q11))
    return tl.reshape(tl.permute(parts, (0, 2, 3, 1)), (BLOCK_M, BLOCK_N))


@triton.jit
def _share(program, num_programs, total_steps):
    """First K step (of the stream-K region) of `program`'s equal share."""
    return tl.cast(tl.cast(program, tl.int64) * total_steps // num_programs, tl.int32)


@triton.jit
def stream_k_part(a_desc, b_desc, c_desc, a_ptr, b_ptr, c_ptr, M, N, K, lda, ldb, ldc, tile_row_offset,
                  first_tile, num_sk_tiles, workspace_ptr, flags_ptr, timeout_ns, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, USE_DESCRIPTORS: tl.constexpr,
                  B_TRANSPOSED: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, USE_TIMER: tl.constexpr):
    """Tiles [first_tile, first_tile + num_sk_tiles) of the walk, split by K steps over all programs (see
    the module docstring)."""
    out_dtype: tl.constexpr = c_ptr.dtype.element_ty
    program = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_row_blocks = tl.cdiv(M, BLOCK_M)
    num_col_blocks = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    total_steps = num_sk_tiles * k_steps
    share_start = _share(program, num_programs, total_steps)
    share_end = _share(program + 1, num_programs, total_steps)
    tile_elements = BLOCK_M * BLOCK_N
    offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    # Segments from the end of the share backwards: the contributing head of the last tile first.
    segment_end = share_end
    while segment_end > share_start:
        tile = (segment_end - 1) // k_steps
        tile_start = tile * k_steps
        segment_start = tl.maximum(share_start, tile_start)
        row_block, col_block = tile_coordinates(first_tile + tile, num_row_blocks, num_col_blocks,
                                                tile_row_offset, GROUP_M)
        first_row = row_block * BLOCK_M
        first_col = col_block * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = k_loop(acc, a_desc, b_desc, a_ptr, b_ptr, first_row, first_col, M, N, K, lda, ldb,
                     segment_start - tile_start, segment_end - tile_start, BLOCK_M, BLOCK_N, BLOCK_K,
                     USE_DESCRIPTORS, B_TRANSPOSED)
        if segment_end == tile_start + k_steps:
            # Finisher: the programs before this one that hold the tile's earlier steps contributed.
            first_contributor = (tl.cast(tile_start + 1, tl.int64) * num_programs - 1) // total_steps
            for contributor in range(tl.cast(first_contributor, tl.int32), program):
                start = tl.maximum(_share(contributor, num_programs, total_steps), tile_start)
                end = _share(contributor + 1, num_programs, total_steps)
                if end > start:  # programs with an empty share (fewer steps than programs) hold nothing
                    arrived = wait_for_count(flags_ptr + contributor, 1, timeout_ns, USE_TIMER)
                    # the acquire ran on one thread: order every thread's workspace loads after it
                    tl.debug_barrier()
                    if arrived:
                        acc = _add_partial(acc, workspace_ptr + tl.cast(contributor, tl.int64) * tile_elements,
                                           BLOCK_M, BLOCK_N)
                    else:
                        acc = k_loop(acc, a_desc, b_desc, a_ptr, b_ptr, first_row, first_col, M, N, K, lda, ldb,
                                     start - tile_start, end - tile_start, BLOCK_M, BLOCK_N, BLOCK_K,
                                     USE_DESCRIPTORS, B_TRANSPOSED)
                    tl.atomic_add(flags_ptr + contributor, -1, sem="relaxed", scope="gpu")
            store_tile(c_desc, c_ptr, acc.to(out_dtype), first_row, first_col, M, N, ldc, BLOCK_M, BLOCK_N,
                       USE_DESCRIPTORS, EPILOGUE_SUBTILE)
        else:
            tl.store(workspace_ptr + tl.cast(program, tl.int64) * tile_elements + offsets, acc)
            # every thread's partial stores before the single-thread release
            tl.debug_barrier()
            tl.atomic_add(flags_ptr + program, 1, sem="release", scope="gpu")
        segment_end = segment_start
