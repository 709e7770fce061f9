"""The epoch operand of the flag kernels, without importing Triton (the pool imports it on CPU too)."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DeviceEpoch", "epoch_args"]


class DeviceEpoch(NamedTuple):
    """Epoch `counter[0] + offset`, read on the device when the kernel runs (counter: int32 [1], CUDA)."""
    counter: torch.Tensor
    offset: int = 0


def epoch_args(epoch: "int | DeviceEpoch") -> tuple[int, torch.Tensor | None, bool]:
    """(epoch or offset, counter or None, DEVICE_EPOCH) as the kernels take them."""
    if isinstance(epoch, DeviceEpoch):
        return epoch.offset, epoch.counter, True
    return epoch, None, False
