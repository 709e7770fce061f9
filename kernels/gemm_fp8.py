"""The K loop of the FP8 GEMM with fine-grained scales (DeepSeek-V3 / DeepGEMM recipe), bf16 output.

Only ``@triton.jit`` code. The FP8 GEMM is ``tp_overlap.kernels.gemm.persistent_gemm_kernel`` given ``scales``
(same tile walk, chunk waits and local store); its K loop ``scaled_k_loop`` computes

    C[m, n] = sum_g (A[m, g-th 128 columns] . B[n, g-th 128 columns]) * a_scale[m, g] * b_scale[n // 128, g]

with A [M, K] e4m3 (row stride ``lda``), B [N, K] e4m3 row-major (``ldb``, ``B_TRANSPOSED``: the ``nn.Linear``
weight layout, the only one fp8 wgmma reads without a transpose: it needs K-major operands), C [M, N]
(``ldc``; bf16 or any float type). Scales are fp32: ``a_scale[m, g]`` at ``a_scales + m * a_scale_stride_m
+ g * a_scale_stride_k`` (one per row per 128-wide K group; cuBLAS's layout is stride_m = 1, stride_k = M)
and ``b_scale[j, g]`` at ``b_scales + j * b_scale_stride_n + g * b_scale_stride_k`` (one per 128x128 block of
B; row-major [cdiv(N, 128), cdiv(K, 128)]). The layouts are those of ``kernels/quant_fp8.py``.

* BLOCK_K is SCALE_GROUP (128): each K step multiplies one fresh fp32 product of the tile by one scale
  per row of A and one per 128-column block of B, then adds it to the fp32 accumulator. The fresh product
  per 128 also bounds the error of the tensor cores' reduced-precision fp8 accumulation (DeepGEMM's
  "promotion"). BLOCK_N <= 128 reads one B scale per step (tiles never straddle a 128-column block).
* K tails: the last group is partial (K % 128 != 0); descriptors read zeros past K, the pointer path
  masks, and the loop runs cdiv(K, 128) steps, so it never reads a scale past the last group.
* With chunk waits (the fused AllGather consumer) the scales of A rows must be ready when their chunk's
  flag is (quantise before the gather, or gather them with the rows).
"""

import triton
import triton.language as tl

from .gemm_mainloop import WIDEN_DOT_OPERANDS
from .constants import SCALE_GROUP

__all__ = ["scaled_k_loop", "SCALE_GROUP", "SCALE_BLOCK_K"]

SCALE_BLOCK_K = tl.constexpr(SCALE_GROUP)  # for @triton.jit code


@triton.jit
def scaled_k_loop(a_desc, b_desc, a_ptr, b_ptr, scales, first_row, first_col, M, N, K, lda, ldb,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_DESCRIPTORS: tl.constexpr):
    """The fp32 accumulator of the tile at (first_row, first_col): one fresh product per 128-deep K step,
    scaled by its A row scales and B block scale. ``scales`` is (a_scales_ptr, b_scales_ptr,
    a_scale_stride_m, a_scale_stride_k, b_scale_stride_n, b_scale_stride_k)."""
    a_scales_ptr, b_scales_ptr, a_scale_stride_m, a_scale_stride_k, b_scale_stride_n, b_scale_stride_k = scales
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = first_col + tl.arange(0, BLOCK_N)
    # Rows past M read scale 0 (their products are never stored); so do columns past N.
    a_scale_ptrs = a_scales_ptr + rows.to(tl.int64) * a_scale_stride_m
    if BLOCK_N <= 128:  # the scale group
        b_scale_ptr = b_scales_ptr + (first_col // SCALE_BLOCK_K) * b_scale_stride_n
    else:
        b_scale_ptrs = b_scales_ptr + (cols // SCALE_BLOCK_K) * b_scale_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_step in range(tl.cdiv(K, SCALE_BLOCK_K)):
        first_k = k_step * SCALE_BLOCK_K
        if USE_DESCRIPTORS:
            a_tile = a_desc.load([first_row, first_k])
            b_tile = b_desc.load([first_col, first_k])
        else:
            ks = first_k + tl.arange(0, SCALE_BLOCK_K)
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
