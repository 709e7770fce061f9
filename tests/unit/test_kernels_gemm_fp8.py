"""The FP8 block-scaled GEMM (kernels/gemm_fp8.py through overlap.gemm.fp8.fp8_gemm) on CPU (Triton interpreter):
against the fp32 product of the dequantised operands, with M/N/K tails (K = 1280 and 1344), padding past K
and past the last scale group poisoned, both block-N scale paths, the AllGather chunk waits and bad input.

Tolerance: the kernel computes the dequantised product exactly up to fp32 summation order, then rounds to
bf16 (the interpreter truncates: up to 2**-8 relative per element, ~3.3e-3 Frobenius on these inputs; the
GPU rounds to nearest, ~1.6e-3), so FP8_TOLERANCE = 5e-3. A wrong or stale scale moves a 128-column
group's contribution by a factor of 2**+-3 (the inputs' group magnitudes differ that much): far outside it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tp_overlap.kernels.constants import ag_tile_row_offset  # noqa: E402
from tp_overlap.gemm import (FP8_DTYPE, ChunkWait, GemmBlocks, dequantize_activation, dequantize_weight,  # noqa: E402
                          fp8_gemm, quantize_activation, quantize_weight, scaled_mm_reference)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_TOLERANCE = 5e-3
FP8_NAN = 0x7F  # float8_e4m3fn NaN byte
SMALL = GemmBlocks(16, 32, 128, 2, 4, 1)
WIDE = GemmBlocks(16, 256, 128, 2, 4, 1)  # BLOCK_N > 128: one B scale per 128 columns of the tile


def relative_error(actual, expected):
    return (torch.linalg.norm(actual.float().cpu() - expected) / torch.linalg.norm(expected)).item()


def grouped(rows, cols, seed, block_rows):
    """Gaussian values scaled by 2**randint(-3, 3) per (block of rows, 128 columns): every scale matters."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    factors = torch.exp2(torch.randint(-3, 4, (-(-rows // block_rows), -(-cols // 128)), generator=generator).float())
    x *= factors.repeat_interleave(block_rows, 0).repeat_interleave(128, 1)[:rows, :cols]
    return x.bfloat16().to(DEVICE)


def operands(m, n, k, seed):
    x8, x_scales = quantize_activation(grouped(m, k, seed, 1))
    w8, w_scales = quantize_weight(grouped(n, k, seed + 1, 128) * 0.05)
    expected = dequantize_activation(x8, x_scales).cpu() @ dequantize_weight(w8, w_scales).cpu().T
    return x8, x_scales, w8, w_scales, expected


def poisoned_copies(x8, x_scales, k_pad, group_pad):
    """x8 and its scales copied into larger buffers whose padding (columns past K, groups past the last)
    holds NaN: a read past K or past the last scale group turns outputs into NaN."""
    m, k = x8.shape
    storage = torch.full((m, k + k_pad), FP8_NAN, dtype=torch.uint8, device=x8.device).view(FP8_DTYPE)
    storage[:, :k] = x8
    groups = x_scales.shape[1]
    scale_storage = torch.full((groups + group_pad, m), float("nan"), device=x8.device)
    scale_storage[:groups] = x_scales.t()
    return storage[:, :k], scale_storage.t()[:, :groups]


@pytest.mark.parametrize("m,n,k,blocks", [
    (40, 72, 1344, SMALL),    # K tail of 64: 10.5 groups; M and N tails
    (33, 136, 1280, SMALL),   # K = 10 whole groups
    (33, 264, 1344, WIDE),    # vector B scales; N tail inside the second 128-column block
    (50, 40, 1000, SMALL),    # K % 16 != 0: no descriptors, masked loads
])
def test_fp8_gemm_matches_the_dequantised_product_and_never_reads_past_k(m, n, k, blocks):
    x8, x_scales, w8, w_scales, expected = operands(m, n, k, seed=m + n + k)
    x8_padded, x_scales_padded = poisoned_copies(x8, x_scales, k_pad=48, group_pad=2)
    out_storage = torch.full((m, n + 8), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = fp8_gemm(a8=x8_padded, a_scales=x_scales_padded, w8=w8, w_scales=w_scales, out=out_storage[:, :n],
                   num_programs=3, blocks=blocks)
    assert out.data_ptr() == out_storage.data_ptr()
    assert relative_error(out, expected) <= FP8_TOLERANCE
    assert torch.isnan(out_storage[:, n:]).all(), "a store went past N"


def test_a_big_call_then_a_small_one_leaves_nothing_stale():
    # the second call reuses the first call's buffers (prefixes of them), refilled with its own values
    big = operands(96, 144, 1344, seed=1)
    x8_big, scales_big = poisoned_copies(big[0], big[1], k_pad=0, group_pad=0)
    out_big = torch.full((96, 144), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    fp8_gemm(a8=x8_big, a_scales=scales_big, w8=big[2], w_scales=big[3], out=out_big, num_programs=4, blocks=SMALL)
    assert relative_error(out_big, big[4]) <= FP8_TOLERANCE
    x8, x_scales, w8, w_scales, expected = operands(40, 72, 1280, seed=2)
    small_x8 = x8_big.view(torch.uint8).flatten()[:40 * 1280].view(40, 1280).view(FP8_DTYPE)
    small_x8.copy_(x8)
    small_scales = scales_big.t().flatten()[:10 * 40].view(10, 40).t()
    small_scales.copy_(x_scales)
    out = out_big.flatten()[:40 * 72].view(40, 72).fill_(float("nan"))
    fp8_gemm(a8=small_x8, a_scales=small_scales, w8=w8, w_scales=w_scales, out=out, num_programs=4, blocks=SMALL)
    assert relative_error(out, expected) <= FP8_TOLERANCE


def test_fp8_gemm_agrees_with_the_reference_product_and_the_bf16_one():
    x = grouped(48, 1344, seed=5, block_rows=1)
    w = grouped(72, 1344, seed=6, block_rows=128) * 0.05
    x8, x_scales = quantize_activation(x)
    w8, w_scales = quantize_weight(w)
    ours = fp8_gemm(a8=x8, a_scales=x_scales, w8=w8, w_scales=w_scales, blocks=SMALL)
    reference = scaled_mm_reference(a8=x8, a_scales=x_scales, w8=w8, w_scales=w_scales)
    assert ours.dtype == reference.dtype == torch.bfloat16
    assert relative_error(ours, reference.float().cpu()) <= FP8_TOLERANCE
    # what e4m3 costs against the unquantised bf16 product (documented in overlap/gemm/fp8.py)
    assert relative_error(ours, (x.float() @ w.float().T).cpu()) <= 6e-2


CODE_BASE = 100  # the error code of chunk flag 0 (the pool passes its device word's code)


def chunk_wait(world, rows_per_rank, chunks):
    """Flags SET (1) for every chunk; error words = the control page [code, value, abort]."""
    flags = torch.ones(world * chunks, dtype=torch.int32, device=DEVICE)
    return ChunkWait(flags=flags, rows_per_rank=rows_per_rank, chunks_per_rank=chunks,
                     error_words=torch.zeros(3, dtype=torch.int32, device=DEVICE), error_code_base=CODE_BASE,
                     timeout_s=2.0)


def test_chunk_wait_mode_with_ready_flags_matches_and_a_missing_chunk_is_named():
    world, rows_per_rank, chunks = 3, 23, 2
    x8, x_scales, w8, w_scales, expected = operands(world * rows_per_rank, 72, 1344, seed=7)
    wait = chunk_wait(world, rows_per_rank, chunks)
    out = torch.full((world * rows_per_rank, 72), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    fp8_gemm(a8=x8, a_scales=x_scales, w8=w8, w_scales=w_scales, out=out, num_programs=3, blocks=SMALL,
             tile_row_offset=ag_tile_row_offset(1, rows_per_rank, SMALL.block_m), chunk_wait=wait)
    assert wait.error_words.tolist() == [0, 0, 0]
    assert relative_error(out, expected) <= FP8_TOLERANCE
    stale = chunk_wait(world, rows_per_rank, chunks)
    stale.flags[3] = 0                       # owner 1's second chunk has not arrived
    out.fill_(float("nan"))
    fp8_gemm(a8=x8, a_scales=x_scales, w8=w8, w_scales=w_scales, out=out, num_programs=3, blocks=SMALL,
             chunk_wait=stale)
    assert stale.error_words[0].item() == CODE_BASE + 3 and stale.error_words[1].item() == 1
    first = rows_per_rank + (rows_per_rank + 1) // 2   # owner 1's second chunk: its rows were never computed
    assert torch.isnan(out[first:2 * rows_per_rank].float()).all()


def test_bad_operands_are_refused_with_their_shapes():
    x8, x_scales, w8, w_scales, _ = operands(8, 16, 256, seed=3)
    with pytest.raises(ValueError, match=r"a_scales must be float32 \(8, 2\) for a8 \(8, 256\)"):
        fp8_gemm(a8=x8, a_scales=x_scales[:, :1], w8=w8, w_scales=w_scales)
    with pytest.raises(ValueError, match=r"disagree on K"):
        fp8_gemm(a8=x8, a_scales=x_scales, w8=w8[:, :128], w_scales=w_scales)
    with pytest.raises(TypeError, match=r"fp8_gemm: w8: dtype torch.bfloat16"):
        fp8_gemm(a8=x8, a_scales=x_scales, w8=w8.bfloat16(), w_scales=w_scales)
    with pytest.raises(ValueError, match=r"out must be \(8, 16\)"):
        fp8_gemm(a8=x8, a_scales=x_scales, w8=w8, w_scales=w_scales, out=torch.empty(8, 8, device=DEVICE))
    with pytest.raises(ValueError, match="BLOCK_K must be 128"):
        fp8_gemm(a8=x8, a_scales=x_scales, w8=w8, w_scales=w_scales, blocks=GemmBlocks(16, 32, 64, 2, 4, 1))
    with pytest.raises(ValueError, match="chunk_wait needs blocks without ws"):
        fp8_gemm(a8=x8, a_scales=x_scales, w8=w8, w_scales=w_scales, chunk_wait=chunk_wait(2, 4, 1),
                 blocks=GemmBlocks(16, 32, 128, 2, 4, 1, warp_specialize=True))
