"""The AllGather consumer's chunk wait in the Gluon GEMMs (kernels/gemm_gluon.py, gemm_fp8_gluon.py).

The same protocol as ``wait_for_chunks`` of the ``@triton.jit`` GEMM (kernels/gemm.py, WAIT_CHUNKS): before the
first TMA load of a work item's A rows ``[first_row, last_row]``, every gathered chunk flag covering them is
polled (acquire, scope sys) until it holds SET; chunk flags are owner-major and an owner's trailing chunks may
be empty (never signalled, never read).

A waiter warp of its own does the polling (``chunk_wait_partition``), up to TILE_SLOTS work items ahead of the
producer warp, and hands each item over by a CTA mbarrier (``take_chunk_rows``: release / acquire at CTA
scope, after the waiter's acquire and proxy fence). Why not in the producer: a sys-scope acquire is an L2
round trip (two with every lane's), and the producer issues nothing meanwhile, so the ring drained at every
tile: the FP8 consumer, whose ring holds the least time, lost 2-8 % with every flag already set.

Uniformity: lane 0 polls, and the value every lane acts on is the warp's maximum of lane 0's result, so all
32 lanes leave the loop at the same poll and take the same branch; a set abort word (another rank gave up)
ends a wait early. The bound (``await_flag``'s CLOCK): in the bf16 consumer (``chunk_wait_partition``) and
the scatter-reduce GEMM, ``timeout_ns`` of %globaltimer, read every ABORT_EVERY polls once a wait must poll,
as the warp's maximum of its lanes' reads (per-thread clocks would let lanes leave at different polls); in
the FP8 consumer (``counted_chunk_wait_partition``), a count of polls (about ``timeout_ns``: POLL_NS a poll
assumed). Why two: with the clock in its waiter the FP8 consumer ran 4-5 % slower with every flag set, the
clock never read (int64 ns or int32 in 2**20 ns units; interleaved on an H100; the bf16 consumer within
0.4 %; results/logs/one_gpu_a69dbb7): the code around its partitions changed, not what runs, and its builds
are now the same machine code as without the clock. What a count costs: where processes time-share a GPU a
poll takes far longer; two ranks on one H100, the consumer filling every SM, ran past 140 s with 10 s bounds
(by the clock, both raised SignalTimeout after 15 s).

Ordering: once the flag is seen, every lane of the waiter acquires it itself (a load, scope sys: one request
for the warp), then ``fence.proxy.async.global`` orders the generic-proxy view before the async-proxy (TMA)
loads; the hand-over (mbarrier arrive: release at CTA scope; the producer's wait: acquire) carries that order to
the producer warp, whose TMA loads follow it. A flag stays set for the whole launch, so a program acquires each
chunk once: the waiter keeps a bit per chunk it has acquired (the first KNOWN_CHUNKS) and neither polls nor
fences again for later tiles of those rows, and a chunk's first check is that acquire load, the atomic poll
only for a flag not yet set. Polling every tile's chunks, each lane acquiring by an atomic, ran 0-0.9 % slower
on an H100 with every flag set, and the atomic first check 0-0.6 % (results/logs/one_gpu_184dd85,
at_0828271_wait_ab.txt, at_327cde7_wait_ab.txt).

Failure: an expired wait records ``error_code_base + chunk`` (a flag holding another nonzero value records a
mismatch) in the pool's control page and returns False. The producer cannot skip the tile (the consumers
would wait for its ring slots for ever), so it loads the rows anyway and stops waiting for later tiles: the
kernel finishes promptly with wrong rows, and the pool's watchdog aborts the group and raises on every rank.

``chunk_args`` is (chunk_flags_ptr, chunks_per_rank, rows_per_rank, error_ptr, error_code_base, timeout_ns);
``chunks_per_rank == 0`` means no wait (a plain GEMM: nothing else is read).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .constants import MISMATCH_BIT, SET
from .gemm_gluon_walk import tile_coordinates, work_item

SET_FLAG = gl.constexpr(SET)
MISMATCH_FLAG_BIT = gl.constexpr(MISMATCH_BIT)
POLL_NS = gl.constexpr(250)  # as kernels/flags.py: the bound in polls is timeout_ns // POLL_NS
ABORT_EVERY = gl.constexpr(64)  # polls between reads of the abort word (host memory: a PCIe round trip)
TILE_SLOTS = gl.constexpr(2)  # work items the waiter warp may run ahead of the producer
KNOWN_CHUNKS = gl.constexpr(32)  # chunks a program remembers as acquired (bits of an int32); later ones are re-polled

__all__ = ["await_flag", "wait_chunk_rows", "chunk_wait_partition", "counted_chunk_wait_partition", "take_chunk_rows",
           "init_chunk_barriers", "invalidate_chunk_barriers", "TILE_SLOTS"]


@gluon.jit
def _lanes():
    return gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))


@gluon.jit
def _lane0_atomic_read(ptr, lane):
    """*ptr read by an acquire atomic (scope sys) of lane 0, the same value in every lane."""
    seen = gl.atomic_add(ptr + lane * 0, lane * 0, mask=lane == 0, sem="acquire", scope="sys")
    return gl.max(gl.where(lane == 0, seen, -(1 << 30)), axis=0)


@gluon.jit
def _lanes_acquire(ptr, lane):
    """Every lane loads *ptr with acquire semantics (scope sys): one coalesced request for the warp; the value
    (the same in every lane)."""
    seen = gl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr + lane * 0],
                                     dtype=gl.int32, is_pure=False, pack=1)
    return gl.max(seen, axis=0)


@gluon.jit
def _warp_load(ptr, lane):
    """A volatile load of host memory (no atomics over PCIe) that every lane agrees on."""
    return gl.max(gl.load(ptr + lane * 0, volatile=True), axis=0)


@gluon.jit
def _clock_ns(lane):
    """%globaltimer (ns) as every thread of `lane` agrees on it: the maximum of their reads."""
    now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [lane], dtype=gl.int64, is_pure=False,
                                    pack=1)
    return gl.max(now, axis=0)


@gluon.jit
def await_flag(flag_ptr, expected, code, error_ptr, timeout_ns, lane, CLOCK: gl.constexpr = True):
    """Poll one flag until it is nonzero (bounded: `timeout_ns` of %globaltimer, or without CLOCK about that
    many ns as a count of polls; or until the abort word is set); record an expired wait (`code`) or a flag
    holding another value than `expected` (`code` with MISMATCH_BIT, both values) in the control page at
    `error_ptr`, unless a failure is recorded there already. True when it holds `expected`. `lane`: an arange
    over the calling partition's threads (lane 0 polls; all agree)."""
    seen = _lane0_atomic_read(flag_ptr, lane)
    polls = seen * 0
    abort = seen * 0
    if CLOCK:
        expired = seen * 0
        start = _clock_ns(lane)
        while (seen == 0) & (expired == 0) & (abort == 0):
            seen = _lane0_atomic_read(flag_ptr, lane)
            polls += 1
            if polls % ABORT_EVERY == 0:
                abort = _warp_load(error_ptr + 2, lane)
                expired = (_clock_ns(lane) - start > timeout_ns).to(gl.int32)
    else:  # kept apart from the clock's loop: the FP8 builds stay 11903f1's machine code (module docstring)
        max_polls = timeout_ns // POLL_NS
        while (seen == 0) & (polls < max_polls) & (abort == 0):
            seen = _lane0_atomic_read(flag_ptr, lane)
            polls += 1
            if polls % ABORT_EVERY == 0:
                abort = _warp_load(error_ptr + 2, lane)
    first = lane == 0
    if seen == 0:
        if _warp_load(error_ptr, lane) == 0:
            gl.store(error_ptr + 1 + lane * 0, lane * 0 + 1, mask=first)
            gl.store(error_ptr + lane * 0, lane * 0 + code, mask=first)
    elif seen != expected:
        if _warp_load(error_ptr, lane) == 0:
            gl.store(error_ptr + 3 + lane * 0, lane * 0 + seen, mask=first)
            gl.store(error_ptr + 1 + lane * 0, lane * 0 + expected, mask=first)
            gl.store(error_ptr + lane * 0, lane * 0 + (code | MISMATCH_FLAG_BIT), mask=first)
    return seen == expected


@gluon.jit
def wait_chunk_rows(chunk_args, first_row, last_row, ready, known, CLOCK: gl.constexpr = True):
    """Wait (bounded) for every chunk flag holding gathered rows [first_row, last_row], unless an earlier wait
    of this program failed (`ready` False: the rows are loaded without waiting). `known`: a bit per chunk below
    KNOWN_CHUNKS this program has already acquired (a set flag stays set for the whole launch), not polled
    again. Returns (`ready`, `known`) for the next tile. Called by the waiter warp (`chunk_wait_partition`)."""
    flags, chunks_per_rank, rows_per_rank, error_ptr, error_code_base, timeout_ns = chunk_args
    lane = _lanes()
    fresh = chunks_per_rank < 0  # False, a runtime value (it changes inside the loop)
    if ready:
        rows_per_chunk = gl.cdiv(rows_per_rank, chunks_per_rank)
        first_chunk = (first_row // rows_per_rank) * chunks_per_rank + (first_row % rows_per_rank) // rows_per_chunk
        last_chunk = (last_row // rows_per_rank) * chunks_per_rank + (last_row % rows_per_rank) // rows_per_chunk
        for chunk in range(first_chunk, last_chunk + 1):
            bit = (1 << (chunk % KNOWN_CHUNKS)) * (chunk < KNOWN_CHUNKS)
            # an owner's trailing chunks can be empty (9 rows in 4 chunks of 3): nobody signals those
            if ready & ((chunk % chunks_per_rank) * rows_per_chunk < rows_per_rank) & ((known & bit) == 0):
                fresh = True
                # every lane acquires once itself (see Ordering): set already, that load was it
                if _lanes_acquire(flags + chunk, lane) != SET_FLAG:
                    ready = await_flag(flags + chunk, SET_FLAG, error_code_base + chunk, error_ptr, timeout_ns, lane,
                                       CLOCK)
                    if ready:
                        _lanes_acquire(flags + chunk, lane)
                if ready:
                    known = known | bit
    if fresh:  # the async proxy sees what was acquired (once per acquisition: later tiles are ordered after it)
        gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, $1;", "=r,r", [lane], dtype=gl.int32,
                                  is_pure=False, pack=1)
    return ready, known


@gluon.jit
def chunk_wait_partition(a_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, splits, chunk_args, chunks_ok,
                         chunks_free):
    """The waiter warp of a bf16 Gluon GEMM (a warp_specialize partition), its waits bounded by the clock."""
    _walk_chunks(a_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, splits, chunk_args, chunks_ok,
                 chunks_free, True)


@gluon.jit
def counted_chunk_wait_partition(a_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, splits, chunk_args,
                                 chunks_ok, chunks_free):
    """The waiter warp of the FP8 Gluon GEMM, its waits bounded by a count of polls (see the module docstring)."""
    _walk_chunks(a_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, splits, chunk_args, chunks_ok,
                 chunks_free, False)


@gluon.jit
def _walk_chunks(a_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, splits, chunk_args, chunks_ok, chunks_free,
                 CLOCK: gl.constexpr):
    """The waiter warp's walk: the chunks of this program's work items (kernels/gemm_gluon_walk.py), in the
    producer's order; nothing without chunk waits. The tile comes from the descriptors: A in [128, BLOCK_K]
    boxes (BLOCK_M 128) or [64, BLOCK_K] (BLOCK_M 192), C in [64, BLOCK_N]."""
    BLOCK_M: gl.constexpr = 128 if a_desc.block_type.shape[0] == 128 else 192
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    num_row_blocks = gl.cdiv(M, BLOCK_M)
    num_col_blocks = gl.cdiv(N, BLOCK_N)
    num_items = num_whole_tiles + (num_row_blocks * num_col_blocks - num_whole_tiles) * splits
    if chunk_args[1] > 0:
        ready = chunk_args[1] > 0
        known = chunk_args[1] * 0
        index = 0
        for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
            tile_id, _, _, _ = work_item(item, num_whole_tiles, splits, gl.cdiv(K, BLOCK_K))
            row_block, _ = tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
            first_row = row_block * BLOCK_M
            ready, known = _publish_chunk_rows(chunk_args, first_row, gl.minimum(first_row + BLOCK_M, M) - 1, ready,
                                               known, index, chunks_ok, chunks_free, CLOCK)
            index += 1


@gluon.jit
def _publish_chunk_rows(chunk_args, first_row, last_row, ready, known, index, chunks_ok, chunks_free,
                        CLOCK: gl.constexpr):
    """The waiter warp's part for this program's `index`-th work item: once the producer has taken the item
    TILE_SLOTS before it, wait for the chunks of rows [first_row, last_row] (`wait_chunk_rows`) and hand the
    item to the producer (``chunks_ok``, one arrival). Returns (`ready`, `known`) for the next item (a failed
    wait still hands every later item over, unwaited: nobody hangs)."""
    slot = index % TILE_SLOTS
    # a fresh barrier counts as released: its "previous" phase (parity 1) is complete
    mbarrier.wait(chunks_free.index(slot), ((index // TILE_SLOTS) & 1) ^ 1)
    ready, known = wait_chunk_rows(chunk_args, first_row, last_row, ready, known, CLOCK)
    mbarrier.arrive(chunks_ok.index(slot))
    return ready, known


@gluon.jit
def take_chunk_rows(index, chunks_ok, chunks_free):
    """The producer warp's part: wait until the waiter handed over this program's `index`-th work item (its
    rows' chunks acquired and the async proxy fenced), and free the slot for the item TILE_SLOTS later."""
    slot = index % TILE_SLOTS
    mbarrier.wait(chunks_ok.index(slot), (index // TILE_SLOTS) & 1)
    mbarrier.arrive(chunks_free.index(slot))


@gluon.jit
def init_chunk_barriers():
    """(chunks_ok, chunks_free): the waiter's hand-over mbarriers, TILE_SLOTS of each, one arrival a phase
    (fence_async_shared before the partitions start)."""
    chunks_ok = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    chunks_free = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(TILE_SLOTS):
        mbarrier.init(chunks_ok.index(i), count=1)
        mbarrier.init(chunks_free.index(i), count=1)
    return chunks_ok, chunks_free


@gluon.jit
def invalidate_chunk_barriers(chunks_ok, chunks_free):
    for i in gl.static_range(TILE_SLOTS):
        mbarrier.invalidate(chunks_ok.index(i))
        mbarrier.invalidate(chunks_free.index(i))
