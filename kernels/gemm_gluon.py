"""Persistent bf16/fp16 GEMM in Triton's Gluon dialect (Hopper: TMA, mbarrier, async wgmma), local epilogue.

Computes ``C[M, N] = A[M, K] @ B[K, N]`` (fp32 accumulation, C in A's dtype), B either row-major [K, N] or the
rows of an ``nn.Linear`` weight [N, K] (``weight.t()`` without a copy), all read through host tensor
descriptors: A in blocks [128, BLOCK_K] ([64, BLOCK_K] for 192-row tiles), B in [BLOCK_K, BLOCK_N] or
[BLOCK_N, BLOCK_K], C written in [64, BLOCK_N] slabs, one per consumer warpgroup. TMA reads zeros past M, N
and K and clips the store, so whole tiles need no masks.

    gluon_gemm_kernel[(num_programs,)](a_desc, b_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, splits,
                                       workspace, counters, chunk_args, NUM_STAGES=..., B_TRANSPOSED=...,
                                       CONSUMERS=..., num_warps=4)

AllGather consumer (``chunk_args``, kernels/gemm_gluon_wait.py): a waiter warp polls the chunk flags of each work
item's rows and hands the item to the producer warp before its first A load (on the program's first item the first
stages' B boxes are already in flight); ``chunk_args[1] == 0`` (chunks per rank) means no wait.

Why Gluon (the same arrangement as ``kernels/gemm_fp8_gluon.py``, without the scales): the ``@triton.jit``
persistent GEMM builds its TMA descriptors on the device in every program and stops loading while it runs
the epilogue; here the descriptors come from the host and warp-specialised partitions share the SM:

* a producer warp: TMA loads into a ring of NUM_STAGES slots (``ready`` mbarrier per slot, tx-counted),
  running ahead into the next tile while the consumers store this one; it refills a slot once every
  consumer released it (``empty``, CONSUMERS arrivals);
* a consumer warpgroup per 64 rows of the tile (two for BLOCK_M 128; three for BLOCK_M 192, whose A comes in
  three [64, BLOCK_K] boxes, Gluon shapes being powers of two): chain async MMAs into one accumulator,
  keep one in flight, release each slot as soon as the MMA reading it retired, then store their 64-row slab of C
  through shared memory with a TMA store that completes while the next tile's K loop runs;
* a waiter warp, idle without chunk waits (kernels/gemm_gluon_wait.py).

Tiles are walked persistently in GROUP_M = 8 swizzled order, row blocks rotated by ``tile_row_offset`` (as
``persistent_gemm_kernel``; kernels/gemm_gluon_walk.py).

Split tail (``splits > 1``): a last wave that would leave SMs idle is cut by K instead. The first
``num_whole_tiles`` tiles of the walk are whole work items; each remaining tile becomes ``splits`` items of
consecutive K ranges (balanced: ``[s * steps // splits, (s + 1) * steps // splits)``, never empty), and
program p takes items p, p + num_programs, ... in that order. A split item's warpgroup stores its fp32
partial (its 64 rows: ``workspace[unit * CONSUMERS + warpgroup]``, unit = the item's index among the split
items; each thread its own accumulator fragments, in an order that gives every warp 256 contiguous bytes:
``_fragment_offsets``), then counts on the (tile, warpgroup) counter (acq_rel, GPU scope); the warpgroup
whose count completes ``splits`` arrivals zeroes the counter, reads all ``splits`` partials back (per L2 round
trip two partials of 64 columns, or of 128 where BLOCK_N is 128; one with three consumers or in the FP8 kernel),
sums them in split order (bitwise the same whichever item arrives last) and stores C through its staging tile
like a whole tile.
Nobody waits for anybody: no residency assumption, no timeout. ``workspace`` is fp32 [split items *
CONSUMERS, 64 * BLOCK_N], ``counters`` int32 [CONSUMERS * split tiles], zero before the launch and left at zero.
With ``splits == 1`` every tile is whole and the split arguments are never read. Preconditions (the
launcher's): K >= 1 (a tile without K steps would release a ring slot no load filled) and 1 <= splits <=
cdiv(K, BLOCK_K) (no empty piece).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .gemm_gluon_ring import init_ring, invalidate_ring, load_stage
from .gemm_gluon_wait import chunk_wait_partition, init_chunk_barriers, invalidate_chunk_barriers, take_chunk_rows
from .gemm_gluon_walk import owner_last_coordinates, tile_coordinates as _tile_coordinates, work_item as _work_item

# Fixed: constexpr arguments of warp_specialize partitions arrive as runtime values (Triton 3.6), so what a
# partition needs at compile time comes from types (ring depth, tile shapes), module constants (GROUP_M in
# kernels/gemm_gluon_walk.py), or the choice of partition function (the B layout).
# the CTA / partition barrier: gl.thread_barrier in Triton 3.6, renamed gl.barrier in 3.7
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles, splits,
                    chunk_args, chunks_ok, chunks_free, B_TRANSPOSED: gl.constexpr, OWNER_LAST: gl.constexpr = False):
    """The producer warp: TMA loads of every K step of this program's work items into the ring, each slot once
    every consumer warpgroup has released it; with chunk waits, each item's A rows only once the waiter warp
    has seen their chunks arrive (kernels/gemm_gluon_wait.py). OWNER_LAST: whole tiles in the walk of
    kernels/gemm_gluon_reduce.py, this rank's rows (`tile_row_offset` its first row block, chunk_args' rows per
    rank its count) last."""
    A_BOX: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0] if B_TRANSPOSED else b_desc.block_type.shape[1]
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    A_BOXES: gl.constexpr = a_bufs.type.shape[0] // NUM_STAGES  # A boxes per stage (3 of 64 rows for BLOCK_M 192)
    BLOCK_M: gl.constexpr = A_BOX * A_BOXES
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes * A_BOXES + b_desc.block_type.nbytes
    num_row_blocks = gl.cdiv(M, BLOCK_M)
    num_col_blocks = gl.cdiv(N, BLOCK_N)
    num_k = gl.cdiv(K, BLOCK_K)
    num_items = num_whole_tiles + (num_row_blocks * num_col_blocks - num_whole_tiles) * splits
    step = 0
    waits = chunk_args[1] > 0
    index = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        tile_id, first_k, end_k, _ = _work_item(item, num_whole_tiles, splits, num_k)
        if OWNER_LAST:
            row_block, col_block = owner_last_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset,
                                                          chunk_args[2] // BLOCK_M)
        else:
            row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        start_k = first_k
        if waits:
            # B does not depend on the chunks: on the program's first item (its ring empty) the first stages'
            # B boxes are in flight while the waiter acquires the rows. Not later: claiming NUM_STAGES slots
            # ahead would wait for the previous tile's whole ring to drain
            ahead = gl.minimum(end_k - first_k, NUM_STAGES * (index == 0))
            for j in range(ahead):
                load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, empty, step + j, row_block, first_k + j,
                           col_block, False, True, STAGE_BYTES, B_TRANSPOSED)
            take_chunk_rows(index, chunks_ok, chunks_free)
            for j in range(ahead):
                load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, empty, step + j, row_block, first_k + j,
                           col_block, True, False, STAGE_BYTES, B_TRANSPOSED)
            start_k += ahead
            step += ahead
        index += 1
        for k in range(start_k, end_k):
            load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, empty, step, row_block, k, col_block, True, True,
                       STAGE_BYTES, B_TRANSPOSED)
            step += 1


@gluon.jit
def _release(empty, step, NUM_STAGES: gl.constexpr):
    _barrier()  # every warp of this warpgroup is past the MMA wait before the slot is released
    mbarrier.arrive(empty.index(step % NUM_STAGES))


@gluon.jit
def _k_loop(a_bufs, b_bufs, ready, empty, acc, num_k, step, HALF: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """acc += this warpgroup's 64 rows of A @ B over the tile's K steps; one MMA stays in flight, and each
    step's slot is released once the MMA that read it retired."""
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    A_BOXES: gl.constexpr = a_bufs.type.shape[0] // NUM_STAGES
    for k in range(num_k):
        slot = (step + k) % NUM_STAGES
        mbarrier.wait(ready.index(slot), ((step + k) // NUM_STAGES) & 1)
        if A_BOXES == 1:  # a [BLOCK_M, BLOCK_K] box: this warpgroup's 64 rows of it
            a_half = a_bufs.index(slot).slice(HALF * 64, 64, dim=0)
        else:  # one [64, BLOCK_K] box per warpgroup
            a_half = a_bufs.index(slot * A_BOXES + HALF)
        if B_TRANSPOSED:
            b_tile = b_bufs.index(slot).permute((1, 0))
        else:
            b_tile = b_bufs.index(slot)
        acc = warpgroup_mma(a_half, b_tile, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if k > 0:
            _release(empty, step + k - 1, NUM_STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _release(empty, step + num_k - 1, NUM_STAGES)
    return acc


@gluon.jit
def _staging_free():
    tma.store_wait(pendings=0)  # this warpgroup's previous store has read its staging tile
    _barrier()


@gluon.jit
def _store_staged(out_smem, c_desc, first_row, first_col):
    """C[first_row + 64 rows, first_col + BLOCK_N cols] = the staging tile, by a TMA store (clipped at M and N)
    that completes while the next item's K loop runs."""
    fence_async_shared()
    _barrier()  # every warp's rows are in the staging tile before the store is issued
    tma.async_copy_shared_to_global(c_desc, [first_row, first_col], out_smem)


@gluon.jit
def _count_partial(acc, unit, tile_id, num_whole_tiles, splits, workspace, counters, HALF: gl.constexpr,
                   CONSUMERS: gl.constexpr, LEAN: gl.constexpr = False):
    """Store this warpgroup's partial of a split item and count it; True (uniform over the warpgroup) for the
    item whose count completes the (tile, warpgroup)'s `splits` arrivals, which also zeroes the counter again."""
    WG_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    gl.store(workspace + (unit * CONSUMERS + HALF).to(gl.int64) * (WG_M * BLOCK_N) + _fragment_offsets(acc, 0, LEAN),
             acc)
    _barrier()  # every thread's partial stores before the release
    # one thread counts (acq_rel: release cumulative over the stores the barrier ordered before it); the max
    # over the warpgroup hands its result to every thread (a uniform branch) after a partition barrier, which
    # also orders every thread's partial loads after the acquire
    threads: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    counter = counters + (tile_id - num_whole_tiles) * CONSUMERS + HALF
    lane = gl.arange(0, 128, layout=threads)
    arrivals = gl.atomic_add(counter + lane * 0, gl.full([128], 1, gl.int32, threads), mask=lane == 0,
                             sem="acq_rel", scope="gpu")
    last = gl.max(gl.where(lane == 0, arrivals, -1), axis=0) == splits - 1
    if last:
        gl.store(counter, 0)  # zero again for the next launch: every item of this (tile, warpgroup) has counted
    return last


@gluon.jit
def _fragment_offsets(like, FIRST_COL: gl.constexpr, LEAN: gl.constexpr = False):
    """Workspace offsets of a [64, N] fp32 partial held in the wgmma accumulator layout of `like` (columns from
    FIRST_COL): thread t's column pair p (8 bytes) at (p * 128 + t) * 2, so that one warp's access covers 256
    contiguous bytes (two whole lines) where row-major offsets would touch eight lines for 32 bytes each.
    In that layout warp w holds rows 16w + lane // 4 (+ 8), lane % 4 picks the column pair of each 8 columns.
    LEAN: the offsets are computed where they are used; otherwise the compiler may hoist them out of the
    persistent loop, where they hold registers across every K loop."""
    layout: gl.constexpr = like.type.layout
    rows = gl.arange(0, like.type.shape[0], layout=gl.SliceLayout(1, layout))
    if LEAN:  # an opaque copy (not pure, so never hoisted) that everything below depends on
        rows = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [rows], dtype=gl.int32, is_pure=False, pack=1)
    cols = FIRST_COL + gl.arange(0, like.type.shape[1], layout=gl.SliceLayout(0, layout))
    row_part = ((rows % 16) // 8) * 256 + (rows // 16) * 64 + (rows % 8) * 8
    return gl.expand_dims(row_part, 1) + gl.expand_dims((cols // 8) * 512 + cols % 8, 0)


@gluon.jit
def _sum_partials(workspace, first_slot, splits, out_smem, WG_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  CONSUMERS: gl.constexpr, LEAN: gl.constexpr = False):
    """out_smem = the sum of the (tile, warpgroup)'s `splits` partials (slots first_slot, first_slot +
    CONSUMERS, ...) in split order, bitwise the same whichever item arrives last; N in sub-tiles of 64
    columns. The loads are L2 round trips while the tensor cores idle, so as many as the registers allow are
    in flight at once: with two consumers two partials (of both sub-tiles where BLOCK_N is 128), else one."""
    SUB_N: gl.constexpr = 64
    # the wgmma accumulator layout of a SUB_N-wide tile maps columns to threads as the BLOCK_N-wide one does
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SUB_N, 16])
    PAIRS: gl.constexpr = (CONSUMERS == 2) and not LEAN  # 232 registers a thread; three consumers get 152
    # sub-tiles summed at once: two where the registers allow (with 256 columns, Triton 3.6's ptxas spills)
    SUBS: gl.constexpr = 2 if PAIRS and BLOCK_N == 2 * SUB_N else 1
    slot_elements: gl.constexpr = WG_M * BLOCK_N
    NEXT_SUB: gl.constexpr = SUB_N // 8 * 512  # _fragment_offsets: every 8 columns take 512 elements
    for sub in gl.static_range(0, BLOCK_N // SUB_N, SUBS):
        total = gl.zeros([WG_M, SUB_N], gl.float32, layout)
        if SUBS == 2:
            other = gl.zeros([WG_M, SUB_N], gl.float32, layout)
        parts = workspace + first_slot.to(gl.int64) * slot_elements + _fragment_offsets(total, sub * SUB_N, LEAN)
        if PAIRS:
            for s in range(0, splits, 2):
                first = gl.load(parts + (CONSUMERS * s) * slot_elements, cache_modifier=".cg")  # L2: other SMs'
                second = gl.load(parts + (CONSUMERS * (s + 1)) * slot_elements, mask=s + 1 < splits, other=0.0,
                                 cache_modifier=".cg")
                if SUBS == 2:  # the next sub-tile's columns of the same two partials
                    first_next = gl.load(parts + (CONSUMERS * s) * slot_elements + NEXT_SUB, cache_modifier=".cg")
                    second_next = gl.load(parts + (CONSUMERS * (s + 1)) * slot_elements + NEXT_SUB,
                                          mask=s + 1 < splits, other=0.0, cache_modifier=".cg")
                    other = (other + first_next) + second_next
                total = (total + first) + second
        else:
            for s in range(splits):
                total = total + gl.load(parts + (CONSUMERS * s) * slot_elements, cache_modifier=".cg")
        out_smem.slice(sub * SUB_N, SUB_N, dim=1).store(total.to(out_smem.dtype))
        if SUBS == 2:
            out_smem.slice((sub + 1) * SUB_N, SUB_N, dim=1).store(other.to(out_smem.dtype))


@gluon.jit
def store_item(acc, unit, tile_id, split_args, out_smem, c_desc, first_row, col_block, HALF: gl.constexpr,
               CONSUMERS: gl.constexpr, LEAN: gl.constexpr = False):
    """Store a work item's accumulator (this consumer's 64-row half) through the staging tile: a whole tile
    (`unit` < 0) at once; a split piece as a partial, the tile's last piece summing them all first. LEAN: the
    partials' offsets computed where used and one partial per round trip, for a K loop short of registers."""
    WG_M: gl.constexpr = out_smem.type.shape[0]
    BLOCK_N: gl.constexpr = out_smem.type.shape[1]
    num_whole_tiles, splits, workspace, counters = split_args
    if unit < 0:
        _staging_free()
        out_smem.store(acc.to(c_desc.dtype))
        _store_staged(out_smem, c_desc, first_row, col_block * BLOCK_N)
    elif _count_partial(acc, unit, tile_id, num_whole_tiles, splits, workspace, counters, HALF, CONSUMERS, LEAN):
        _staging_free()
        _sum_partials(workspace, (unit - unit % splits) * CONSUMERS + HALF, splits, out_smem, WG_M, BLOCK_N, CONSUMERS,
                      LEAN)
        _store_staged(out_smem, c_desc, first_row, col_block * BLOCK_N)


@gluon.jit
def _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args,
                   HALF: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    """One consumer warpgroup: rows [HALF * 64, HALF * 64 + 64) of every tile."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1] * (a_bufs.type.shape[0] // ready.type.shape[0])
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    CONSUMERS: gl.constexpr = BLOCK_M // 64
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    WG_M: gl.constexpr = 64
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_row_blocks = gl.cdiv(M, BLOCK_M)
    num_col_blocks = gl.cdiv(N, BLOCK_N)
    num_k = gl.cdiv(K, BLOCK_K)
    num_whole_tiles, splits = split_args[0], split_args[1]
    num_items = num_whole_tiles + (num_row_blocks * num_col_blocks - num_whole_tiles) * splits
    out_smem = c_smem.index(HALF)
    step = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        tile_id, first_k, end_k, unit = _work_item(item, num_whole_tiles, splits, num_k)
        row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        acc = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
        acc = _k_loop(a_bufs, b_bufs, ready, empty, acc, end_k - first_k, step, HALF, B_TRANSPOSED)
        step += end_k - first_k
        first_row = row_block * BLOCK_M + HALF * WG_M
        store_item(acc, unit, tile_id, split_args, out_smem, c_desc, first_row, col_block, HALF, CONSUMERS)
    tma.store_wait(pendings=0)


# One function per (partition, B layout): partitions receive no compile-time arguments (see _barrier).
@gluon.jit
def _mma0_kn(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args, 0, False)


@gluon.jit
def _mma1_kn(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args, 1, False)


@gluon.jit
def _mma2_kn(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args, 2, False)


@gluon.jit
def _load_kn(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles, splits,
             chunk_args, chunks_ok, chunks_free):
    _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles, splits,
                    chunk_args, chunks_ok, chunks_free, False)


@gluon.jit
def _mma0_nk(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args, 0, True)


@gluon.jit
def _mma1_nk(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args, 1, True)


@gluon.jit
def _mma2_nk(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args):
    _mma_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args, 2, True)


@gluon.jit
def _load_nk(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles, splits,
             chunk_args, chunks_ok, chunks_free):
    _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles, splits,
                    chunk_args, chunks_ok, chunks_free, True)


@gluon.jit(do_not_specialize=["M", "tile_row_offset", "num_whole_tiles", "splits"])
def gluon_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, splits, workspace, counters,
                      chunk_args, NUM_STAGES: gl.constexpr, B_TRANSPOSED: gl.constexpr, CONSUMERS: gl.constexpr = 2,
                      LOAD_REGS: gl.constexpr = 40):
    BLOCK_M: gl.constexpr = 64 * CONSUMERS
    A_BOX: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    gl.static_assert(((CONSUMERS == 2) and (A_BOX == 128)) or ((CONSUMERS == 3) and (A_BOX == 64) and (BLOCK_N <= 128)),
                     "two consumer warpgroups (A in [128, BLOCK_K] boxes), or three (BLOCK_M 192: shapes are powers "
                     "of two, so A comes in three [64, BLOCK_K] boxes; BLOCK_N <= 128 within 152 registers a thread)")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one warpgroup")
    gl.static_assert(c_desc.block_type.shape[0] == 64, "C is stored in 64-row slabs, one per consumer")
    if B_TRANSPOSED:
        gl.static_assert((b_desc.block_type.shape[0] == BLOCK_N) and (b_desc.block_type.shape[1] == BLOCK_K),
                         "B [N, K]: blocks [BLOCK_N, BLOCK_K]")
    else:
        gl.static_assert((b_desc.block_type.shape[0] == BLOCK_K) and (b_desc.block_type.shape[1] == BLOCK_N),
                         "B [K, N]: blocks [BLOCK_K, BLOCK_N]")

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES * (BLOCK_M // A_BOX), A_BOX, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS, 64, BLOCK_N], c_desc.layout)
    ready, empty = init_ring(NUM_STAGES, CONSUMERS)  # one `empty` arrival per consumer warpgroup
    chunks_ok, chunks_free = init_chunk_barriers()
    fence_async_shared()

    split_args = (num_whole_tiles, splits, workspace, counters)
    mma_args = (a_bufs, b_bufs, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset, split_args)
    load_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, tile_row_offset, num_whole_tiles, splits,
                 chunk_args, chunks_ok, chunks_free)
    wait_args = (a_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, splits, chunk_args, chunks_ok, chunks_free)
    # the 64K registers of the SM, shared (setmaxnreg): 2 consumer warpgroups get 232 each; 3 (with the producer
    # and waiter warps 14 warps, launched as 512 threads: ptxas gives every thread 128, no setmaxnreg) fit in 152
    MMA_REGS: gl.constexpr = 232 if CONSUMERS == 2 else 152
    if B_TRANSPOSED:
        if CONSUMERS == 2:
            gl.warp_specialize([(_mma0_nk, mma_args), (_mma1_nk, mma_args), (_load_nk, load_args),
                                (chunk_wait_partition, wait_args)], [4, 1, 1], [MMA_REGS, LOAD_REGS, LOAD_REGS])
        else:
            gl.warp_specialize([(_mma0_nk, mma_args), (_mma1_nk, mma_args), (_mma2_nk, mma_args),
                                (_load_nk, load_args), (chunk_wait_partition, wait_args)], [4, 4, 1, 1],
                               [MMA_REGS, MMA_REGS, LOAD_REGS, LOAD_REGS])
    else:
        if CONSUMERS == 2:
            gl.warp_specialize([(_mma0_kn, mma_args), (_mma1_kn, mma_args), (_load_kn, load_args),
                                (chunk_wait_partition, wait_args)], [4, 1, 1], [MMA_REGS, LOAD_REGS, LOAD_REGS])
        else:
            gl.warp_specialize([(_mma0_kn, mma_args), (_mma1_kn, mma_args), (_mma2_kn, mma_args),
                                (_load_kn, load_args), (chunk_wait_partition, wait_args)], [4, 4, 1, 1],
                               [MMA_REGS, MMA_REGS, LOAD_REGS, LOAD_REGS])
    invalidate_ring(ready, empty)
    invalidate_chunk_barriers(chunks_ok, chunks_free)
