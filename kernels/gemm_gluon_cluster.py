"""A bf16/fp16 GEMM run by 2- or 4-CTA clusters with TMA multicast, in Triton's Gluon dialect (sm_90, Triton >= 3.7).

What it is for: measuring what thread-block clusters buy the narrow GEMMs (M 1024-2048, N 768-1536), where
the persistent kernel (kernels/gemm_gluon.py) leaves SMs idle and cuBLAS runs 2-CTA clusters
(launch/cluster_gemm_probe.py times it; the block table does not use it yet).

Computes ``C[M, N] = A[M, K] @ W[N, K]^T`` (W as an ``nn.Linear`` stores its weight). A cluster of two CTAs
computes one [256, BN0 + BN1] tile; tile widths need not be powers of two, because B comes in two boxes
(``b0_desc`` [BN0, BK] and ``b1_desc`` [BN1, BK] at column offset BN0) with an accumulator each, e.g. 96 =
64 + 32, which lets 128 CTAs cover N = 1536 at M = 1024. Every descriptor carries a CGA layout: A and C
``[[1, 0]]`` (a [128, X] box at cluster row r holds rows r..r+63 in CTA 0 and r+64..r+127 in CTA 1), B
``[[0, 0]]`` (both CTAs hold the whole box, loaded once by the lead CTA with ``multicast=True``: the L2
traffic for B per cluster halves). Consumer warpgroup h owns the box at cluster row off_m + 128 h.
With ``num_ctas=4`` (a 2x2 cluster) CTA id bit 1 also splits N: the B boxes ([2 BN0, BK], [2 BN1, BK]) are
``[[0, 0], [1, 0]]``, C ``[[1, 0], [0, 1]]``, and A ``[[1, 0], [0, 0]]`` is multicast to the two CTAs of each
row pair; the tile is [256, 2 (BN0 + BN1)].

    cluster_gemm_kernel[(clusters, splits)](a_desc, b0_desc, b1_desc, c0_desc, c1_desc, M, N, K, c_rows,
                                            NUM_STAGES=..., num_warps=4, num_ctas=2 or 4)

Partitions per CTA: two consumer warpgroups (async wgmma, one step in flight) and a producer warpgroup
whose TMA loads fill a ring of NUM_STAGES slots (``ready`` mbarrier per slot, tx-counted: this CTA's two A
boxes plus both B boxes). The lead CTA may refill a slot only when the consumers of every CTA have retired
the MMA that read it, and Gluon 3.7 has no remote mbarrier arrive, so slots are released through the
cluster barrier: every thread of the cluster arrives once per K step (consumers once the previous step's MMA
retired, relaxed: no memory of theirs is handed over), and the producer waits for that phase before it
refills. Each consumer waits a phase one step after arriving, so the barrier's latency hides behind an MMA.
Two facts make this work: a cluster barrier counts every thread of the CTA, so the producer is a whole
warpgroup (a 1-warp partition leaves idle padding warps behind that never arrive: the kernel hangs) and
nothing cluster-wide runs before the partitions start (the worker warps only join there); and the release
form of the arrive costs ~0.4 us per step on an H200, the relaxed one little.

Split-K over grid dim 1 (``splits`` > 1): split s takes K steps [s * ceil(steps / splits), ...) and stores
its partial at rows ``s * c_rows + row`` of C (fp32 [splits * c_rows, N], c_rows a multiple of 256 >= M);
the caller sums the partials. A split without K steps (or K = 0) stores zeros.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (cluster, fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)

GROUP_M = gl.constexpr(8)
CLUSTER_M = gl.constexpr(256)   # two CTAs x two consumer warpgroups x 64 rows


@gluon.jit
def _work(M, N, K, BN: gl.constexpr, BK: gl.constexpr):
    """(row, column of the cluster's tile, first K step, K steps, split) in GROUP_M order."""
    num_row_blocks = gl.cdiv(M, CLUSTER_M)
    num_col_blocks = gl.cdiv(N, BN)
    steps = gl.cdiv(K, BK)
    steps_per_split = gl.cdiv(steps, gl.num_programs(1))
    split = gl.program_id(1)
    first_k = split * steps_per_split
    pid = gl.program_id(0)   # the cluster (all its CTAs see the same id)
    tiles_per_group = GROUP_M * num_col_blocks
    first_row = (pid // tiles_per_group) * GROUP_M
    rows_in_group = gl.minimum(num_row_blocks - first_row, GROUP_M)
    off_m = (first_row + (pid % tiles_per_group) % rows_in_group) * CLUSTER_M
    off_n = ((pid % tiles_per_group) // rows_in_group) * BN
    return off_m, off_n, first_k, gl.minimum(steps - first_k, steps_per_split), split


@gluon.jit
def _issue(a_desc, b0_desc, b1_desc, a0, a1, b0, b1, ready, off_m, off_n, first_k, j, num_k):
    """Load K step j (if it exists) into its slot: this CTA's part of both A boxes and both B boxes, each box
    issued once per broadcast group by its lowest CTA with multicast."""
    NS: gl.constexpr = b0.shape[0]
    BN0: gl.constexpr = b0.shape[1]
    BK: gl.constexpr = b0.shape[2]
    MULTICAST_A: gl.constexpr = gl.num_ctas() == 4   # a 2x2 cluster: the CTAs of a row pair share A
    if j < num_k:
        slot = j % NS
        bar = ready.index(slot)
        k = (first_k + j) * BK
        mbarrier.expect(bar, 2 * a_desc.nbytes_per_cta + b0_desc.nbytes_per_cta + b1_desc.nbytes_per_cta)
        tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a0.index(slot), multicast=MULTICAST_A)
        tma.async_copy_global_to_shared(a_desc, [off_m + 128, k], bar, a1.index(slot), multicast=MULTICAST_A)
        tma.async_copy_global_to_shared(b0_desc, [off_n, k], bar, b0.index(slot), multicast=True)
        tma.async_copy_global_to_shared(b1_desc, [off_n + BN0, k], bar, b1.index(slot), multicast=True)


@gluon.jit
def _producer(a_desc, b0_desc, b1_desc, a0, a1, b0, b1, ready, M, N, K):
    NS: gl.constexpr = b0.shape[0]
    BK: gl.constexpr = b0.shape[2]
    off_m, off_n, first_k, num_k, _ = _work(M, N, K, b0.shape[1] + b1.shape[1], BK)
    cluster.arrive()
    cluster.wait()   # every CTA's barriers initialised (consumer 0 published them) before a multicast signals one
    for j in gl.static_range(NS - 1):
        _issue(a_desc, b0_desc, b1_desc, a0, a1, b0, b1, ready, off_m, off_n, first_k, j, num_k)
    for q in range(num_k):
        cluster.arrive(relaxed=True)
        cluster.wait()   # every CTA retired the MMA of step q - 1: its slot takes step q + NS - 1
        _issue(a_desc, b0_desc, b1_desc, a0, a1, b0, b1, ready, off_m, off_n, first_k, q + NS - 1, num_k)


@gluon.jit
def _consumer(a_bufs, b0, b1, ready, c0_desc, c1_desc, c0_smem, c1_smem, M, N, K, c_rows, ROW: gl.constexpr):
    NS: gl.constexpr = b0.shape[0]
    BN0: gl.constexpr = b0.shape[1]
    BN1: gl.constexpr = b1.shape[1]
    off_m, off_n, first_k, num_k, split = _work(M, N, K, BN0 + BN1, b0.shape[2])
    CTAS_N: gl.constexpr = gl.num_ctas() // 2   # CTAs side by side along N (each holds 1 / CTAS_N of a B box)
    layout0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BN0 // CTAS_N, 16],
                                                      cga_layout=c0_desc.layout.cga_layout)
    layout1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BN1 // CTAS_N, 16],
                                                      cga_layout=c1_desc.layout.cga_layout)
    acc0 = gl.zeros([128, BN0], gl.float32, layout0)
    acc1 = gl.zeros([128, BN1], gl.float32, layout1)
    # release (not relaxed): consumer 0's warps initialised the ring's barriers, and this publishes them to
    # the peers before any of them multicasts into this CTA
    cluster.arrive()
    cluster.wait()
    for k in range(num_k):
        slot = k % NS
        mbarrier.wait(ready.index(slot), (k // NS) & 1)
        acc0 = warpgroup_mma(a_bufs.index(slot), b0.index(slot).permute((1, 0)), acc0, is_async=True)
        acc1 = warpgroup_mma(a_bufs.index(slot), b1.index(slot).permute((1, 0)), acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
        if k > 0:
            cluster.wait()
        cluster.arrive(relaxed=True)   # the MMAs of step k - 1 retired here
    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
    if num_k > 0:
        # pairs the last arrive; once it completes every CTA's consumers have seen all their loads land, so no
        # CTA exits while a peer could still multicast into it
        cluster.wait()
    row = split * c_rows + off_m + ROW
    c0_smem.store(acc0.to(c0_desc.dtype))
    c1_smem.store(acc1.to(c1_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c0_desc, [row, off_n], c0_smem)
    tma.async_copy_shared_to_global(c1_desc, [row, off_n + BN0], c1_smem)
    tma.store_wait(pendings=0)


# Constexpr arguments of warp_specialize partitions are not guaranteed to arrive as constants: the row a
# consumer owns is chosen by which function runs.
@gluon.jit
def _consumer0(a0, a1, b0, b1, ready, c0_desc, c1_desc, c00, c01, c10, c11, M, N, K, c_rows):
    _consumer(a0, b0, b1, ready, c0_desc, c1_desc, c00, c01, M, N, K, c_rows, 0)


@gluon.jit
def _consumer1(a0, a1, b0, b1, ready, c0_desc, c1_desc, c00, c01, c10, c11, M, N, K, c_rows):
    _consumer(a1, b0, b1, ready, c0_desc, c1_desc, c10, c11, M, N, K, c_rows, 128)


@gluon.jit
def cluster_gemm_kernel(a_desc, b0_desc, b1_desc, c0_desc, c1_desc, M, N, K, c_rows, NUM_STAGES: gl.constexpr):
    gl.static_assert((gl.num_ctas() == 2) or (gl.num_ctas() == 4), "launch with num_ctas=2 or 4")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one consumer warpgroup")
    gl.static_assert(a_desc.block_type.shape[0] == 128, "A in [128, BK] boxes (64 rows per CTA)")
    gl.static_assert(NUM_STAGES >= 2, "the producer runs NUM_STAGES - 1 steps ahead")
    BK: gl.constexpr = a_desc.block_type.shape[1]
    a0 = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, 128, BK], a_desc.layout)
    a1 = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, 128, BK], a_desc.layout)
    b0 = gl.allocate_shared_memory(b0_desc.dtype, [NUM_STAGES, b0_desc.block_type.shape[0], BK], b0_desc.layout)
    b1 = gl.allocate_shared_memory(b1_desc.dtype, [NUM_STAGES, b1_desc.block_type.shape[0], BK], b1_desc.layout)
    c00 = gl.allocate_shared_memory(c0_desc.dtype, c0_desc.block_type.shape, c0_desc.layout)
    c01 = gl.allocate_shared_memory(c1_desc.dtype, c1_desc.block_type.shape, c1_desc.layout)
    c10 = gl.allocate_shared_memory(c0_desc.dtype, c0_desc.block_type.shape, c0_desc.layout)
    c11 = gl.allocate_shared_memory(c1_desc.dtype, c1_desc.block_type.shape, c1_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=NUM_STAGES)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    # no cluster barrier here: the worker warps would not take part in it (each partition starts with one)
    consumer_args = (a0, a1, b0, b1, ready, c0_desc, c1_desc, c00, c01, c10, c11, M, N, K, c_rows)
    producer_args = (a_desc, b0_desc, b1_desc, a0, a1, b0, b1, ready, M, N, K)
    gl.warp_specialize([(_consumer0, consumer_args), (_consumer1, consumer_args), (_producer, producer_args)],
                       [4, 4], [232, 40])
