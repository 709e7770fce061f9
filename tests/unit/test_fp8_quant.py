"""FP8 quantisation (kernels/quant_fp8.py through overlap/gemm/fp8.py) on CPU (Triton interpreter): the exact
e4m3 bytes and scales of a torch reference quantiser, the cuBLAS scale layouts, tails and all-zero groups,
and the weight cache's invalidation."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tp_overlap.gemm import FP8_DTYPE, Fp8WeightCache, dequantize_activation, dequantize_weight  # noqa: E402
from tp_overlap.gemm.fp8 import quantize_activation, quantize_activation_reference as reference_activation  # noqa: E402
from tp_overlap.gemm.fp8 import quantize_weight, quantize_weight_reference as reference_weight  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def varied(rows, cols, seed, dtype=torch.bfloat16):
    """Gaussian values with magnitudes spread over 2**-20 .. 2**8 by row, so that groups hit e4m3's
    subnormals, its top end and many scales."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    x *= torch.exp2(torch.linspace(-20, 8, rows))[:, None]
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("m,k,dtype", [(37, 300, torch.bfloat16), (64, 1344, torch.bfloat16), (5, 1280, torch.float16),
                                       (33, 200, torch.float32)])
def test_activation_quantiser_gives_the_reference_bytes_and_cublas_scale_layout(m, k, dtype):
    x = varied(m, k, seed=m + k, dtype=dtype)
    x[1, :128] = 0.0                         # an all-zero group: finite scale, q = 0
    x[2, 128:] = 0.0                         # zero groups after a non-zero one in the same row
    q, scales = quantize_activation(x)
    expected_q, expected_scales = reference_activation(x.cpu())
    assert q.dtype == FP8_DTYPE and q.shape == (m, k)
    assert scales.dtype == torch.float32 and scales.shape == (m, -(-k // 128)) and scales.stride() == (1, m)
    # values, not bytes: the sign of a zero may differ
    assert torch.equal(q.cpu().float(), expected_q.float())
    assert torch.equal(scales.cpu(), expected_scales)
    assert torch.isfinite(scales).all() and (q[1, :128].float() == 0).all()
    # round trip: e4m3 keeps 3 mantissa bits (relative 2**-4), and subnormals a step of 2**-9 * 448 scales
    back = dequantize_activation(q, scales).cpu()
    bound = x.cpu().float().abs() * 2.0 ** -4 + scales.cpu().repeat_interleave(128, 1)[:, :k] * 2.0 ** -9
    assert ((back - x.cpu().float()).abs() <= bound).all()


@pytest.mark.parametrize("n,k", [(200, 300), (128, 1344), (130, 1280), (128, 512)])
def test_weight_quantiser_gives_the_reference_bytes_per_128x128_block(n, k):
    w = varied(n, k, seed=n * k) * 0.01
    w[:128, :128] = 0.0
    q, scales = quantize_weight(w)
    expected_q, expected_scales = reference_weight(w.cpu())
    groups = -(-k // 128)
    # rows contiguous, padded to 16 bytes (TMA reads them): 3 groups -> stride 4, 11 -> 12, 10 -> 12
    assert scales.shape == (-(-n // 128), groups) and scales.stride() == (-(-groups // 4) * 4, 1)
    if groups % 4 == 0:  # no padding where torch._scaled_mm takes the scales: the same tensor as before
        assert scales.is_contiguous()
    assert torch.equal(q.cpu().float(), expected_q.float())
    assert torch.equal(scales.cpu(), expected_scales)
    back = dequantize_weight(q, scales).cpu()
    full = scales.cpu().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    assert ((back - w.cpu().float()).abs() <= w.cpu().float().abs() * 2.0 ** -4 + full * 2.0 ** -9).all()


def test_rows_with_a_padded_stride_and_bad_inputs():
    storage = varied(20, 272, seed=4)
    x = storage[:, :260]                     # row stride 272, K tail of 4
    q, scales = quantize_activation(x)
    expected_q, expected_scales = reference_activation(x.cpu().contiguous())
    assert torch.equal(q.cpu().float(), expected_q.float()) and torch.equal(scales.cpu(), expected_scales)
    with pytest.raises(TypeError, match=r"quantize_activation: x: dtype torch.int32"):
        quantize_activation(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected a 2-D tensor, got shape \(4,\)"):
        quantize_weight(torch.zeros(4))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        quantize_weight(torch.zeros(8, 6).t())


def test_weight_cache_quantises_once_per_version_and_follows_in_place_updates():
    cache = Fp8WeightCache()
    weight = torch.nn.Parameter(varied(130, 260, seed=9) * 0.02)
    w8, scales = cache.get(weight)
    again = cache.get(weight)
    assert again[0] is w8 and again[1] is scales and (cache.hits, cache.misses) == (1, 1)
    with torch.no_grad():
        weight.mul_(3.0)                     # an optimizer step: _version changes, data_ptr does not
    w8_new, scales_new = cache.get(weight)
    assert cache.misses == 2 and w8_new is not w8
    assert torch.equal(scales_new.cpu(), reference_weight(weight.detach().cpu())[1])
    assert torch.allclose(scales_new.cpu(), scales.cpu() * 3.0, rtol=1e-2)  # bf16 rounds the product
    other = torch.nn.Parameter(weight.detach().clone())   # same values, another tensor: its own entry
    cache.get(other)
    assert cache.misses == 3 and len(cache) == 2
    del other
    assert len(cache) == 1, "an entry outlived its weight"
    cache.invalidate(weight)
    cache.get(weight)
    assert cache.misses == 4


def test_weight_cache_does_not_mistake_a_new_tensor_at_a_freed_weights_address():
    # The caching allocator hands a freed weight's address to the next tensor of that size: same data_ptr,
    # shape, strides and _version, other values. The ops pass views (w.t()): the cache keys on their owner.
    cache = Fp8WeightCache()
    first = varied(256, 130, seed=3)                 # an op's operand w [K, N]; the cache gets w.t()
    with torch.no_grad():
        first.add_(0)                                 # _version 1, as the stand-in below will have
    cache.get(first.t())
    assert cache.get(first.t()) is not None and (cache.hits, cache.misses) == (1, 1)   # a fresh view: a hit
    second = torch.empty(0, dtype=first.dtype).set_(first.untyped_storage(), 0, first.shape, first.stride())
    assert (second.data_ptr(), second._version) == (first.data_ptr(), first._version)
    del first
    second.data.copy_(varied(256, 130, seed=4))       # new values; .data writes leave _version alone
    _, scales = cache.get(second.t())
    assert cache.misses == 2 and len(cache) == 1      # the dead owner's entry went with it
    assert torch.equal(scales, reference_weight(second.t().contiguous())[1])
