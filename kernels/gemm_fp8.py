"""Persistent FP8 GEMM with fine-grained scales (DeepSeek-V3 / DeepGEMM recipe), bf16 output.

Only ``@triton.jit`` code. ``fp8_gemm_kernel`` computes

    C[m, n] = sum_g (A[m, g-th 128 columns] . B[n, g-th 128 columns]) * a_scale[m, g] * b_scale[n // 128, g]

with A [M, K] e4m3 (row stride ``lda``), B [N, K] e4m3 row-major (``ldb``: the ``nn.Linear`` weight layout,
the only one fp8 wgmma reads without a transpose: it needs K-major operands), C [M, N] (``ldc``; bf16 or
any float type). Scales are fp32: ``a_scale[m, g]`` at ``a_scales + m * a_scale_stride_m + g *
a_scale_stride_k`` (one per row per 128-wide K group; cuBLAS's layout is stride_m = 1, stride_k = M) and
``b_scale[j, g]`` at ``b_scales + j * b_scale_stride_n + g * b_scale_stride_k`` (one per 128x128 block of
B; row-major [cdiv(N, 128), cdiv(K, 128)]). The layouts are those of ``kernels/quant_fp8.py``.

    fp8_gemm_kernel[(num_programs,)](
        a, b, c, a_scales, b_scales, M, N, K, lda, ldb, ldc,
        a_scale_stride_m, a_scale_stride_k, b_scale_stride_n, b_scale_stride_k, tile_row_offset,
        BLOCK_M=..., BLOCK_N=..., GROUP_M=..., USE_DESCRIPTORS=True, WARP_SPECIALIZE=False,
        # optional, only read with WAIT_CHUNKS=True (the AllGather consumer):
        rows_per_rank=1, chunk_flags_ptr=None, chunks_per_rank=1, error_ptr=None, error_code_base=0,
        timeout_ns=0, WAIT_CHUNKS=False, USE_TIMER=<not under the interpreter>,
        FLATTEN=False, EPILOGUE_SUBTILE=1, num_warps=..., num_stages=...)

* BLOCK_K is 128, the scale group: each K step multiplies one fresh fp32 product of the tile by one scale
  per row of A and one per 128-column block of B, then adds it to the fp32 accumulator. The fresh product
  per 128 also bounds the error of the tensor cores' reduced-precision fp8 accumulation (DeepGEMM's
  "promotion"). BLOCK_N <= 128 reads one B scale per step (tiles never straddle a 128-column block).
* K tails: the last group is partial (K % 128 != 0); descriptors read zeros past K, the pointer path
  masks, and the loop runs cdiv(K, 128) steps, so it never reads a scale past the last group.
* ``USE_DESCRIPTORS=True`` loads A, B and stores C through tensor descriptors (TMA): base pointers and row
  strides 16-byte aligned (e4m3: K % 16 == 0; bf16 C: N % 8 == 0), and ``triton.set_allocator`` set, as for
  ``kernels/gemm.py``. ``False``: masked pointer loads (any shape; slower).
* Tile walk as ``persistent_gemm_kernel``'s (GROUP_M-swizzled, rotated by ``tile_row_offset``).
* ``WAIT_CHUNKS`` (the fused AllGather consumer): the same contract as ``persistent_gemm_kernel``'s --
  A is gathered while the kernel runs in owner blocks of ``rows_per_rank`` rows split into
  ``chunks_per_rank`` chunks; before a tile reads A it waits (acquire, bounded by ``timeout_ns`` with
  ``USE_TIMER``, else one poll) for every chunk flag its rows touch to be SET; an expired wait stores
  ``error_code_base + chunk`` into the control page ``error_ptr`` and that program skips its remaining
  tiles. The scales of A rows must be ready when their chunk's flag is (quantise before
  the gather, or gather them with the rows). Tile rows in arrival order: ``tile_row_offset =
  ag_tile_row_offset(rank, rows_per_rank, BLOCK_M)``. Needs ``WARP_SPECIALIZE=False`` and ``FLATTEN=False``.
* ``FLATTEN`` / ``EPILOGUE_SUBTILE``: as in ``persistent_gemm_kernel`` (tuning options, local store).
"""

import triton
import triton.language as tl

from .flags import TIMER_AVAILABLE
from .gemm import _wait_for_chunks
from .gemm_mainloop import WIDEN_DOT_OPERANDS, store_tile, tile_coordinates

__all__ = ["fp8_gemm_kernel", "SCALE_GROUP"]

SCALE_GROUP = 128
_BLOCK_K = tl.constexpr(SCALE_GROUP)


@triton.jit
def _scaled_k_loop(a_desc, b_desc, a_ptr, b_ptr, a_scales_ptr, b_scales_ptr, first_row, first_col, M, N, K, lda,
                   ldb, a_scale_stride_m, a_scale_stride_k, b_scale_stride_n, b_scale_stride_k,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_DESCRIPTORS: tl.constexpr):
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = first_col + tl.arange(0, BLOCK_N)
    # Rows past M read scale 0 (their products are never stored); so do columns past N.
    a_scale_ptrs = a_scales_ptr + rows.to(tl.int64) * a_scale_stride_m
    if BLOCK_N <= 128:  # the scale group
        b_scale_ptr = b_scales_ptr + (first_col // _BLOCK_K) * b_scale_stride_n
    else:
        b_scale_ptrs = b_scales_ptr + (cols // _BLOCK_K) * b_scale_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_step in range(tl.cdiv(K, _BLOCK_K)):
        first_k = k_step * _BLOCK_K
        if USE_DESCRIPTORS:
            a_tile = a_desc.load([first_row, first_k])
            b_tile = b_desc.load([first_col, first_k])
        else:
            ks = first_k + tl.arange(0, _BLOCK_K)
            k_in_range = ks < K
            a_tile = tl.load(a_ptr + rows.to(tl.int64)[:, None] * lda + ks[None, :],
                             mask=(rows < M)[:, None] & k_in_range[None, :], other=0.0)
            b_tile = tl.load(b_ptr + cols.to(tl.int64)[:, None] * ldb + ks[None, :],
                             mask=(cols < N)[:, None] & k_in_range[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptrs + k_step * a_scale_stride_k, mask=rows < M, other=0.0)
        if WIDEN_DOT_OPERANDS:
            # the interpreter: exact fp32 products of the e4m3 values (compiled code keeps fp8 operands)
            a_tile = a_tile.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        product = tl.dot(a_tile, b_tile.T)
        if BLOCK_N <= 128:
            b_scale = tl.load(b_scale_ptr + k_step * b_scale_stride_k)
            acc += product * (a_scale * b_scale)[:, None]
        else:
            b_scale = tl.load(b_scale_ptrs + k_step * b_scale_stride_k, mask=cols < N, other=0.0)
            acc += product * a_scale[:, None] * b_scale[None, :]
    return acc


@triton.jit(do_not_specialize=["M", "tile_row_offset", "rows_per_rank", "error_code_base", "timeout_ns"])
def fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scales_ptr, b_scales_ptr,
    M, N, K, lda, ldb, ldc,
    a_scale_stride_m, a_scale_stride_k, b_scale_stride_n, b_scale_stride_k,
    tile_row_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, USE_DESCRIPTORS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    rows_per_rank=1, chunk_flags_ptr=None, chunks_per_rank=1, error_ptr=None, error_code_base=0, timeout_ns=0,
    WAIT_CHUNKS: tl.constexpr = False, USE_TIMER: tl.constexpr = TIMER_AVAILABLE,
    FLATTEN: tl.constexpr = False, EPILOGUE_SUBTILE: tl.constexpr = 1,
):
    out_dtype: tl.constexpr = c_ptr.dtype.element_ty
    if WAIT_CHUNKS:
        tl.static_assert(not (WARP_SPECIALIZE or FLATTEN), "WAIT_CHUNKS needs WARP_SPECIALIZE=False, FLATTEN=False")
        rows_per_chunk = tl.cdiv(rows_per_rank, chunks_per_rank)
    tl.static_assert((BLOCK_N <= 128) or (BLOCK_N % 128 == 0), "BLOCK_N: <= 128 or a multiple of 128")
    program_id = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_row_blocks = tl.cdiv(M, BLOCK_M)
    num_col_blocks = tl.cdiv(N, BLOCK_N)
    num_tiles = num_row_blocks * num_col_blocks
    if USE_DESCRIPTORS:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[lda, 1], block_shape=[BLOCK_M, _BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[ldb, 1], block_shape=[BLOCK_N, _BLOCK_K])
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[ldc, 1],
                                           block_shape=[BLOCK_M, BLOCK_N // EPILOGUE_SUBTILE])
    else:
        a_desc = None
        b_desc = None
        c_desc = None
    store_tile_id = program_id  # FLATTEN: the store's own tile counter (see persistent_gemm_kernel)
    failed = program_id < 0     # a chunk wait of this program expired: skip its remaining tiles
    for tile_id in tl.range(program_id, num_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        row_block, col_block = tile_coordinates(tile_id, num_row_blocks, num_col_blocks, tile_row_offset, GROUP_M)
        first_row = row_block * BLOCK_M
        first_col = col_block * BLOCK_N
        if WAIT_CHUNKS:
            tile_ready = (not failed) & _wait_for_chunks(
                chunk_flags_ptr, error_ptr, error_code_base, first_row, tl.minimum(first_row + BLOCK_M, M) - 1,
                rows_per_rank, chunks_per_rank, rows_per_chunk, timeout_ns, USE_TIMER)
            failed = not tile_ready
        else:
            tile_ready: tl.constexpr = True
        if tile_ready:
            acc = _scaled_k_loop(a_desc, b_desc, a_ptr, b_ptr, a_scales_ptr, b_scales_ptr, first_row, first_col, M,
                                 N, K, lda, ldb, a_scale_stride_m, a_scale_stride_k, b_scale_stride_n,
                                 b_scale_stride_k, BLOCK_M, BLOCK_N, USE_DESCRIPTORS)
            if FLATTEN:
                store_row_block, store_col_block = tile_coordinates(store_tile_id, num_row_blocks, num_col_blocks,
                                                                    tile_row_offset, GROUP_M)
                store_tile_id += num_programs
                store_tile(c_desc, c_ptr, acc.to(out_dtype), store_row_block * BLOCK_M, store_col_block * BLOCK_N,
                           M, N, ldc, BLOCK_M, BLOCK_N, USE_DESCRIPTORS, EPILOGUE_SUBTILE)
            else:
                store_tile(c_desc, c_ptr, acc.to(out_dtype), first_row, first_col, M, N, ldc, BLOCK_M, BLOCK_N,
                           USE_DESCRIPTORS, EPILOGUE_SUBTILE)
