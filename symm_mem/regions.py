"""What a region asks of a pool, stated once: the op that reserves it and `pool_requirements` (which sizes
a pool before the ops exist) read the same `RegionSpec`s, and `requirements` applies the pool's own
alignment to them."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .layout import align

__all__ = ["RegionSpec", "PoolRequirements", "requirements"]


class RegionSpec(NamedTuple):
    """One region: its name, shape and dtype, and the control / device flags that come with it."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    num_signals: int = 0
    num_device_flags: int = 0


class PoolRequirements(NamedTuple):
    """What a pool needs for a set of regions: pass the three fields to SymmetricPool as they are."""
    size_bytes: int
    num_signal_words: int
    num_device_words: int

    def __mul__(self, times: int) -> "PoolRequirements":
        return PoolRequirements(*(times * x for x in self))


def requirements(specs) -> PoolRequirements:
    """The pool size and flag words that reserving every spec needs (each region starts aligned)."""
    specs = list(specs)
    return PoolRequirements(sum(align(math.prod(s.shape) * s.dtype.itemsize) for s in specs),
                            sum(s.num_signals for s in specs), sum(s.num_device_flags for s in specs))
