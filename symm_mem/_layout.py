"""The layout every rank's pool allocation shares: alignment, reserved signal words, region records, and
which backend serves a device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import PoolError

__all__ = ["ABORT_WORD", "ALIGN_BYTES", "BACKENDS", "ERROR_WORD", "FIRST_FLAG_WORD", "PoolStats", "Region",
           "align", "resolve_backend"]

ALIGN_BYTES = 256
ERROR_WORD = 0        # device waits: [code, expected epoch] of the first wait that expired
ABORT_WORD = 2        # (aborting rank + 1) | reason << 8, written into every rank by `abort()`
FIRST_FLAG_WORD = 16  # words 0..15 are reserved for error reporting
BACKENDS = ("auto", "torch", "nvshmem", "ipc", "host")


@dataclass(frozen=True)
class Region:
    name: str
    offset_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    first_flag_word: int
    num_signals: int


@dataclass(frozen=True)
class PoolStats:
    backend: str
    rendezvous_count: int
    allocations: int
    bytes_total: int
    bytes_reserved: int
    num_regions: int
    signal_words_reserved: int
    handles_open: int


def align(n: int, a: int = ALIGN_BYTES) -> int:
    return (n + a - 1) // a * a


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise PoolError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "torch" if device.type == "cuda" else "host"
    if (backend == "host") != (device.type == "cpu"):
        raise PoolError(f"backend={backend!r} does not serve device {device}; host is for cpu, "
                        f"torch, nvshmem and ipc for cuda")
    return backend
