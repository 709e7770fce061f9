"""Persistent FP8 block-scaled GEMM in Triton's Gluon dialect (Hopper: TMA, mbarrier, async wgmma), bf16 out.

Computes what ``kernels/gemm_fp8.py`` computes, with the same operands and scale layouts:

    C[m, n] = sum_g (A[m, g-th 128 columns] . B[n, g-th 128 columns]) * a_scale[m, g] * b_scale[n // 128, g]

A [M, K] and B [N, K] e4m3, rows contiguous, read through host tensor descriptors of blocks [128, 128] and
[BLOCK_N, 128]; C [M, N] written through a descriptor of blocks [64, BLOCK_N]. The scales come through TMA
too, into the same ring slot as the group's operands: the A scales group-major (their [cdiv(K, 128), M]
storage, as `quantize_activation` makes them) in boxes [1, 128], the tile's rows of group g, or row-major
(an AllGather pool's [M, groups padded to 4]) in boxes [128, 4]; the B scales [cdiv(N, 128), cdiv(K, 128)]
in boxes [1, 4] (a 256-wide tile's [2, 4]), the aligned four groups holding g. TMA reads zeros past M, N and K
and clips the store, so tails need no masks.

    fp8_gluon_gemm_kernel[(num_programs,)](a_desc, b_desc, c_desc, a_scale_desc, b_scale_desc, M, N, K,
                                           tile_row_offset, num_whole_tiles, splits, workspace, counters,
                                           chunk_args, NUM_STAGES=..., SPLIT_TAIL=..., num_warps=4)

``tile_row_offset`` rotates the row blocks and ``num_whole_tiles`` / ``splits`` / ``workspace`` / ``counters`` cut
the last partial wave by K, as in kernels/gemm_gluon.py ("Split tail": a piece's promoted partial is summed by
the tile's last piece); ``chunk_args`` (kernels/gemm_gluon_wait.py, 0 chunks per rank: no wait) makes it the
fused AllGather consumer: a waiter warp (a partition of its own) polls a work item's gathered chunks (rows and their
scales) and hands the item to the producer warp before its A loads (B's go first on a program's first item).
``SPLIT_TAIL=False`` (a launch of whole tiles only) compiles a build without the split path: its whole tiles ran
4-5 % faster on an H100 than the same tiles in the build with it.

Why Gluon: a K step is one 128-wide scale group whose fresh fp32 product is scaled and added to the
accumulator ("promotion"). Under ``@triton.jit`` the CTA's warps wait for each MMA and then promote in
lockstep, so the tensor cores idle meanwhile. Here warp-specialised partitions share the SM:

* a producer warp: TMA loads into a ring of NUM_STAGES slots (``ready`` mbarrier per slot, tx-counted);
  it refills a slot once both consumers released it (``empty``, two arrivals);
* a scaler warp (kernels/gemm_fp8_scaler.py): once a slot has landed, each tile row's scale of the group
  (a_scale * b_scale) into a small shared array per slot, then ``scaled`` (one arrival);
* two consumer warpgroups, each owning 64 rows of the 128-row tile: wait for the slot, MMA its 64 x BLOCK_N
  x 128 product into fresh registers, load its rows' scales from the scaler's array, release the slot,
  promote. Nothing synchronises the two consumers, so one promotes while the other's MMA runs (DeepGEMM's
  arrangement); each stores its half of C.

Where the scales are combined is what the promotion costs: kernels/gemm_fp8_scaler.py.
Row-major A scales are read four to a row (their 16-byte box) and the group's column picked in registers.

Tiles 256 wide (BLOCK_N 256; whole tiles only, 3 stages): two 128-column sub-tiles with a B scale group each.
Per K group a consumer MMAs the first sub-tile, promotes it into its accumulator, then MMAs and promotes the
second, both into the same product registers: accumulators 2 x 64 + product 64 registers a thread (two products
in flight would need 256). The tile reads A once for 256 columns, a fourth less L2 traffic per product than
128x128 tiles, and the K step's fixed costs (waits, scale reads, the release) cover twice the MMA work: on an
H100 the consumer ran at 0.998 of `_scaled_mm` (median of 18 shapes) where 128x128 tiles ran at 0.947, and its
outputs are bitwise theirs (results/logs/one_gpu_a69dbb7/at_b6981be_fp8_256_probe.txt). 128x128 tiles stay
where few waves of 256-wide ones would leave SMs idle (the table's choice).

Registers: a kernel of 4 + 4 + 1 + 1 + 1 warps (producer, waiter, scaler) runs 384 threads, 168 registers a
thread at launch; setmaxnreg lowers the three single warps' to 40 and raises the consumers' to 232 (their code
used up to 155 before the scaler took the scale arithmetic; with Triton 3.6, 178 while the split tail's partial
offsets were hoisted out of the persistent loop); accumulator + product are 128 at 64x128.
Keeping two products in flight per warpgroup (192) spilled, and a single 8-warp partition (255 registers) needed
CTA-wide barriers around every TMA issue and still spilled (ptxas C7515: serialised wgmma).
Tiles are walked persistently in GROUP_M = 8 swizzled order, rotated by ``tile_row_offset``.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from . import constants
from .gemm_gluon import _staging_free, _store_staged, store_item
from .gemm_fp8_scaler import B_SCALE_BOX, scale_partition
from .gemm_gluon_ring import init_ring, invalidate_ring
from .gemm_gluon_wait import (counted_chunk_wait_partition, init_chunk_barriers, invalidate_chunk_barriers,
                              take_chunk_rows)
from .gemm_gluon_walk import tile_coordinates as _tile_coordinates, work_item as _work_item

SCALE_GROUP = gl.constexpr(constants.SCALE_GROUP)  # one K step per FP8 scale group
# Fixed: constexpr arguments of warp_specialize partitions arrive as runtime values (Triton 3.6), so what a
# partition needs at compile time comes from types (ring depth, tile shapes) or from module constants.
SLOT_FLOATS = gl.constexpr(32)  # fp32 per B scale slot: 128 bytes, the alignment of TMA's shared-memory writes
# the CTA / partition barrier: gl.thread_barrier in Triton 3.6, renamed gl.barrier in 3.7
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _load_partition(a_desc, b_desc, a_scale_desc, b_scale_desc, a_bufs, b_bufs, a_scale_bufs, b_scale_bufs, ready,
                    empty, M, N, K, tile_row_offset, num_whole_tiles, splits, chunk_args, chunks_ok, chunks_free):
    """The producer warp: TMA loads of every K group of this program's work items into the ring (A and B tiles,
    the tile's 128 A scales and the box of B scales holding the group's), each slot once both consumer
    warpgroups have released it."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    STAGE_BYTES: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes
                                 + a_scale_desc.block_type.nbytes + b_scale_desc.block_type.nbytes)
    num_row_blocks = gl.cdiv(M, BLOCK_M)
    num_col_blocks = gl.cdiv(N, BLOCK_N)
    num_k = gl.cdiv(K, BLOCK_K)
    num_items = num_whole_tiles + (num_row_blocks * num_col_blocks - num_whole_tiles) * splits
    step = 0
    waits = chunk_args[1] > 0
    index = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        tile_id, first_k, end_k, _ = _work_item(item, num_whole_tiles, splits, num_k)
        row_block, col_block = _tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset)
        col_block_128 = (col_block * BLOCK_N) // SCALE_GROUP
        start_k = first_k
        if waits:
            # the rows and their scales come from the same gathered chunks (the waiter warp's hand-over); B and
            # its scales do not: on the program's first item (its ring empty) the first stages' are in flight
            # while the waiter acquires the rows (later, claiming the slots ahead would drain the ring)
            ahead = gl.minimum(end_k - first_k, NUM_STAGES * (index == 0))
            for j in range(ahead):
                _load_stage(a_desc, b_desc, a_scale_desc, b_scale_desc, a_bufs, b_bufs, a_scale_bufs, b_scale_bufs,
                            ready, empty, step + j, row_block, first_k + j, col_block, col_block_128, False, True,
                            STAGE_BYTES)
            take_chunk_rows(index, chunks_ok, chunks_free)
            for j in range(ahead):
                _load_stage(a_desc, b_desc, a_scale_desc, b_scale_desc, a_bufs, b_bufs, a_scale_bufs, b_scale_bufs,
                            ready, empty, step + j, row_block, first_k + j, col_block, col_block_128, True, False,
                            STAGE_BYTES)
            start_k += ahead
            step += ahead
        index += 1
        for k in range(start_k, end_k):
            _load_stage(a_desc, b_desc, a_scale_desc, b_scale_desc, a_bufs, b_bufs, a_scale_bufs, b_scale_bufs, ready,
                        empty, step, row_block, k, col_block, col_block_128, True, True, STAGE_BYTES)
            step += 1


@gluon.jit
def _load_stage(a_desc, b_desc, a_scale_desc, b_scale_desc, a_bufs, b_bufs, a_scale_bufs, b_scale_bufs, ready, empty,
                step, row_block, k, col_block, col_block_128, LOAD_A: gl.constexpr, LOAD_B: gl.constexpr,
                STAGE_BYTES: gl.constexpr):
    """K group `k` of a tile into ring slot `step`: A and its scales, B and its scales, or all four. The B half
    claims the slot (waits for its release, expects the whole stage's bytes), so a stage split in two loads B
    first."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    slot = step % NUM_STAGES
    bar = ready.index(slot)
    if LOAD_B:
        # a fresh barrier counts as released: its "previous" phase (parity 1) is complete
        mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(bar, STAGE_BYTES)
    if LOAD_A:
        tma.async_copy_global_to_shared(a_desc, [row_block * BLOCK_M, k * BLOCK_K], bar, a_bufs.index(slot))
    if LOAD_B:
        tma.async_copy_global_to_shared(b_desc, [col_block * BLOCK_N, k * BLOCK_K], bar, b_bufs.index(slot))
    if LOAD_A:
        if a_scale_desc.block_type.shape[0] == 1:  # group-major storage [groups, M]: the group's row
            tma.async_copy_global_to_shared(a_scale_desc, [k, row_block * BLOCK_M], bar, a_scale_bufs.index(slot))
        else:  # row-major [M, groups] (e.g. an AllGather pool): the tile's rows, the box holding the group
            tma.async_copy_global_to_shared(a_scale_desc, [row_block * BLOCK_M, k - k % B_SCALE_BOX], bar,
                                            a_scale_bufs.index(slot))
    if LOAD_B:
        tma.async_copy_global_to_shared(b_scale_desc, [col_block_128, k - k % B_SCALE_BOX], bar,
                                        b_scale_bufs.index(slot).slice(0, b_scale_desc.block_type.shape[0]))


@gluon.jit
def _issue_mma(a_bufs, b_bufs, slot, product, HALF: gl.constexpr, SUB: gl.constexpr = 0):
    """Start this warpgroup's MMA (its 64-row half of A) on ring slot `slot` into `product`'s registers: a fresh
    sum, the group's partial product is scaled on its own; of the tile's `SUB`-th sub-tile of columns (as wide as
    `product`)."""
    WG_M: gl.constexpr = a_bufs.type.shape[1] // 2
    SUB_N: gl.constexpr = product.type.shape[1]
    a_half = a_bufs.index(slot).slice(HALF * WG_M, WG_M, dim=0)
    b_sub = b_bufs.index(slot).slice(SUB * SUB_N, SUB_N, dim=0)
    return warpgroup_mma(a_half, b_sub.permute((1, 0)), product, use_acc=False, is_async=True)


@gluon.jit
def _release(empty, slot):
    """Release ring slot `slot` to the producer (this warpgroup's MMA on it done, its scales read)."""
    _barrier()  # every warp of this warpgroup is done with the slot before it is released
    mbarrier.arrive(empty.index(slot))


@gluon.jit
def _promote(acc, product, scale):
    return acc + product * gl.expand_dims(scale, 1)


@gluon.jit
def _k_loop(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, first_k, end_k, step, HALF: gl.constexpr,
            SCALES_DURING_MMA: gl.constexpr):
    """The work item's K groups [first_k, end_k) (ring steps from `step`), each group's MMA retired before its
    promotion: the other warpgroup's MMA keeps the tensor cores busy meanwhile (128 registers of accumulator
    and product per thread for 64x128). The rows' scales (the scaler warp's) are read while the MMA runs
    (SCALES_DURING_MMA) or once it is done: when the consumers combined the scales themselves, the first was
    faster by 3-4 % in the whole-tile build and slower by 3-4 % in the split-tail one
    (results/logs/one_gpu_184dd85/at_55686a9_fp8_ab.txt). Waiting for the scaler before the MMA is issued
    instead of after cost 3 %, reading the scales after the MMA wait in the whole-tile build 5-6 %."""
    WG_M: gl.constexpr = a_bufs.type.shape[1] // 2
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    acc = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
    product = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
    for k in range(first_k, end_k):
        slot = (step + k - first_k) % NUM_STAGES
        phase = ((step + k - first_k) // NUM_STAGES) & 1
        mbarrier.wait(ready.index(slot), phase)
        product = _issue_mma(a_bufs, b_bufs, slot, product, HALF)
        mbarrier.wait(scaled.index(slot), phase)  # the scaler warp's products of this group
        if SCALES_DURING_MMA:
            scale = scale_bufs.index(slot).slice(HALF * WG_M, WG_M).load(gl.SliceLayout(1, mma_layout))
        product = warpgroup_mma_wait(num_outstanding=0, deps=(product, ))
        if not SCALES_DURING_MMA:
            scale = scale_bufs.index(slot).slice(HALF * WG_M, WG_M).load(gl.SliceLayout(1, mma_layout))
        _release(empty, slot)
        acc = _promote(acc, product, scale)
    return acc


@gluon.jit
def _k_loop_wide(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, first_k, end_k, step, HALF: gl.constexpr):
    """`_k_loop` of a tile two 128-column sub-tiles wide (one B scale group each): per K group, the sub-tiles'
    MMAs one after the other into the same product registers, each retired and promoted into its own
    accumulator before the next is issued (accumulators 2 x 64 + product 64 registers per thread: two products
    in flight would need 256). Both sub-tiles' row scales are read while the first MMA runs."""
    WG_M: gl.constexpr = a_bufs.type.shape[1] // 2
    SUB_N: gl.constexpr = SCALE_GROUP
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, SUB_N, 32])
    scale_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    acc0 = gl.zeros([WG_M, SUB_N], gl.float32, mma_layout)
    acc1 = gl.zeros([WG_M, SUB_N], gl.float32, mma_layout)
    product = gl.zeros([WG_M, SUB_N], gl.float32, mma_layout)
    for k in range(first_k, end_k):
        slot = (step + k - first_k) % NUM_STAGES
        phase = ((step + k - first_k) // NUM_STAGES) & 1
        mbarrier.wait(ready.index(slot), phase)
        product = _issue_mma(a_bufs, b_bufs, slot, product, HALF, 0)
        mbarrier.wait(scaled.index(slot), phase)
        scale0 = scale_bufs.index(2 * slot).slice(HALF * WG_M, WG_M).load(scale_layout)
        scale1 = scale_bufs.index(2 * slot + 1).slice(HALF * WG_M, WG_M).load(scale_layout)
        product = warpgroup_mma_wait(num_outstanding=0, deps=(product, ))
        acc0 = _promote(acc0, product, scale0)
        # nothing in flight: this wait only keeps the promotion's FFMAs ahead of the next MMA, which LLVM otherwise
        # issues first, into 64 more registers (a copy of the product), and then spills
        acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, ))
        product = _issue_mma(a_bufs, b_bufs, slot, product, HALF, 1)
        product = warpgroup_mma_wait(num_outstanding=0, deps=(product, ))
        _release(empty, slot)
        acc1 = _promote(acc1, product, scale1)
    return acc0, acc1


@gluon.jit
def _store_wide(acc0, acc1, out_smem, c_desc, first_row, first_col):
    """A whole tile's two 128-column accumulators through the staging tile, one TMA store."""
    SUB_N: gl.constexpr = acc0.type.shape[1]
    _staging_free()
    out_smem.slice(0, SUB_N, dim=1).store(acc0.to(c_desc.dtype))
    out_smem.slice(SUB_N, SUB_N, dim=1).store(acc1.to(c_desc.dtype))
    _store_staged(out_smem, c_desc, first_row, first_col)


@gluon.jit
def _mma_partition(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, c_desc, c_smem, M, N, K,
                   tile_row_offset, split_args, HALF: gl.constexpr, SPLIT_TAIL: gl.constexpr):
    """One consumer warpgroup: rows [HALF * 64, HALF * 64 + 64) of every work item. A split item's promoted
    partial goes to the workspace; the last of a tile's pieces sums them (kernels/gemm_gluon.py, "Split tail").
    Without SPLIT_TAIL (a launch of whole tiles only) the split path is not compiled."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    WG_M: gl.constexpr = BLOCK_M // 2
    SUBS: gl.constexpr = 2 if BLOCK_N == 2 * SCALE_GROUP else 1  # 128-column sub-tiles, a B scale group each
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
        if SUBS == 2:  # whole tiles only (the kernel's static assertion)
            acc0, acc1 = _k_loop_wide(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, first_k, end_k, step, HALF)
            step += end_k - first_k
            _store_wide(acc0, acc1, out_smem, c_desc, row_block * BLOCK_M + HALF * WG_M, col_block * BLOCK_N)
        else:
            acc = _k_loop(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, first_k, end_k, step, HALF,
                          not SPLIT_TAIL)
            step += end_k - first_k
            first_row = row_block * BLOCK_M + HALF * WG_M
            if SPLIT_TAIL:
                # LEAN: with Triton 3.6 the partials' offsets, hoisted out of the persistent loop, raised 155
                # registers to 178
                store_item(acc, unit, tile_id, split_args, out_smem, c_desc, first_row, col_block, HALF, 2, True)
            else:
                _staging_free()
                out_smem.store(acc.to(c_desc.dtype))
                _store_staged(out_smem, c_desc, first_row, col_block * BLOCK_N)
    tma.store_wait(pendings=0)


@gluon.jit
def _mma_low(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset,
             split_args):
    _mma_partition(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset,
                   split_args, 0, True)


@gluon.jit
def _mma_low_whole(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset,
                   split_args):
    _mma_partition(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset,
                   split_args, 0, False)


@gluon.jit
def _mma_high(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset,
              split_args):
    _mma_partition(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset,
                   split_args, 1, True)


@gluon.jit
def _mma_high_whole(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset,
                    split_args):
    _mma_partition(a_bufs, b_bufs, scale_bufs, scaled, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset,
                   split_args, 1, False)


# rank- and shape-dependent: one compile for every rank, M and split plan
@gluon.jit(do_not_specialize=["M", "tile_row_offset", "num_whole_tiles", "splits"])
def fp8_gluon_gemm_kernel(a_desc, b_desc, c_desc, a_scale_desc, b_scale_desc, M, N, K, tile_row_offset,
                          num_whole_tiles, splits, workspace, counters, chunk_args, NUM_STAGES: gl.constexpr,
                          SPLIT_TAIL: gl.constexpr = True, MMA_REGS: gl.constexpr = 232, LOAD_REGS: gl.constexpr = 40):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    gl.static_assert(BLOCK_K == SCALE_GROUP, "one K step per 128-wide scale group")
    gl.static_assert((BLOCK_N <= SCALE_GROUP) or (BLOCK_N == 2 * SCALE_GROUP),
                     "one B scale per 128-column sub-tile and K group: BLOCK_N <= 128 or 256")
    SUBS: gl.constexpr = 2 if BLOCK_N == 2 * SCALE_GROUP else 1  # sub-tiles
    gl.static_assert((SUBS == 1) or not SPLIT_TAIL, "256-wide tiles: whole tiles only (no split tail)")
    gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 rows")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one warpgroup")
    gl.static_assert(c_desc.block_type.shape[0] == BLOCK_M // 2, "C is stored in 64-row halves")
    gl.static_assert(c_desc.block_type.shape[1] == BLOCK_N, "C boxes as wide as the tile (the waiter walks by them)")
    A_SCALE_BOX: gl.constexpr = a_scale_desc.block_type.shape
    gl.static_assert(((A_SCALE_BOX[0] == 1) and (A_SCALE_BOX[1] == BLOCK_M))
                     or ((A_SCALE_BOX[0] == BLOCK_M) and (A_SCALE_BOX[1] == B_SCALE_BOX)),
                     "A scales: boxes [1, BLOCK_M] (group-major) or [BLOCK_M, B_SCALE_BOX] (row-major)")

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    gl.static_assert(b_scale_desc.block_type.shape[1] == B_SCALE_BOX, "B scales: boxes of B_SCALE_BOX groups")
    gl.static_assert(b_scale_desc.block_type.shape[0] == SUBS, "B scales: a row per 128-column sub-tile")
    a_scale_bufs = gl.allocate_shared_memory(a_scale_desc.dtype, [NUM_STAGES, A_SCALE_BOX[0], A_SCALE_BOX[1]],
                                             a_scale_desc.layout)
    # a B scale box (16 bytes) per 128 bytes: TMA writes shared memory at 128-byte aligned addresses only
    gl.static_assert(SLOT_FLOATS % B_SCALE_BOX == 0, "B scale slots hold whole boxes")
    b_scale_bufs = gl.allocate_shared_memory(b_scale_desc.dtype, [NUM_STAGES, SLOT_FLOATS // B_SCALE_BOX, B_SCALE_BOX],
                                             b_scale_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, BLOCK_M // 2, BLOCK_N], c_desc.layout)
    # per slot and tile row, the group's scale product of the scaler warp (a plain array: read as it was written)
    scale_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES * SUBS, BLOCK_M],
                                           gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready, empty = init_ring(NUM_STAGES, 2)  # one `empty` arrival per consumer warpgroup
    scaled = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(scaled.index(i), count=1)  # the scaler warp's arrival
    chunks_ok, chunks_free = init_chunk_barriers()
    fence_async_shared()

    # the scaler reads the scale rows as plain [NUM_STAGES, box] arrays (no swizzle: the same bytes)
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # of one row; a slot per row
    if A_SCALE_BOX[0] == 1:
        a_scale_rows = a_scale_bufs._reinterpret(a_scale_desc.dtype, [NUM_STAGES, BLOCK_M], rows_layout)
    else:
        a_scale_rows = a_scale_bufs._reinterpret(a_scale_desc.dtype, [NUM_STAGES, BLOCK_M, B_SCALE_BOX],
                                                 gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    b_scale_rows = b_scale_bufs._reinterpret(b_scale_desc.dtype, [NUM_STAGES, SLOT_FLOATS], rows_layout)
    mma_args = (a_bufs, b_bufs, scale_bufs, scaled, ready, empty, c_desc, c_smem, M, N, K, tile_row_offset,
                (num_whole_tiles, splits, workspace, counters))
    scale_args = (b_bufs, a_scale_rows, b_scale_rows, scale_bufs, ready, scaled, M, N, K, num_whole_tiles, splits)
    load_args = (a_desc, b_desc, a_scale_desc, b_scale_desc, a_bufs, b_bufs, a_scale_bufs, b_scale_bufs, ready, empty,
                 M, N, K, tile_row_offset, num_whole_tiles, splits, chunk_args, chunks_ok, chunks_free)
    wait_args = (a_desc, c_desc, M, N, K, tile_row_offset, num_whole_tiles, splits, chunk_args, chunks_ok, chunks_free)
    if SPLIT_TAIL:  # partitions are chosen here: their constexpr arguments would arrive as runtime values
        gl.warp_specialize([(_mma_low, mma_args), (_mma_high, mma_args), (_load_partition, load_args),
                            (counted_chunk_wait_partition, wait_args), (scale_partition, scale_args)], [4, 1, 1, 1],
                           [MMA_REGS, LOAD_REGS, LOAD_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([(_mma_low_whole, mma_args), (_mma_high_whole, mma_args), (_load_partition, load_args),
                            (counted_chunk_wait_partition, wait_args), (scale_partition, scale_args)], [4, 1, 1, 1],
                           [MMA_REGS, LOAD_REGS, LOAD_REGS, LOAD_REGS])
    invalidate_ring(ready, empty)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(scaled.index(i))
    invalidate_chunk_barriers(chunks_ok, chunks_free)
