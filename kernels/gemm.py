"""Persistent Triton GEMM with a local or a scatter-to-owners epilogue, and the owner-side reduction.

Only ``@triton.jit`` code and tiny pure helpers live here; validation, pools, streams and the
allocator belong to the launcher.

``persistent_gemm_kernel`` computes ``C[M, N] = A[M, K] @ B[K, N]`` (bf16/fp16 in, fp32 accumulation,
output in C's dtype).

    grid = (num_programs,)            # num_sms - sm_margin; each program walks tiles pid, pid + num_programs, ...
    persistent_gemm_kernel[grid](
        a, b, c, M, N, K, (lda, ldb, ldc), tile_row_offset, rows_per_rank, src_rank,
        scatter,      # EPILOGUE_SCATTER(_REDUCE): (dst_ptrs, flag_ptrs, tile_counters, flags_per_source,
                      #                              error_ptr, error_code_base, timeout_ns); else None
        chunk_wait,   # the AllGather consumer: (chunk_flags_ptr, chunks_per_rank, error_ptr, error_code_base,
                      #                          timeout_ns); else None
        stream_k,     # STREAM_K_WAVES > 0: (workspace, flags, timeout_ns); else None
        scales,       # the FP8 GEMM (kernels/gemm_fp8.py): (a_scales, b_scales, a_scale_stride_m,
                      #     a_scale_stride_k, b_scale_stride_n, b_scale_stride_k); else None
        CONFIG=GemmConfig(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EPILOGUE=EPILOGUE_LOCAL, USE_DESCRIPTORS=True,
                          B_TRANSPOSED=False, WARP_SPECIALIZE=False, FLATTEN=False, EPILOGUE_SUBTILE=1,
                          STREAM_K_WAVES=0, USE_TIMER=<not under the interpreter>),
        num_warps=..., num_stages=...)

Each tuple groups what one feature reads. Triton specialises the ints inside tuples (a value of 1 becomes a
constant), so only values fixed for an op live there; M and the rank-dependent ints are separate arguments,
excluded from specialisation so that they never recompile. Below, ``WAIT_CHUNKS`` means ``chunk_wait`` is
given, ``STREAM_K`` that ``STREAM_K_WAVES > 0``, EPILOGUE 0/1/2 the constants EPILOGUE_LOCAL, EPILOGUE_SCATTER
and EPILOGUE_SCATTER_REDUCE.

* A is [M, K] with row stride ``lda``; B is [K, N] with row stride ``ldb`` or, with ``B_TRANSPOSED``,
  [N, K] with row stride ``ldb`` (an ``nn.Linear`` weight, no copy needed). Last strides must be 1.
* Flags are toggles (overlap/ops/protocol.py): a writer stores a nonzero value (SET for the chunk flags,
  the call's M for the scatter epilogues' row-block flags), a waiter waits until it
  reads it; the launcher resets them with stream memory operations after the kernel. ``error_ptr`` is the
  pool's control page [code, value, abort, seen]: an expired wait stores ``error_code_base + <flag index>``,
  a row-block flag at another nonzero value (a peer with another M) the same code with MISMATCH_BIT and the
  two values, and a wait ends early when the abort word is set (another rank gave up).
* ``USE_DESCRIPTORS=True`` loads A and B (and stores C in epilogue 0) through ``tl.make_tensor_descriptor``
  (TMA on Hopper; out-of-bounds loads read zero, so M/N/K tails are free). It requires 16-byte-aligned
  base pointers and row strides (bf16/fp16: multiples of 8 elements) and, on the GPU, an allocator for
  the descriptors' global scratch, set once per process before the first launch::

      triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))

  ``USE_DESCRIPTORS=False`` is the masked-pointer fallback for unaligned shapes (much slower on GPU).
* Tile order: row block ``(r + tile_row_offset) % num_row_blocks`` where ``r`` walks the row blocks in
  GROUP_M-swizzled order, so each rank can start at the rows it needs first. The swizzle only reorders
  tiles inside a group of GROUP_M consecutive ``r`` (column-major there, to reuse B panels in L2); the
  groups themselves come in order, so the row-block walk is rotated row-major at group granularity:
  ``tile_row_offset``, ``tile_row_offset + 1``, ..., ``num_row_blocks - 1``, ``0``, ...,
  ``tile_row_offset - 1``, at most GROUP_M row blocks in flight ahead of that order.

EPILOGUE 0 (local): stores the tile into C (row stride ``ldc``). ``dst_ptrs``, ``flag_ptrs`` and
``tile_counters`` may be None; the scatter ints are ignored (pass 0).

Tuning options of EPILOGUE 0 (all off by default; the K loop and stores live in ``kernels/gemm_mainloop.py``):

* ``FLATTEN=True`` flattens the tile loop and the K loop into one pipelined loop (``tl.range(flatten=True)``),
  so the next tile's first loads overlap this tile's epilogue: pays where K is short.
* ``EPILOGUE_SUBTILE=2`` stores each tile as two column halves (half the staging shared memory).
* ``STREAM_K=True``: the last ``stream_k_tiles`` tiles of the walk are split by K steps over all programs
  (a last wave that would leave SMs idle); ``stream_k_workspace`` is an fp32 buffer of ``num_programs *
  BLOCK_M * BLOCK_N`` elements and ``stream_k_flags`` an int32 array of ``num_programs`` words, zero before
  the first launch (every launch leaves them at zero again); both private to one stream at a time.
  ``timeout_ns`` bounds a finisher's wait for a contributor (past it, the finisher recomputes that K range
  itself).
  Protocol in ``kernels/gemm_mainloop.py``.

EPILOGUE 1 (scatter to owners): the M rows are split into ``world_size`` owner chunks of
``rows_per_rank`` rows (M = world_size * rows_per_rank); row ``m`` belongs to owner ``o = m //
rows_per_rank``. ``dst_ptrs`` is an int64 tensor of ``world_size`` data pointers; ``dst_ptrs[o]`` is
owner o's contiguous partials buffer [world_size, rows_per_rank, N] in C's dtype, and row m is stored
at ``[src_rank, m - o * rows_per_rank, :]``. ``c`` is only used for its dtype (pass the own buffer).
A tile straddling owners (rows_per_rank % BLOCK_M != 0) is stored once per owner, masked by rows.
Every buffer in ``dst_ptrs`` must be 16-byte aligned (the kernel tells the compiler so, to vectorise).

Completion protocol (toggle flags, last-tile detection, robust to M changing between calls):

* ``tile_counters`` is a LOCAL int32 array of at least ``cdiv(M, BLOCK_M)`` words, zero before the
  first launch. After a tile's stores have been issued, the program adds 1 to ``tile_counters[row_block]``
  (acq_rel) -- deferred until after its next tile's main loop (or the end of its walk), so that the
  release fence finds the stores already landed; EPILOGUE 2 counts before any of its own waits;
  the program that completes the row block's last column tile resets the word to 0 (so it is zero
  again for the next launch, which is stream-ordered after this one) and, for every owner o whose
  rows the row block covers, writes M (the call's M) with ``atomic_xchg(sem="release", scope="sys")`` into
  ``flag_ptrs[o]`` (an int32 array [world_size, flags_per_source] on owner o) at
  ``[src_rank, row_block - (o * rows_per_rank) // BLOCK_M]``.
* ``flags_per_source >= scatter_flags_per_source(rows_per_rank, BLOCK_M)``; the owner resets its flags to 0
  after reading them, before it lets the sources write its slots again. A flag that holds the value means every
  column tile of that row block has been stored by that source in this call.

WAIT_CHUNKS (the AllGather consumer, "fused" AG+GEMM; normally with EPILOGUE 0, but both epilogues work):
A [M, K] is being gathered while the kernel runs. It is made of owner blocks of ``rows_per_rank`` rows
(owner ``o`` holds rows ``[o * rows_per_rank, (o + 1) * rows_per_rank)``); each owner block is split into
``chunks_per_rank`` chunks of ``rows_per_chunk = cdiv(rows_per_rank, chunks_per_rank)`` rows (the last
chunk of an owner may be shorter, or even empty: no row maps to it and its flag is never read). Row r is in
chunk ``(r // rows_per_rank) * chunks_per_rank + (r % rows_per_rank) // rows_per_chunk``
(``ag_chunk_index`` in kernels/constants.py; ``ag_chunk_rows`` gives a chunk's rows). ``chunk_flags_ptr`` is a
LOCAL int32 array with one flag per chunk (owner-major: index = owner * chunks_per_rank + chunk of that owner,
NOT arrival order), written by whoever finishes the chunk's copy (release, e.g. a release-store kernel or a
stream write after the copy-engine copy). Before a tile's K loop reads A rows ``[m0, min(m0 + BLOCK_M, M))``,
the program polls (acquire, scope sys) every chunk flag from the first row's chunk to the last row's chunk
until it is SET, each wait bounded by ``timeout_ns`` (below); the waits are per tile, before any
load of the tile. On expiry it stores ``error_code_base + chunk index`` into the control page (unless a
failure is there already) and that program skips its remaining tiles. The output is then incomplete (C
keeps whatever it held: poison it or ignore it); the pool's watchdog sees the code, aborts the group, and
the host raises on every rank.
For EPILOGUE 1 a skipped tile also never bumps its tile counter, so neither its flags nor the counters
are valid afterwards (reset the counters before reusing them after a failure).
Tile order for the AllGather: pass ``tile_row_offset = ag_tile_row_offset(rank, rows_per_rank, BLOCK_M)``
(``cdiv(rank * rows_per_rank, BLOCK_M)``): the walk starts at the first row block that begins at or after
the first local row, so it goes local rows, then owners rank + 1, rank + 2, ... (ring arrival order),
and the row block straddling owners rank - 1 and rank (it needs rank - 1's last chunk, the last to
arrive) comes last. ``(rank * rows_per_rank) // BLOCK_M`` also works but, when ``rows_per_rank %
BLOCK_M != 0``, starts on that straddling block, and the programs given its tiles idle until the whole
gather is done. Local chunks need a flag too (signal them before or with the launch).
The producer must not need an SM that the GEMM holds: the comm path writes the flags with stream memory
operations (no SM), so the GEMM may take every SM.
``WAIT_CHUNKS`` requires ``WARP_SPECIALIZE=False`` (a warp-specialised partition could issue A loads
without the wait; static assert). After the waits the kernel issues ``fence.proxy.async.global`` (compiled
code only) so that the TMA loads of A are ordered after the generic-proxy acquire. With
``WAIT_CHUNKS=False`` the extra arguments are never read and the kernel compiles to the same code as
without them (only the kernel's parameter list grows).

Bounded waits (both kernels): ``USE_TIMER=True`` (the default unless the process runs the Triton
interpreter, which runs the programs one after another) polls until the flag is ready or ``timeout_ns``
of %globaltimer have passed since that wait began (kernels/flags.py: the clock as every thread of a program
agrees on it, so all leave at the same poll); JIT-compiling peers can take seconds.
``USE_TIMER=False`` (interpreter, CPU tests) polls exactly once and treats a flag that is not ready as a
timeout; never use it on the GPU.
``timeout_ns`` may exceed 2**31 (a Python int; it is passed as int64 then): keep it the same type from
call to call, or the kernel recompiles once per type.

EPILOGUE 2 (scatter, then reduce the own rows; needs ``rows_per_rank % BLOCK_M == 0``): the tiles of the
other owners' rows come first (the walk starts at owner src_rank + 1 and is GROUP_M-swizzled inside that
segment) and are stored and flagged exactly as in EPILOGUE 1; the tiles of the own rows come last, each
waiting (bounded, acquire) for the row block's flag from every other source, then adding their partial
tiles from the own buffer ``dst_ptrs[src_rank]`` to the fp32 accumulator and storing the sum into C =
``out`` [rows_per_rank, N] (row stride ``ldc``). No other kernel and no reserved SMs: the reduction is the
epilogue. Waiting tiles only ever wait for other sources' non-own tiles, which never wait, and every program
stores and counts (publishes) all its non-own tiles before its first wait, so all ranks progress (all
programs must be resident: grid <= SMs). An expired wait stores ``error_code_base + <flag index>`` into the
control page and the program skips its remaining own tiles. ``tile_row_offset`` is ignored.

The reduction kernel of EPILOGUE 1 (``reduce_partials_kernel``) and the epilogue code live in
``kernels/rs_epilogue.py``.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from .constants import EPILOGUE_LOCAL, EPILOGUE_SCATTER, EPILOGUE_SCATTER_REDUCE
from .flags import TIMER_AVAILABLE
from .gemm_fp8 import SCALE_BLOCK_K, scaled_k_loop
from .gemm_mainloop import k_loop, store_tile, stream_k_part, tile_coordinates, wait_for_chunks
from .rs_epilogue import owner_last_tile, publish_row_block, reduce_own_tile, reduce_partials_kernel, scatter_stores

__all__ = ["EPILOGUE_LOCAL", "EPILOGUE_SCATTER", "EPILOGUE_SCATTER_REDUCE", "GemmConfig", "persistent_gemm_kernel",
           "reduce_partials_kernel", "TIMER_AVAILABLE"]

_LOCAL = tl.constexpr(EPILOGUE_LOCAL)  # the same, for @triton.jit code
_SCATTER = tl.constexpr(EPILOGUE_SCATTER)
_SCATTER_REDUCE = tl.constexpr(EPILOGUE_SCATTER_REDUCE)


class GemmConfig(NamedTuple):
    """The compile-time configuration of ``persistent_gemm_kernel`` (its CONFIG argument)."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 8
    EPILOGUE: int = 0               # EPILOGUE_LOCAL, EPILOGUE_SCATTER or EPILOGUE_SCATTER_REDUCE
    USE_DESCRIPTORS: bool = True
    B_TRANSPOSED: bool = False
    WARP_SPECIALIZE: bool = False
    FLATTEN: bool = False
    EPILOGUE_SUBTILE: int = 1
    STREAM_K_WAVES: int = 0         # > 0: the last partial wave plus STREAM_K_WAVES - 1 full ones split by K steps
    USE_TIMER: bool = TIMER_AVAILABLE


@triton.jit(do_not_specialize=["M", "tile_row_offset", "rows_per_rank", "src_rank"])
def persistent_gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, strides, tile_row_offset, rows_per_rank, src_rank,
                           scatter, chunk_wait, stream_k, scales, CONFIG: tl.constexpr):
    BLOCK_M: tl.constexpr = CONFIG.BLOCK_M
    BLOCK_N: tl.constexpr = CONFIG.BLOCK_N
    BLOCK_K: tl.constexpr = CONFIG.BLOCK_K
    GROUP_M: tl.constexpr = CONFIG.GROUP_M
    EPILOGUE: tl.constexpr = CONFIG.EPILOGUE
    USE_DESCRIPTORS: tl.constexpr = CONFIG.USE_DESCRIPTORS
    B_TRANSPOSED: tl.constexpr = CONFIG.B_TRANSPOSED
    WARP_SPECIALIZE: tl.constexpr = CONFIG.WARP_SPECIALIZE
    FLATTEN: tl.constexpr = CONFIG.FLATTEN
    EPILOGUE_SUBTILE: tl.constexpr = CONFIG.EPILOGUE_SUBTILE
    STREAM_K: tl.constexpr = CONFIG.STREAM_K_WAVES > 0
    USE_TIMER: tl.constexpr = CONFIG.USE_TIMER
    WAIT_CHUNKS: tl.constexpr = chunk_wait is not None
    lda, ldb, ldc = strides
    out_dtype: tl.constexpr = c_ptr.dtype.element_ty
    # the scatter epilogues carry a pending tile across iterations and barrier inside a branch: not run
    # under warp specialisation
    if EPILOGUE != _LOCAL:
        tl.static_assert(not WARP_SPECIALIZE, "scatter epilogues need WARP_SPECIALIZE=False")
        tl.static_assert(scatter is not None, "scatter epilogues need scatter=(...)")
    # stream-K and the flattened loop nest change which program computes what, and when: local store only,
    # and no chunk waits (a flattened loop would hoist the next tile's loads above its wait)
    if STREAM_K or FLATTEN:
        tl.static_assert((EPILOGUE == _LOCAL) and not WAIT_CHUNKS,
                         "STREAM_K / FLATTEN need EPILOGUE_LOCAL, no chunk waits")
    if STREAM_K:
        tl.static_assert((stream_k is not None) and (scales is None), "STREAM_K needs stream_k=(...), no scales")
    if scales is not None:
        tl.static_assert((BLOCK_K == SCALE_BLOCK_K) and B_TRANSPOSED, "FP8: BLOCK_K is the scale group, B is [N, K]")
        tl.static_assert((BLOCK_N <= 128) or (BLOCK_N % 128 == 0), "FP8: BLOCK_N <= 128 or a multiple of 128")
    tl.static_assert((EPILOGUE_SUBTILE == 1) or (EPILOGUE_SUBTILE == 2), "EPILOGUE_SUBTILE is 1 or 2")
    if WAIT_CHUNKS:
        tl.static_assert(not WARP_SPECIALIZE, "chunk waits need WARP_SPECIALIZE=False")
        rows_per_chunk = tl.cdiv(rows_per_rank, chunk_wait[1])
    program_id = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_row_blocks = tl.cdiv(M, BLOCK_M)
    num_col_blocks = tl.cdiv(N, BLOCK_N)
    num_tiles = num_row_blocks * num_col_blocks
    num_k_steps = tl.cdiv(K, BLOCK_K)
    if STREAM_K:
        # whole tiles first; the last partial wave plus STREAM_K_WAVES - 1 full ones are split by K steps
        partial_wave = num_tiles % num_programs
        split_tiles = tl.minimum(num_tiles, partial_wave + (CONFIG.STREAM_K_WAVES - 1) * num_programs)
        num_walk_tiles = num_tiles - tl.where(partial_wave == 0, 0, split_tiles)
    else:
        num_walk_tiles = num_tiles

    if USE_DESCRIPTORS:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[lda, 1], block_shape=[BLOCK_M, BLOCK_K])
        if B_TRANSPOSED:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[ldb, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[ldb, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
        if EPILOGUE == _LOCAL:
            c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[ldc, 1],
                                               block_shape=[BLOCK_M, BLOCK_N // EPILOGUE_SUBTILE])
        else:
            c_desc = None
    else:
        a_desc = None
        b_desc = None
        c_desc = None

    if EPILOGUE == _SCATTER_REDUCE:
        own_first_row_block = (src_rank * rows_per_rank) // BLOCK_M
        own_row_blocks = rows_per_rank // BLOCK_M
    else:
        own_first_row_block = 0
        own_row_blocks = 0

    # Scatter epilogues count a tile (release fence at system scope, then the flag) one tile late: all
    # programs finish their tiles at about the same time, so their NVLink stores arrive as one burst, and a
    # fence right after a tile's stores stalled every program until the burst drained (~25 us per wave at
    # 128x256 tiles). Counted after the next tile's main loop, the stores have long landed.
    pending_row_block = program_id * 0 - 1
    failed = program_id < 0  # a wait of this program expired: skip its remaining tiles
    # FLATTEN: the store's tile comes from its own counter, so that the flattened loop can run the next
    # tile's first loads without keeping this tile's coordinates alive across them
    store_tile_id = program_id
    for tile_id in tl.range(program_id, num_walk_tiles, num_programs, flatten=FLATTEN,
                            warp_specialize=WARP_SPECIALIZE):
        if EPILOGUE == _SCATTER_REDUCE:
            row_block, col_block = owner_last_tile(tile_id, num_row_blocks, num_col_blocks, own_first_row_block,
                                                   own_row_blocks, GROUP_M)
        else:
            row_block, col_block = tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset,
                                                    GROUP_M)
        first_row = row_block * BLOCK_M
        first_col = col_block * BLOCK_N
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = first_col + tl.arange(0, BLOCK_N)

        if WAIT_CHUNKS:
            # Whole-tile wait on every gathered chunk the tile's rows come from (AllGather consumer).
            tile_ready = (not failed) & wait_for_chunks(chunk_wait, first_row, tl.minimum(first_row + BLOCK_M, M) - 1,
                                                        rows_per_rank, rows_per_chunk, USE_TIMER)
            failed = not tile_ready
        else:
            tile_ready: tl.constexpr = True
        if tile_ready:
            if scales is None:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc = k_loop(acc, a_desc, b_desc, a_ptr, b_ptr, first_row, first_col, M, N, K, lda, ldb, 0,
                             num_k_steps, BLOCK_M, BLOCK_N, BLOCK_K, USE_DESCRIPTORS, B_TRANSPOSED)
            else:
                acc = scaled_k_loop(a_desc, b_desc, a_ptr, b_ptr, scales, first_row, first_col, M, N, K, lda, ldb,
                                    BLOCK_M, BLOCK_N, USE_DESCRIPTORS)

            result = acc.to(out_dtype)
            if EPILOGUE != _LOCAL:
                # before any wait of an own tile (EPILOGUE_SCATTER_REDUCE): counting never depends on a peer
                if pending_row_block >= 0:
                    publish_row_block(pending_row_block, M, rows_per_rank, src_rank, scatter, num_col_blocks,
                                      BLOCK_M)
                pending_row_block = program_id * 0 - 1
            if EPILOGUE == _LOCAL:
                if FLATTEN:
                    store_row_block, store_col_block = tile_coordinates(store_tile_id, num_row_blocks,
                                                                        num_col_blocks, tile_row_offset, GROUP_M)
                    store_tile_id += num_programs
                    store_tile(c_desc, c_ptr, result, store_row_block * BLOCK_M, store_col_block * BLOCK_N, M, N,
                               ldc, BLOCK_M, BLOCK_N, USE_DESCRIPTORS, EPILOGUE_SUBTILE)
                else:
                    store_tile(c_desc, c_ptr, result, first_row, first_col, M, N, ldc, BLOCK_M, BLOCK_N,
                               USE_DESCRIPTORS, EPILOGUE_SUBTILE)
            elif EPILOGUE == _SCATTER:
                scatter_stores(result, rows, cols, first_row, M, N, rows_per_rank, src_rank, scatter[0], BLOCK_M)
                pending_row_block = row_block
            elif (row_block >= own_first_row_block) & (row_block < own_first_row_block + own_row_blocks):
                arrived = reduce_own_tile(acc, rows, cols, row_block - own_first_row_block, M, N, ldc, c_ptr,
                                          scatter, rows_per_rank, src_rank, failed, USE_TIMER)
                failed = not arrived
            else:
                scatter_stores(result, rows, cols, first_row, M, N, rows_per_rank, src_rank, scatter[0], BLOCK_M)
                pending_row_block = row_block
    if STREAM_K:
        workspace, flags, timeout_ns = stream_k
        stream_k_part(a_desc, b_desc, c_desc, a_ptr, b_ptr, c_ptr, M, N, K, lda, ldb, ldc, tile_row_offset,
                      num_walk_tiles, num_tiles - num_walk_tiles, workspace, flags, timeout_ns, BLOCK_M, BLOCK_N,
                      BLOCK_K, GROUP_M, USE_DESCRIPTORS, B_TRANSPOSED, EPILOGUE_SUBTILE, USE_TIMER)
    if EPILOGUE != _LOCAL:
        if pending_row_block >= 0:
            publish_row_block(pending_row_block, M, rows_per_rank, src_rank, scatter, num_col_blocks, BLOCK_M)
