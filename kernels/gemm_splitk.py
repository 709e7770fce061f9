"""Split-K Triton GEMM: ``C[M, N] = A[M, K] @ B[K, N]`` with the K steps of every output tile split over
``SPLIT_K`` programs, for shapes with too few output tiles to fill the GPU (narrow N, small M: 48 tiles of
128x128 on 132 SMs) and long K.

Only ``@triton.jit`` code and tiny pure helpers live here; workspaces, descriptors and the grid belong to the
launcher (overlap/gemm/splitk.py).

    split_k_gemm_kernel[(programs,)](
        a, b, c, workspace, counters, M, N, K, lda, ldb, ldc, tile_row_offset,
        BLOCK_M=..., BLOCK_N=..., BLOCK_K=..., GROUP_M=..., SPLIT_K=..., USE_DESCRIPTORS=True,
        B_TRANSPOSED=False, REDUCE_M=..., num_warps=..., num_stages=...)

* ``USE_DESCRIPTORS=True``: ``a`` and ``b`` are host-side ``TensorDescriptor``s (A [M, K] with block
  [BLOCK_M, BLOCK_K]; B [K, N] with block [BLOCK_K, BLOCK_N], or with ``B_TRANSPOSED`` [N, K] with block
  [BLOCK_N, BLOCK_K]); TMA reads zeros out of bounds, so M, N and K tails are free. Host descriptors cost
  the programs nothing (no device-side descriptor build per program, which a grid of one program per unit
  would pay hundreds of times). ``USE_DESCRIPTORS=False``: ``a`` and ``b`` are the tensors (row strides
  ``lda``, ``ldb``), loads masked: the fallback for unaligned operands.
* A unit is (split s, tile t); program p takes units p, p + programs, ... of ``num_tiles * SPLIT_K`` units,
  split-major (the units running together read the same K range: A and B panels shared in L2), tiles in
  GROUP_M-swizzled order within a split, row blocks rotated by ``tile_row_offset``. With one program per
  unit the hardware schedules them; a smaller grid (``num_programs`` of the launcher, leaving SMs free)
  makes the programs persistent. Split s takes K steps ``[s * steps // SPLIT_K, (s + 1) * steps //
  SPLIT_K)`` of ``steps = cdiv(K, BLOCK_K)`` (balanced; an empty range contributes zeros).
* ``workspace`` is fp32 ``[num_tiles, SPLIT_K, BLOCK_M, BLOCK_N]`` (any contents: every unit overwrites
  its slot before it is read), ``counters`` int32 ``[num_tiles]``, zero before the launch; the kernel
  leaves them at zero again.

Design (why not fp32 partials plus a second reduction kernel): at these sizes a whole GEMM takes 15-60 us,
so a second launch (its gap, its grid ramp, re-reading every partial from a cold start) costs a large
share. Here each unit stores its fp32 partial, then counts itself on its tile's counter (acq_rel); the
unit that arrives last (old count SPLIT_K - 1) resets the counter to zero for the next launch, sums the
SPLIT_K partials of the tile in split order and stores the tile in C's dtype. Nobody waits for anybody (no
residency assumption, no timeout): the last arrival does the work the others left. The sum order is fixed
(split 0, 1, ...), so the output is bitwise the same whichever split arrives last; the last arrival reads
its own partial back (from L2, just written) instead of keeping it in registers, which would hold two
tiles at once and decide the order by arrival. The reduction goes REDUCE_M rows at a time (a few
registers per thread for any tile size).

Memory ordering: a unit's threads store the partial, meet at a CTA barrier, then one thread adds 1 at GPU
scope with acq_rel semantics (release: cumulative over the stores the barrier ordered before it; acquire:
the last arrival sees every earlier unit's partial). Every thread reads the atomic's broadcast result
and, after another CTA barrier, loads the partials with ``.cg`` (L2, never a stale L1 line).
"""

from typing import NamedTuple

import triton
import triton.language as tl

from .gemm_mainloop import k_loop

__all__ = ["SplitKConfig", "split_k_gemm_kernel", "split_k_ranges", "reduce_rows"]


class SplitKConfig(NamedTuple):
    """The compile-time configuration of ``split_k_gemm_kernel`` (its CONFIG argument)."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    SPLIT_K: int
    USE_DESCRIPTORS: bool
    B_TRANSPOSED: bool
    REDUCE_M: int               # rows the last-arriving unit sums per step (reduce_rows)



def split_k_ranges(k: int, block_k: int, split_k: int) -> list[tuple[int, int]]:
    """[first, end) K steps of each split (the kernel's partition, for tests and estimates)."""
    steps = -(-k // block_k)
    return [(s * steps // split_k, (s + 1) * steps // split_k) for s in range(split_k)]


def reduce_rows(block_m: int, block_n: int, num_warps: int) -> int:
    """Rows summed per step by the last arrival: about 32 fp32 values per thread and tensor."""
    return max(1, min(block_m, 32 * 32 * num_warps // block_n))


@triton.jit
def _unit_tile(tile, num_row_blocks, num_col_blocks, tile_row_offset, GROUP_M: tl.constexpr):
    """(row block, column block) of the tile-th tile: GROUP_M row blocks share each B column panel."""
    per_group = GROUP_M * num_col_blocks
    first_row_block = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_row_blocks - first_row_block, GROUP_M)
    row_block = first_row_block + (tile % per_group) % group_rows
    col_block = (tile % per_group) // group_rows
    return (row_block + tile_row_offset) % num_row_blocks, col_block


@triton.jit
def _reduce_tile(tile_ptr, c_ptr, first_row, first_col, M, N, ldc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPLIT_K: tl.constexpr, REDUCE_M: tl.constexpr):
    """C[tile] = sum over splits 0, 1, ... (this order) of the tile's partials at tile_ptr, REDUCE_M rows at a
    time, stored in C's dtype (masked: M and N tails)."""
    out_dtype: tl.constexpr = c_ptr.dtype.element_ty
    cols = first_col + tl.arange(0, BLOCK_N)
    offsets = tl.arange(0, REDUCE_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    for first in tl.static_range(0, BLOCK_M, REDUCE_M):
        total = tl.load(tile_ptr + first * BLOCK_N + offsets, cache_modifier=".cg")
        for split in tl.static_range(1, SPLIT_K):
            total += tl.load(tile_ptr + split * BLOCK_M * BLOCK_N + first * BLOCK_N + offsets, cache_modifier=".cg")
        rows = first_row + first + tl.arange(0, REDUCE_M)
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * ldc + cols[None, :], total.to(out_dtype),
                 mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["M", "tile_row_offset"])
def split_k_gemm_kernel(a, b, c_ptr, workspace_ptr, counters_ptr, M, N, K, lda, ldb, ldc, tile_row_offset,
                        CONFIG: tl.constexpr):
    BLOCK_M: tl.constexpr = CONFIG.BLOCK_M
    BLOCK_N: tl.constexpr = CONFIG.BLOCK_N
    BLOCK_K: tl.constexpr = CONFIG.BLOCK_K
    GROUP_M: tl.constexpr = CONFIG.GROUP_M
    SPLIT_K: tl.constexpr = CONFIG.SPLIT_K
    USE_DESCRIPTORS: tl.constexpr = CONFIG.USE_DESCRIPTORS
    B_TRANSPOSED: tl.constexpr = CONFIG.B_TRANSPOSED
    REDUCE_M: tl.constexpr = CONFIG.REDUCE_M
    tl.static_assert(BLOCK_M % REDUCE_M == 0, "REDUCE_M divides BLOCK_M")
    num_row_blocks = tl.cdiv(M, BLOCK_M)
    num_col_blocks = tl.cdiv(N, BLOCK_N)
    num_tiles = num_row_blocks * num_col_blocks
    num_steps = tl.cdiv(K, BLOCK_K)
    tile_elements: tl.constexpr = BLOCK_M * BLOCK_N
    offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    for unit in tl.range(tl.program_id(0), num_tiles * SPLIT_K, tl.num_programs(0)):
        split = unit // num_tiles
        tile = unit % num_tiles
        row_block, col_block = _unit_tile(tile, num_row_blocks, num_col_blocks, tile_row_offset, GROUP_M)
        first_row = row_block * BLOCK_M
        first_col = col_block * BLOCK_N
        first_step = split * num_steps // SPLIT_K
        end_step = (split + 1) * num_steps // SPLIT_K
        # the K loop every GEMM kernel shares (a, b are descriptors or pointers, as USE_DESCRIPTORS says)
        acc = k_loop(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a, b, a, b, first_row, first_col, M, N, K,
                     lda, ldb, first_step, end_step, BLOCK_M, BLOCK_N, BLOCK_K, USE_DESCRIPTORS, B_TRANSPOSED)
        tile_ptr = workspace_ptr + tl.cast(tile, tl.int64) * (SPLIT_K * tile_elements)
        tl.store(tile_ptr + split * tile_elements + offsets, acc)
        # every thread's partial stores before the single-thread release
        tl.debug_barrier()
        arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.atomic_xchg(counters_ptr + tile, 0, sem="relaxed", scope="gpu")
            # the acquire ran on one thread: order every thread's partial loads after it
            tl.debug_barrier()
            _reduce_tile(tile_ptr, c_ptr, first_row, first_col, M, N, ldc, BLOCK_M, BLOCK_N, SPLIT_K, REDUCE_M)
