"""Argument checks shared by the ops: every message names the argument, the value and what is allowed.

They only look at shapes, dtypes and devices, which are equal on all ranks of a correct program, so every
rank raises the same error before any communication starts.
"""

from __future__ import annotations

import torch

__all__ = ["OpInputError", "check_tensor", "check_divisible", "check_at_most",
           "check_weight"]


class OpInputError(ValueError):
    """A public op, layer or pool was called with arguments it cannot serve."""


def check_tensor(name: str, t, *, dtype: torch.dtype, device: torch.device, ndim: int = 2,
                 shape: tuple | None = None, contiguous: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise OpInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise OpInputError(f"{name} has dtype {t.dtype}; this op was built for {dtype}")
    if t.device != device:
        raise OpInputError(f"{name} is on {t.device}; this op runs on {device}")
    if t.dim() != ndim:
        raise OpInputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise OpInputError(f"{name} has shape {tuple(t.shape)}; dim {axis} must be {want}")
    if contiguous and not t.is_contiguous():
        raise OpInputError(f"{name} must be contiguous (row-major), got strides {t.stride()} for shape "
                           f"{tuple(t.shape)}; call .contiguous() first")


def check_weight(name: str, w, *, dtype: torch.dtype, device: torch.device, shape: tuple) -> bool:
    """Like check_tensor for a [K, N] weight that may also be the transpose view of a row-major [N, K]
    (`weight.t()` of an nn.Linear-style tensor: no copy). Returns whether it is that transpose."""
    check_tensor(name, w, dtype=dtype, device=device, shape=shape, contiguous=False)
    if w.is_contiguous():
        return False
    if w.t().is_contiguous():
        return True
    raise OpInputError(f"{name} must be row-major [K, N] or the transpose view of a row-major [N, K] "
                       f"(weight.t()), got strides {w.stride()} for shape {tuple(w.shape)}; call .contiguous() "
                       f"first")


def check_divisible(name: str, value: int, divisor: int, what: str) -> None:
    if value % divisor:
        raise OpInputError(f"{name}={value} must be divisible by {what} ({divisor})")


def check_at_most(name: str, value: int, limit: int, what: str) -> None:
    if value > limit:
        raise OpInputError(f"{name}={value} exceeds {what} ({limit}); build the op with a larger one")
