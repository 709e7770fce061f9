"""Persistent Triton GEMM with a local or a scatter-to-owners epilogue, and the owner-side reduction.

Only ``@triton.jit`` code and tiny pure helpers live here; validation, pools, streams and the
allocator belong to the launcher.

``persistent_gemm_kernel`` computes ``C[M, N] = A[M, K] @ B[K, N]`` (bf16/fp16 in, fp32 accumulation,
output in C's dtype).

    grid = (num_programs,)            # num_sms - sm_margin; each program walks tiles pid, pid + num_programs, ...
    persistent_gemm_kernel[grid](
        a, b, c, M, N, K, lda, ldb, ldc, tile_row_offset,
        dst_ptrs, flag_ptrs, tile_counters, rows_per_rank, src_rank, epoch, flags_per_source,
        BLOCK_M=..., BLOCK_N=..., BLOCK_K=..., GROUP_M=..., EPILOGUE=0 or 1,
        USE_DESCRIPTORS=True, B_TRANSPOSED=False, WARP_SPECIALIZE=False,
        # optional, only read with WAIT_CHUNKS=True (the AllGather consumer, below):
        chunk_flags_ptr=None, chunks_per_rank=1, chunk_epoch=0, error_ptr=None, timeout_ns=0,
        WAIT_CHUNKS=False, USE_TIMER=<not under the interpreter>,
        epoch_ptr=None, DEVICE_EPOCH=False, num_warps=..., num_stages=...)

* A is [M, K] with row stride ``lda``; B is [K, N] with row stride ``ldb`` or, with ``B_TRANSPOSED``,
  [N, K] with row stride ``ldb`` (an ``nn.Linear`` weight, no copy needed). Last strides must be 1.
* M, N, K, strides, ``tile_row_offset``, ``rows_per_rank``, ``src_rank``, ``epoch`` are runtime ints
  (M, epoch and the rank-dependent ints are excluded from specialisation, so they never recompile).
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
``tile_counters`` may be None; the scatter ints are ignored (pass 0; ``epoch`` 1).

EPILOGUE 1 (scatter to owners): the M rows are split into ``world_size`` owner chunks of
``rows_per_rank`` rows (M = world_size * rows_per_rank); row ``m`` belongs to owner ``o = m //
rows_per_rank``. ``dst_ptrs`` is an int64 tensor of ``world_size`` data pointers; ``dst_ptrs[o]`` is
owner o's contiguous partials buffer [world_size, rows_per_rank, N] in C's dtype, and row m is stored
at ``[src_rank, m - o * rows_per_rank, :]``. ``c`` is only used for its dtype (pass the own buffer).
A tile straddling owners (rows_per_rank % BLOCK_M != 0) is stored once per owner, masked by rows.
Every buffer in ``dst_ptrs`` must be 16-byte aligned (the kernel tells the compiler so, to vectorise).

Completion protocol (epoch-numbered flags, last-tile detection, robust to M changing between calls):

* ``tile_counters`` is a LOCAL int32 array of at least ``cdiv(M, BLOCK_M)`` words, zero before the
  first launch. After a tile's stores, the program adds 1 to ``tile_counters[row_block]`` (acq_rel);
  the program that completes the row block's last column tile resets the word to 0 (so it is zero
  again for the next launch, which is stream-ordered after this one) and, for every owner o whose
  rows the row block covers, writes ``epoch`` with ``atomic_xchg(sem="release", scope="sys")`` into
  ``flag_ptrs[o]`` (an int32 array [world_size, flags_per_source] on owner o) at
  ``[src_rank, row_block - (o * rows_per_rank) // BLOCK_M]``.
* ``DEVICE_EPOCH=True`` (CUDA-graph replay): the value written is ``*epoch_ptr + epoch`` read on the
  device (an int32 counter the launcher bumps once per call), so ``epoch`` is then an offset (pass 0).
* ``flags_per_source >= scatter_flags_per_source(rows_per_rank, BLOCK_M)``; flags start at 0 and
  ``epoch`` must grow by 1 (or more) per launch, starting at 1. A flag equal to ``epoch`` means every
  column tile of that row block has been stored by that source in this launch.

WAIT_CHUNKS (the AllGather consumer, "fused" AG+GEMM; normally with EPILOGUE 0, but both epilogues work):
A [M, K] is being gathered while the kernel runs. It is made of owner blocks of ``rows_per_rank`` rows
(owner ``o`` holds rows ``[o * rows_per_rank, (o + 1) * rows_per_rank)``); each owner block is split into
``chunks_per_rank`` chunks of ``rows_per_chunk = cdiv(rows_per_rank, chunks_per_rank)`` rows (the last
chunk of an owner may be shorter, or even empty: no row maps to it and its flag is never read). Row r is in
chunk ``(r // rows_per_rank) * chunks_per_rank + (r % rows_per_rank) // rows_per_chunk``
(``ag_chunk_index``; ``ag_chunk_rows`` gives a chunk's rows). ``chunk_flags_ptr`` is a LOCAL int32 array
with one flag per chunk (owner-major: index = owner * chunks_per_rank + chunk of that owner, NOT arrival
order), written by whoever finishes the chunk's copy (release, e.g. a release-store kernel or a stream
write after the copy-engine copy). Before a tile's K loop reads A rows ``[m0, min(m0 + BLOCK_M, M))``,
the program polls (acquire, scope sys) every chunk flag from the first row's chunk to the last row's
chunk until it is ``>= chunk_epoch``, each wait bounded by ``timeout_ns`` (below); the waits are per tile,
before any load of the tile. On expiry it writes ``1 + chunk index`` into the int32 word ``error_ptr[0]``
with ``atomic_cas(0 -> code)`` (first failure wins) and skips the tile; every program checks that word
before each tile and skips all work once it is nonzero (so the error word must be zero at launch). The
output is then incomplete (C keeps whatever it held: poison it or ignore it) and the host must raise.
For EPILOGUE 1 a skipped tile also never bumps its tile counter, so neither its flags nor the counters
are valid afterwards (reset the counters before reusing them after a failure).
Tile order for the AllGather: pass ``tile_row_offset = ag_tile_row_offset(rank, rows_per_rank, BLOCK_M)``
(``cdiv(rank * rows_per_rank, BLOCK_M)``): the walk starts at the first row block that begins at or after
the first local row, so it goes local rows, then owners rank + 1, rank + 2, ... (ring arrival order),
and the row block straddling owners rank - 1 and rank (it needs rank - 1's last chunk, the last to
arrive) comes last. ``(rank * rows_per_rank) // BLOCK_M`` also works but, when ``rows_per_rank %
BLOCK_M != 0``, starts on that straddling block, and the programs given its tiles idle until the whole
gather is done. Local chunks need a flag too (signal them before or with the launch).
The producer must not need an SM that the GEMM holds: with ``num_programs`` = all SMs a release-store
kernel queued behind the copies may never be scheduled (the waits then expire); write the flags with a
stream memory op (``stream_write_value32``) or keep an SM margin.
``WAIT_CHUNKS`` requires ``WARP_SPECIALIZE=False`` (a warp-specialised partition could issue A loads
without the wait; static assert). After the waits the kernel issues ``fence.proxy.async.global`` (compiled
code only) so that the TMA loads of A are ordered after the generic-proxy acquire. With
``WAIT_CHUNKS=False`` the extra arguments are never read and the kernel compiles to the same code as
without them (only the kernel's parameter list grows).

Bounded waits (both kernels): ``USE_TIMER=True`` (the default unless the process runs the Triton
interpreter, where the inline asm cannot run) polls until the flag is ready or ``timeout_ns`` of wall time
(``%globaltimer``, ``kernels.flags.read_globaltimer``) have passed since that wait began; JIT-compiling
peers can take seconds, so a spin count is not a usable bound. ``USE_TIMER=False`` (interpreter, CPU
tests) polls exactly once and treats a flag that is not ready as a timeout; never use it on the GPU.
``timeout_ns`` may exceed 2**31 (a Python int; it is passed as int64 then): keep it the same type from
call to call, or the kernel recompiles once per type.

``reduce_partials_kernel`` runs on owner o (a small persistent grid, e.g. 16 programs, so it leaves SMs
to the GEMM). For each owner-local tile it waits (``WAIT=True``) until, for every source and every GEMM
row block overlapping the tile's rows, the flag is ``>= epoch`` (acquire, scope sys); then it sums the
``world_size`` partials in fp32 and stores into ``out`` [rows_per_rank, N] (row stride ``ld_out``)::

    reduce_partials_kernel[(programs,)](
        partials, out, flags, error, rows_per_rank, N, ld_out, world_size, epoch, flags_per_source,
        gemm_block_m, owner_rank, timeout_ns, WAIT=True, BLOCK_M=..., BLOCK_N=..., USE_TIMER=True)

``DEVICE_EPOCH=True`` waits for ``*epoch_ptr + epoch`` instead (as in the GEMM's scatter flags).
A wait that expires (see bounded waits) writes ``1 + src`` (first failure only, ``atomic_cas`` from 0)
into the int32 ``error`` word, and every program stops doing work once that word is nonzero; ``out`` is
then incomplete. Compile and warm both kernels on every rank before the first cross-rank wait, and
barrier, so that JIT time does not eat into ``timeout_ns``.
"""

import triton
import triton.language as tl

from .flags import read_globaltimer, resolve_epoch

EPILOGUE_LOCAL = 0
EPILOGUE_SCATTER = 1

# Triton 3.6's interpreter multiplies bf16 tiles as their raw uint16 bits in tl.dot; under the
# interpreter only, operands are widened to fp32 first. Compiled kernels never see this branch.
_WIDEN_DOT_OPERANDS = tl.constexpr(bool(triton.knobs.runtime.interpret))

# %globaltimer is read with inline asm, which the interpreter cannot run: the default USE_TIMER.
TIMER_AVAILABLE = not triton.knobs.runtime.interpret
_COMPILED = tl.constexpr(TIMER_AVAILABLE)


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def num_output_tiles(m: int, n: int, block_m: int, block_n: int) -> int:
    return cdiv(m, block_m) * cdiv(n, block_n)


def scatter_flags_per_source(rows_per_rank: int, block_m: int) -> int:
    """Flag words an owner needs per source: its rows can touch cdiv(rows, BLOCK_M) + 1 GEMM row blocks."""
    return cdiv(rows_per_rank, block_m) + 1


def ag_rows_per_chunk(rows_per_rank: int, chunks_per_rank: int) -> int:
    """Rows of every chunk of an owner block but the last (WAIT_CHUNKS geometry)."""
    return cdiv(rows_per_rank, chunks_per_rank)


def ag_chunk_index(row: int, rows_per_rank: int, chunks_per_rank: int) -> int:
    """Index into chunk_flags of the chunk holding gathered row ``row`` (owner-major)."""
    return ((row // rows_per_rank) * chunks_per_rank
            + (row % rows_per_rank) // ag_rows_per_chunk(rows_per_rank, chunks_per_rank))


def ag_chunk_rows(chunk_index: int, rows_per_rank: int, chunks_per_rank: int) -> tuple[int, int]:
    """(first row, row count) in the gathered A of chunk ``chunk_index``; the count may be 0."""
    owner, chunk = divmod(chunk_index, chunks_per_rank)
    per_chunk = ag_rows_per_chunk(rows_per_rank, chunks_per_rank)
    first = min(chunk * per_chunk, rows_per_rank)
    last = min(first + per_chunk, rows_per_rank)
    return owner * rows_per_rank + first, last - first


def ag_tile_row_offset(rank: int, rows_per_rank: int, block_m: int) -> int:
    """tile_row_offset for the AllGather consumer: the first row block starting at or after the first local row."""
    return cdiv(rank * rows_per_rank, block_m)


@triton.jit
def _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset, GROUP_M: tl.constexpr):
    # GROUP_M row blocks share each B column panel while it is hot in L2; the rotation afterwards keeps
    # the order a permutation while letting every rank begin at its own row block.
    tiles_per_group = GROUP_M * num_col_blocks
    group_id = tile_id // tiles_per_group
    first_row_block = group_id * GROUP_M
    rows_in_group = tl.minimum(num_row_blocks - first_row_block, GROUP_M)
    index_in_group = tile_id % tiles_per_group
    swizzled_row_block = first_row_block + index_in_group % rows_in_group
    col_block = index_in_group // rows_in_group
    row_block = (swizzled_row_block + tile_row_offset) % num_row_blocks
    return row_block, col_block


@triton.jit
def _wait_for_flag(flag_ptr, epoch, timeout_ns, USE_TIMER: tl.constexpr):
    """Acquire-polls ``*flag_ptr`` (scope sys) until it is >= epoch; returns whether it got there in time.

    USE_TIMER: for at most ``timeout_ns`` of %globaltimer time from the first poll. Otherwise one poll.
    """
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if USE_TIMER:
        start = read_globaltimer()
        now = start
        while (seen < epoch) & (now - start < timeout_ns):
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            now = read_globaltimer()
    return seen >= epoch


@triton.jit
def _wait_for_chunks(chunk_flags_ptr, error_ptr, first_row, last_row, rows_per_rank, chunks_per_rank,
                     rows_per_chunk, chunk_epoch, timeout_ns, USE_TIMER: tl.constexpr):
    """True when no failure is recorded and every chunk holding rows [first_row, last_row] is ready."""
    first_chunk = (first_row // rows_per_rank) * chunks_per_rank + (first_row % rows_per_rank) // rows_per_chunk
    last_chunk = (last_row // rows_per_rank) * chunks_per_rank + (last_row % rows_per_rank) // rows_per_chunk
    ready = tl.load(error_ptr, volatile=True) == 0
    for chunk in range(first_chunk, last_chunk + 1):
        # An owner's trailing chunks can be empty (e.g. 9 rows in 4 chunks of 3); nobody needs to signal those.
        if ready & ((chunk % chunks_per_rank) * rows_per_chunk < rows_per_rank):
            arrived = _wait_for_flag(chunk_flags_ptr + chunk, chunk_epoch, timeout_ns, USE_TIMER)
            if not arrived:
                tl.atomic_cas(error_ptr, 0, 1 + chunk, sem="relaxed", scope="gpu")
            ready = arrived
    # The acquire above ran on one thread: order every thread's A loads after it, then (compiled code only)
    # order this thread's generic-proxy view before its async-proxy (TMA) loads of A.
    tl.debug_barrier()
    if _COMPILED:
        tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
    return ready


@triton.jit(do_not_specialize=["M", "tile_row_offset", "rows_per_rank", "src_rank", "epoch", "chunk_epoch",
                               "timeout_ns"])
def persistent_gemm_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    lda, ldb, ldc,
    tile_row_offset,
    dst_ptrs, flag_ptrs, tile_counters_ptr,
    rows_per_rank, src_rank, epoch, flags_per_source,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE: tl.constexpr, USE_DESCRIPTORS: tl.constexpr, B_TRANSPOSED: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    chunk_flags_ptr=None, chunks_per_rank=1, chunk_epoch=0, error_ptr=None, timeout_ns=0,
    WAIT_CHUNKS: tl.constexpr = False, USE_TIMER: tl.constexpr = TIMER_AVAILABLE,
    epoch_ptr=None, DEVICE_EPOCH: tl.constexpr = False,
):
    out_dtype: tl.constexpr = c_ptr.dtype.element_ty
    if WAIT_CHUNKS:
        tl.static_assert(not WARP_SPECIALIZE, "WAIT_CHUNKS needs WARP_SPECIALIZE=False")
        rows_per_chunk = tl.cdiv(rows_per_rank, chunks_per_rank)
    program_id = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_row_blocks = tl.cdiv(M, BLOCK_M)
    num_col_blocks = tl.cdiv(N, BLOCK_N)
    num_tiles = num_row_blocks * num_col_blocks
    num_k_steps = tl.cdiv(K, BLOCK_K)

    if USE_DESCRIPTORS:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[lda, 1], block_shape=[BLOCK_M, BLOCK_K])
        if B_TRANSPOSED:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[ldb, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[ldb, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
        if EPILOGUE == 0:
            c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[ldc, 1],
                                               block_shape=[BLOCK_M, BLOCK_N])

    for tile_id in tl.range(program_id, num_tiles, num_programs, warp_specialize=WARP_SPECIALIZE):
        row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset,
                                                 GROUP_M)
        first_row = row_block * BLOCK_M
        first_col = col_block * BLOCK_N
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = first_col + tl.arange(0, BLOCK_N)

        if WAIT_CHUNKS:
            # Whole-tile wait on every gathered chunk the tile's rows come from (AllGather consumer).
            tile_ready = _wait_for_chunks(chunk_flags_ptr, error_ptr, first_row,
                                          tl.minimum(first_row + BLOCK_M, M) - 1, rows_per_rank,
                                          chunks_per_rank, rows_per_chunk, chunk_epoch, timeout_ns, USE_TIMER)
        else:
            tile_ready: tl.constexpr = True
        if tile_ready:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_step in range(num_k_steps):
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
                if _WIDEN_DOT_OPERANDS:
                    a_tile = a_tile.to(tl.float32)
                    b_tile = b_tile.to(tl.float32)
                acc = tl.dot(a_tile, b_tile, acc)

            result = acc.to(out_dtype)
            if EPILOGUE == 0:
                if USE_DESCRIPTORS:
                    c_desc.store([first_row, first_col], result)
                else:
                    tl.store(c_ptr + rows.to(tl.int64)[:, None] * ldc + cols[None, :], result,
                             mask=(rows < M)[:, None] & (cols < N)[None, :])
            else:
                # One store per owner the tile covers (two when rows_per_rank % BLOCK_M != 0), each from a
                # scalar base: a per-row pointer tensor doubled the GEMM time. The alignment hint (the
                # buffers are 16-byte aligned allocations) is what lets the stores vectorise.
                last_row = tl.minimum(first_row + BLOCK_M, M) - 1
                col_in_range = (cols < N)[None, :]
                for store_owner in range(first_row // rows_per_rank, last_row // rows_per_rank + 1):
                    owner_base = tl.multiple_of(
                        tl.load(dst_ptrs + store_owner).to(tl.pointer_type(out_dtype)), 16)
                    owner_first_row = store_owner * rows_per_rank
                    in_owner = (rows >= owner_first_row) & (rows < owner_first_row + rows_per_rank) & (rows < M)
                    dst_row = (src_rank * rows_per_rank - owner_first_row + rows).to(tl.int64)
                    tl.store(owner_base + dst_row[:, None] * N + cols[None, :], result,
                             mask=in_owner[:, None] & col_in_range)

                # Every thread's stores must precede the single-thread release below.
                tl.debug_barrier()
                counter = tile_counters_ptr + row_block
                tiles_done_before = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")
                if tiles_done_before == num_col_blocks - 1:
                    flag_value = resolve_epoch(epoch, epoch_ptr, DEVICE_EPOCH)
                    # Last column tile of this row block in this launch: the acquire above made all other
                    # programs' stores for the row block visible to us, so our release publishes them too.
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                    for flag_owner in range(first_row // rows_per_rank, last_row // rows_per_rank + 1):
                        owner_flags = tl.load(flag_ptrs + flag_owner).to(tl.pointer_type(tl.int32))
                        flag_index = (src_rank * flags_per_source + row_block
                                      - (flag_owner * rows_per_rank) // BLOCK_M)
                        tl.atomic_xchg(owner_flags + flag_index, flag_value, sem="release", scope="sys")


@triton.jit(do_not_specialize=["rows_per_rank", "epoch", "owner_rank", "timeout_ns"])
def reduce_partials_kernel(
    partials_ptr, out_ptr, flags_ptr, error_ptr,
    rows_per_rank, N, ld_out, world_size, epoch, flags_per_source, gemm_block_m, owner_rank, timeout_ns,
    WAIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TIMER: tl.constexpr = TIMER_AVAILABLE,
    epoch_ptr=None, DEVICE_EPOCH: tl.constexpr = False,
):
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    epoch = resolve_epoch(epoch, epoch_ptr, DEVICE_EPOCH)
    num_row_blocks = tl.cdiv(rows_per_rank, BLOCK_M)
    num_col_blocks = tl.cdiv(N, BLOCK_N)
    num_tiles = num_row_blocks * num_col_blocks
    source_stride = rows_per_rank.to(tl.int64) * N
    owner_first_row = owner_rank * rows_per_rank
    owner_first_gemm_block = owner_first_row // gemm_block_m

    for tile_id in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        row_block = tile_id // num_col_blocks
        col_block = tile_id % num_col_blocks
        first_row = row_block * BLOCK_M
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)

        all_arrived = tl.load(error_ptr, volatile=True) == 0
        if WAIT:
            # The GEMM flags whole GEMM row blocks; this tile may overlap two of them.
            last_row = tl.minimum(first_row + BLOCK_M, rows_per_rank) - 1
            first_flag = (owner_first_row + first_row) // gemm_block_m - owner_first_gemm_block
            last_flag = (owner_first_row + last_row) // gemm_block_m - owner_first_gemm_block
            for src in range(world_size):
                for flag_index in range(first_flag, last_flag + 1):
                    if all_arrived:
                        arrived = _wait_for_flag(flags_ptr + src * flags_per_source + flag_index, epoch,
                                                 timeout_ns, USE_TIMER)
                        if not arrived:
                            tl.atomic_cas(error_ptr, 0, 1 + src)
                        all_arrived = arrived
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
