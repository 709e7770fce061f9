"""What the ops share for FP8 (e4m3, per-1x128 activation and per-128x128 weight scales; overlap/fp8.py):
the weight cache keyed the way the ops receive weights, and the consumer GEMM on row ranges.

An FP8 AllGather gathers e4m3 rows and their fp32 scales (half the bytes of bf16 plus 1/32 for the scales):
this rank quantises its shard straight into its pool slot, the pulls copy both, and every GEMM reads the
gathered rows. An FP8 GEMM+ReduceScatter quantises its input once and reduce-scatters bf16 partials: the
partials are sums of products, already rounded once to bf16, and an fp8 partial would add a second,
coarser rounding to every reduction (the reduction itself stays in fp32).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

__all__ = ["Fp8Weights", "scale_groups", "fp8_rows_gemm"]

SCALE_GROUP = 128
MAX_WEIGHTS = 4


def scale_groups(k: int) -> int:
    return -(-k // SCALE_GROUP)


class Fp8Weights:
    """(w8 [N, K], w_scales) of an op's weight operand w [K, N] (row-major or `weight.t()`), quantised once per
    weight version: keyed on the tensor that owns the memory (`w._base` for a view, held by weak reference:
    a new tensor that the allocator puts at a freed weight's address is not that weight), the data pointer,
    shape, strides and `_version` (views share their base's version counter, so an optimizer step on the
    parameter invalidates the entry). Valid on the current stream."""

    def __init__(self):
        self._entries: OrderedDict = OrderedDict()
        self.misses = 0

    def get(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from .fp8 import quantize_weight
        owner = w._base if w._base is not None else w
        key = (id(owner), w.data_ptr(), tuple(w.shape), tuple(w.stride()), w._version)
        ref, entry = self._entries.get(key, (None, None))
        if entry is None or ref() is not owner:
            self.misses += 1
            with torch.no_grad():
                w_nk = w.detach().t()
                entry = quantize_weight(w_nk if w_nk.stride(1) == 1 else w_nk.contiguous())
            self._entries[key] = (weakref.ref(owner), entry)
            if len(self._entries) > MAX_WEIGHTS:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return entry


def fp8_rows_gemm(a8: torch.Tensor, a_scales: torch.Tensor, weights: tuple, out: torch.Tensor) -> None:
    """out [rows, N] = a8 [rows, K] (with its row scales) @ w, through the FP8 Triton GEMM (any scale strides,
    writes into `out` in place), on the current stream."""
    from .fp8 import fp8_gemm
    w8, w_scales = weights
    fp8_gemm(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales, out=out)
