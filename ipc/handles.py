"""Export/open/close of one allocation base, per device kind.

A `Handle` is what crosses process boundaries: it says who exported it (pid), where the allocation base
is and how large it is, and carries the backend's opaque bytes. Opening returns the address of the base
mapped in this process; closing unmaps it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .mapping import byte_tensor, map_fd, unmap

from .errors import IpcError


@dataclass(frozen=True)
class Handle:
    kind: str          # "cuda" | "host"
    pid: int           # exporting process
    base: int          # base address in the exporting process
    size_bytes: int
    payload: bytes     # cudaIpcMemHandle_t bytes, or b"fd=<n>" for host memfds


# ----- host: memfd-backed allocations, opened through /proc/<pid>/fd ----------------------------------
_host_allocations: dict[int, tuple[int, int]] = {}  # base address -> (fd, size)


def host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor in shareable memory (an anonymous memfd): the CPU counterpart of cudaMalloc for
    IpcPool. Freed with `host_free` (IpcPool does not own it, like it does not own CUDA allocations)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = max(1, torch.Size(shape).numel() * dtype.itemsize)
    fd = os.memfd_create("tpov-ipc", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    addr = map_fd(fd, nbytes)
    _host_allocations[addr] = (fd, nbytes)
    return byte_tensor(addr, nbytes)[:torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)


def host_free(tensor: torch.Tensor) -> None:
    base, _ = _host_base(tensor.data_ptr())
    fd, size = _host_allocations.pop(base)
    unmap(base, size)
    os.close(fd)


def host_allocation_count() -> int:
    return len(_host_allocations)


def _host_base(ptr: int) -> tuple[int, int]:
    for base, (_, size) in _host_allocations.items():
        if base <= ptr < base + size:
            return base, size
    raise IpcError(f"CPU tensor at 0x{ptr:x} is not in shareable memory; allocate it with "
                   f"tp_overlap.ipc.host_empty(shape, dtype) so that peers can map it")


def export_host(ptr: int) -> Handle:
    base, size = _host_base(ptr)
    fd, _ = _host_allocations[base]
    return Handle("host", os.getpid(), base, size, f"fd={fd}".encode())


def open_host(handle: Handle) -> int:
    fd_number = int(handle.payload.decode().split("=")[1])
    fd = os.open(f"/proc/{handle.pid}/fd/{fd_number}", os.O_RDWR)
    try:
        return map_fd(fd, handle.size_bytes)
    finally:
        os.close(fd)


def close_host(addr: int, handle: Handle) -> None:
    unmap(addr, handle.size_bytes)


def host_bytes(addr: int, size_bytes: int) -> torch.Tensor:
    return byte_tensor(addr, size_bytes)


# ----- CUDA: cudaIpcGetMemHandle on the allocation base ----------------------------------------------
def _check(result, what: str):
    err, *rest = result
    if int(err) != 0:
        raise IpcError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else rest


def export_cuda(ptr: int) -> Handle:
    from cuda.bindings import driver, runtime

    base, size = _check(driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    handle = _check(runtime.cudaIpcGetMemHandle(int(base)), "cudaIpcGetMemHandle "
                    "(expandable_segments allocations cannot be exported; unset that allocator option)")
    return Handle("cuda", os.getpid(), int(base), int(size), bytes(handle.reserved))


def open_cuda(handle: Handle) -> int:
    from cuda.bindings import runtime

    raw = runtime.cudaIpcMemHandle_t()
    raw.reserved = handle.payload
    ptr = _check(runtime.cudaIpcOpenMemHandle(raw, runtime.cudaIpcMemLazyEnablePeerAccess),
                 "cudaIpcOpenMemHandle")
    return int(ptr)


def close_cuda(addr: int, handle: Handle) -> None:
    from cuda.bindings import runtime

    _check((runtime.cudaIpcCloseMemHandle(addr)[0], None), "cudaIpcCloseMemHandle")


class _CudaArray:
    """Minimal __cuda_array_interface__ so torch can wrap an opened peer address without copying."""

    def __init__(self, addr: int, size_bytes: int):
        self.__cuda_array_interface__ = {"shape": (size_bytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 3, "strides": None}


def cuda_bytes(addr: int, size_bytes: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_CudaArray(addr, size_bytes), device=device)
