"""Shared CPU memory mappings made with libc, so that unmapping is explicit and counted.

Python's mmap objects refuse to close while a tensor still exports their buffer; the pools must be able
to close deterministically, so they map and unmap through libc and wrap the address in a tensor.
`SharedMapping` ties the unmap to the last tensor or array over the mapping: a pool's close drops its own
references, and a view that a caller still holds keeps the memory mapped (reading it after close reads
stale data instead of faulting).
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_fd(fd: int, size_bytes: int) -> int:
    """Map `size_bytes` of the file behind `fd` read/write and shared; returns the address."""
    addr = _libc.mmap(None, size_bytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size_bytes} bytes failed: {os.strerror(err)}")
    return addr


def unmap(addr: int, size_bytes: int) -> None:
    if _libc.munmap(ctypes.c_void_p(addr), size_bytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap failed: {os.strerror(err)}")


def byte_tensor(addr: int, size_bytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over mapped memory; it does not own the mapping (unmap invalidates it)."""
    if size_bytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    buf = (ctypes.c_uint8 * size_bytes).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.uint8, count=size_bytes)


class SharedMapping:
    """`size_bytes` of the file behind `fd`, mapped shared; unmapped once neither this object nor any tensor
    or array made by `bytes()` / `int32()` (or a view of one) is alive."""

    def __init__(self, fd: int, size_bytes: int):
        self.size_bytes = size_bytes
        self.address = map_fd(fd, size_bytes)

    def _array(self, ctype, count: int):
        array = (ctype * count).from_address(self.address)
        array._mapping = self  # the ctypes array (kept by every tensor / ndarray over it) owns the mapping
        return array

    def bytes(self) -> torch.Tensor:
        """The whole mapping as a uint8 tensor that keeps it mapped."""
        return torch.frombuffer(self._array(ctypes.c_uint8, self.size_bytes), dtype=torch.uint8)

    def int32(self, count: int) -> np.ndarray:
        """The first `count` int32 words as a numpy array that keeps the mapping mapped."""
        return np.ctypeslib.as_array(self._array(ctypes.c_int32, count))

    def __del__(self):
        address = getattr(self, "address", None)
        if address is not None:
            self.address = None
            try:
                unmap(address, self.size_bytes)
            except (OSError, TypeError, AttributeError):  # interpreter shutdown: nothing left to protect
                pass
