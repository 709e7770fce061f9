"""FP8 (e4m3) quantisation with fine-grained scales, the layouts `kernels/gemm_fp8.py` and cuBLAS read.

Only ``@triton.jit`` code. Both kernels quantise a group as ``scale = max(amax, AMAX_FLOOR) / 448`` and
``q = e4m3(clamp(x * (448 / max(amax, AMAX_FLOOR)), -448, 448))``, rounded to nearest, ties to even, so
that ``q * scale`` approximates x (the floor keeps all-zero groups finite: their q is 0). Divisions are
``div_rn`` (Triton's ``/`` on fp32 is approximate on the GPU), and the rounding to the e4m3 grid is done
in fp32 by ``round_to_e4m3`` before the (then exact) conversion, because the interpreter's fp32 -> fp8
conversion truncates: the GPU and the interpreter give the same bytes as ``torch``'s RNE conversion.

``quantize_activation_kernel`` (grid ``(cdiv(M, BLOCK_M), cdiv(K, 128))``): x [M, K] (bf16/fp16/fp32, row
stride ``ldx``) -> q [M, K] e4m3 (row stride ``ldq``) and one fp32 scale per row per 128-wide K group at
``scales + m * scale_stride_m + g * scale_stride_k`` (cuBLAS's layout: ``scale_stride_m = 1``,
``scale_stride_k = M``, i.e. a [cdiv(K, 128), M] tensor seen as [M, cdiv(K, 128)]). Groups cut by K are
quantised over their valid columns.

``quantize_weight_kernel`` (grid ``(cdiv(N, 128), cdiv(K, 128))``): w [N, K] (an ``nn.Linear`` weight,
row stride ``ldw``) -> q [N, K] e4m3 and one fp32 scale per 128x128 block at ``scales + nb *
scale_stride_n + kb * scale_stride_k`` (row-major [cdiv(N, 128), cdiv(K, 128)]: ``scale_stride_k = 1``).
"""

import triton
import triton.language as tl

from .constants import SCALE_GROUP

__all__ = ["E4M3_MAX", "AMAX_FLOOR", "SCALE_GROUP", "round_to_e4m3", "quantize_activation_kernel",
           "quantize_weight_kernel"]

E4M3_MAX = 448.0      # largest finite float8_e4m3fn
AMAX_FLOOR = 2.0 ** -64   # groups below this are quantised as if their amax were this (all-zero: q = 0)
_GROUP = tl.constexpr(SCALE_GROUP)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_MIN_NORMAL = tl.constexpr(2.0 ** -6)        # smallest normal e4m3; below it the grid step is 2**-9
_SUBNORMAL_STEPS = tl.constexpr(512.0)       # 1 / 2**-9
_SUBNORMAL_STEP = tl.constexpr(2.0 ** -9)   # a multiplication (exact) rather than Triton's approximate /
_ROUNDING_MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2**23: adding it rounds |v| < 2**22 to an integer (RNE)


@triton.jit
def round_to_e4m3(y):
    """fp32 y with |y| <= 448 rounded to the nearest e4m3 value, ties to even (still fp32, exactly
    representable in e4m3; the sign of zero kept, as torch keeps it)."""
    bits = y.to(tl.int32, bitcast=True)
    # normal range: keep 3 of fp32's 23 mantissa bits, rounding on the 20 dropped ones (RNE on the bits;
    # a carry into the exponent is the right answer)
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = kept.to(tl.float32, bitcast=True)
    # subnormal range: a uniform grid of 2**-9; |y| * 512 is exact, the magic add rounds it to an integer
    magnitude = ((tl.abs(y) * _SUBNORMAL_STEPS + _ROUNDING_MAGIC) - _ROUNDING_MAGIC) * _SUBNORMAL_STEP
    subnormal = tl.where(bits < 0, -magnitude, magnitude)
    return tl.where(tl.abs(y) >= _MIN_NORMAL, normal, subnormal)


@triton.jit
def _scale_and_inverse(amax):
    """(amax / 448, 448 / amax) with amax floored, both correctly rounded."""
    amax = tl.maximum(amax, _AMAX_FLOOR)
    return tl.div_rn(amax, _E4M3_MAX), tl.div_rn(_E4M3_MAX, amax)


@triton.jit(do_not_specialize=["M"])
def quantize_activation_kernel(x_ptr, q_ptr, scales_ptr, M, K, ldx, ldq, scale_stride_m, scale_stride_k,
                               BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    cols = group * _GROUP + tl.arange(0, _GROUP)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * ldx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale, inverse = _scale_and_inverse(tl.max(tl.abs(x), axis=1))
    y = tl.minimum(tl.maximum(x * inverse[:, None], -_E4M3_MAX), _E4M3_MAX)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * ldq + cols[None, :], round_to_e4m3(y).to(tl.float8e4nv),
             mask=mask)
    tl.store(scales_ptr + rows.to(tl.int64) * scale_stride_m + group * scale_stride_k, scale, mask=rows < M)


@triton.jit
def quantize_weight_kernel(w_ptr, q_ptr, scales_ptr, N, K, ldw, ldq, scale_stride_n, scale_stride_k):
    row_block = tl.program_id(0)
    col_block = tl.program_id(1)
    rows = row_block * _GROUP + tl.arange(0, _GROUP)
    cols = col_block * _GROUP + tl.arange(0, _GROUP)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * ldw + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale, inverse = _scale_and_inverse(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
    y = tl.minimum(tl.maximum(w * inverse, -_E4M3_MAX), _E4M3_MAX)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * ldq + cols[None, :], round_to_e4m3(y).to(tl.float8e4nv),
             mask=mask)
    tl.store(scales_ptr + row_block * scale_stride_n + col_block * scale_stride_k, scale)
