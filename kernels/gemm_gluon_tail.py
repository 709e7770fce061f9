"""The split tail of the Gluon GEMM (kernels/gemm_gluon.py): which K steps of which tiles each program runs
after its whole tiles, and the fp32 partials of a tile's segments: stored, counted, summed by the last.

Two ways to cut the tail tiles (``splits`` argument): ``splits >= 1`` cuts every tail tile into ``splits``
equal K ranges, taken in turn by the programs; ``splits == 0`` (stream-K) gives program p the K steps
``[p * total // P, (p + 1) * total // P)`` of the tail tiles' ``total`` steps in a row (P programs;
precondition ``total >= P``, so that no range is empty), so that every program does the same work and a tile
is shared by the programs whose ranges meet it. A tile's segments own consecutive workspace units in K order;
the one whose count completes the tile's arrivals sums the partials in that order.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# the CTA / partition barrier: gl.thread_barrier in Triton 3.6, renamed gl.barrier in 3.7
barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def tail_range(num_whole_tiles, num_tiles, num_k, splits):
    """(first, end, stride) of this program's tail segments (module docstring): equal splits (splits >= 1) are
    units u of items num_whole_tiles + u, taken in turn by the programs after the whole tiles; stream-K
    (splits == 0) segments are the tiles that this program's range of K steps touches."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    if splits > 0:
        first = (pid - num_whole_tiles % programs + programs) % programs
        end = (num_tiles - num_whole_tiles) * splits
        stride = programs
    else:
        total = (num_tiles - num_whole_tiles) * num_k
        begin = pid * total // programs
        stop = (pid + 1) * total // programs
        first = begin // num_k
        end = (stop - 1) // num_k + 1  # the range is not empty: the launcher's stream-K precondition
        stride = programs * 0 + 1  # an int32 like the other branch's
    return first, end, stride


@gluon.jit
def _step_owner(step, programs, total):
    # the program whose stream-K range [p * total // programs, (p + 1) * total // programs) holds `step`
    return ((step + 1) * programs - 1) // total


@gluon.jit
def tail_segment(s, num_whole_tiles, num_tiles, num_k, splits):
    """(tile, first K step, end K step, first unit of the tile, this segment's index among the tile's, their
    count) of tail segment `s` from `tail_range`. Units number the workspace slots: a tile's segments own
    `count` consecutive ones, in K order."""
    if splits > 0:
        index = s % splits
        tile = num_whole_tiles + s // splits
        first_k = index * num_k // splits
        end_k = (index + 1) * num_k // splits
        first_unit = s - index
        count = splits
    else:
        programs = gl.num_programs(0)
        total = (num_tiles - num_whole_tiles) * num_k
        first_owner = _step_owner(s * num_k, programs, total)
        tile = num_whole_tiles + s
        first_k = gl.maximum(gl.program_id(0) * total // programs - s * num_k, 0)
        end_k = gl.minimum((gl.program_id(0) + 1) * total // programs - s * num_k, num_k)
        index = gl.program_id(0) - first_owner
        count = _step_owner((s + 1) * num_k - 1, programs, total) - first_owner + 1
        first_unit = first_owner + s  # the previous tile's last owner may be this tile's first: one slot apart
    return tile, first_k, end_k, first_unit, index, count


@gluon.jit
def count_partial(acc, slot, counter_index, count, workspace, counters):
    """Store this warpgroup's partial of a tail segment in workspace slot `slot` and count it on
    counters[counter_index]; True (uniform over the warpgroup) for the segment whose count completes the
    `count` arrivals of its (tile, warpgroup), which also zeroes the counter again."""
    WG_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    gl.store(workspace + slot.to(gl.int64) * (WG_M * BLOCK_N) + _fragment_offsets(acc, 0), acc)
    barrier()  # every thread's partial stores before the release
    # one thread counts (acq_rel: release cumulative over the stores the barrier ordered before it); the max
    # over the warpgroup hands its result to every thread (a uniform branch) after a partition barrier, which
    # also orders every thread's partial loads after the acquire
    threads: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    counter = counters + counter_index
    lane = gl.arange(0, 128, layout=threads)
    arrivals = gl.atomic_add(counter + lane * 0, gl.full([128], 1, gl.int32, threads), mask=lane == 0,
                             sem="acq_rel", scope="gpu")
    last = gl.max(gl.where(lane == 0, arrivals, -1), axis=0) == count - 1
    if last:
        gl.store(counter, 0)  # zero again for the next launch: every item of this (tile, warpgroup) has counted
    return last


@gluon.jit
def _fragment_offsets(like, FIRST_COL: gl.constexpr):
    """Workspace offsets of a [64, N] fp32 partial held in the wgmma accumulator layout of `like` (columns from
    FIRST_COL): thread t's column pair p (8 bytes) at (p * 128 + t) * 2, so that one warp's access covers 256
    contiguous bytes (two whole lines) where row-major offsets would touch eight lines for 32 bytes each.
    In that layout warp w holds rows 16w + lane // 4 (+ 8), lane % 4 picks the column pair of each 8 columns."""
    layout: gl.constexpr = like.type.layout
    rows = gl.arange(0, like.type.shape[0], layout=gl.SliceLayout(1, layout))
    cols = FIRST_COL + gl.arange(0, like.type.shape[1], layout=gl.SliceLayout(0, layout))
    row_part = ((rows % 16) // 8) * 256 + (rows // 16) * 64 + (rows % 8) * 8
    return gl.expand_dims(row_part, 1) + gl.expand_dims((cols // 8) * 512 + cols % 8, 0)


@gluon.jit
def sum_partials(workspace, first_slot, count, out_smem, WG_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  CONSUMERS: gl.constexpr):
    """out_smem = the sum of the (tile, warpgroup)'s `count` partials (slots first_slot, first_slot +
    CONSUMERS, ...) in K order, bitwise the same whichever segment arrives last; N in sub-tiles of 64
    columns, each partial's sub-tile one L2 round trip (two partials at once where the registers allow)."""
    SUB_N: gl.constexpr = 64  # two partials and the running sum in registers at once
    # the wgmma accumulator layout of a SUB_N-wide tile maps columns to threads as the BLOCK_N-wide one does
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SUB_N, 16])
    PAIRS: gl.constexpr = CONSUMERS == 2  # 232 registers a thread; three consumers get 152
    slot_elements: gl.constexpr = WG_M * BLOCK_N
    for sub in gl.static_range(BLOCK_N // SUB_N):
        total = gl.zeros([WG_M, SUB_N], gl.float32, layout)
        parts = workspace + first_slot.to(gl.int64) * slot_elements + _fragment_offsets(total, sub * SUB_N)
        if PAIRS:
            for s in range(0, count, 2):
                first = gl.load(parts + (CONSUMERS * s) * slot_elements, cache_modifier=".cg")  # L2: other SMs'
                second = gl.load(parts + (CONSUMERS * (s + 1)) * slot_elements, mask=s + 1 < count, other=0.0,
                                 cache_modifier=".cg")
                total = (total + first) + second
        else:
            for s in range(count):
                total = total + gl.load(parts + (CONSUMERS * s) * slot_elements, cache_modifier=".cg")
        out_smem.slice(sub * SUB_N, SUB_N, dim=1).store(total.to(out_smem.dtype))
