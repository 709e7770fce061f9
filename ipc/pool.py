"""IpcPool: share existing allocations with the peers of a group, exported and opened once each.

    with IpcPool(group=tp_group) as ipc:
        ipc.exchange({"x": x, "w": w})          # collective: one export per allocation base, one gather
        x_on_peer = ipc.peer("x", rank=1)        # opened on first use, cached, closed on close()

Tensors of one allocation share one handle (the base is exported once; each name records its offset).
Peer tensors are views into mappings that `close()` releases: do not use them after close().
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import handles as H
from .errors import IpcError, PoolClosedError

__all__ = ["IpcPool", "IpcStats", "TensorRecord", "live_ipc_pool_count"]

_live = 0


def live_ipc_pool_count() -> int:
    return _live


@dataclass(frozen=True)
class TensorRecord:
    handle: H.Handle
    offset_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class IpcStats:
    exchanges: int
    exported: int
    opened: int
    closed: int
    handles_open: int


class IpcPool:
    """CUDA IPC (cuda-python) for CUDA tensors, memfd mappings for CPU tensors from `tp_overlap.ipc.host_empty`."""

    def __init__(self, *, group: dist.ProcessGroup, gather=None):
        """`gather(local) -> [value of every rank]` is the exchange's collective (default: the process
        group's all_gather_object; a SymmetricPool passes its bounded rendezvous)."""
        global _live
        if group is None:
            raise IpcError("group= is required (pass the TP process group explicitly)")
        self.group = group
        self._gather = gather or self._all_gather_object
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._records: dict[str, list[TensorRecord]] = {}
        self._exported: dict[int, H.Handle] = {}        # base -> handle (this process)
        self._opened: dict[tuple[int, int], int] = {}   # (rank, base) -> mapped address here
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        self._device: torch.device | None = None
        self._counts = {"exchanges": 0, "opened": 0, "closed": 0}
        self._closed = False
        _live += 1

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the IPC pool is closed (IpcPool.close() was called); its peer tensors "
                                  "were valid until then")

    def _all_gather_object(self, local) -> list:
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, local, group=self.group)
        return gathered

    def exchange(self, tensors: dict[str, torch.Tensor]) -> None:
        """Collective: publish `tensors` (same names on every rank) to the group.

        Every tensor must be contiguous; CUDA tensors on this rank's device, CPU tensors from
        `tp_overlap.ipc.host_empty`. Validation happens before any communication.
        """
        self._check_open()
        try:
            local: dict | str = {name: self._record(name, t) for name, t in sorted(tensors.items())}
        except Exception as exc:  # still join the gather, so that every rank raises instead of waiting
            local = f"{type(exc).__name__}: {exc}" if not isinstance(exc, IpcError) else str(exc)
        gathered = self._gather(local)
        failed = [(r, g) for r, g in enumerate(gathered) if isinstance(g, str)]
        if failed:
            raise IpcError("exchange refused: " + "; ".join(f"rank {r}: {msg}" for r, msg in failed))
        names = set(gathered[self.rank])
        for r, theirs in enumerate(gathered):
            if set(theirs) != names:
                raise IpcError(f"exchange names differ: rank {self.rank} has {sorted(names)}, "
                               f"rank {r} has {sorted(theirs)}")
        for name in names:
            self._records[name] = [gathered[r][name] for r in range(self.world_size)]
        self._counts["exchanges"] += 1

    def _record(self, name: str, tensor: torch.Tensor) -> TensorRecord:
        if name in self._records:
            raise IpcError(f"name {name!r} was already exchanged")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            raise IpcError(f"{name!r}: need a contiguous tensor")
        device = tensor.device
        if self._device is None:
            self._device = device
        elif device != self._device:
            raise IpcError(f"{name!r} is on {device}, the pool's tensors are on {self._device}")
        ptr = tensor.data_ptr()
        handle = next((h for b, h in self._exported.items() if b <= ptr < b + h.size_bytes), None)
        if handle is None:
            handle = H.export_cuda(ptr) if device.type == "cuda" else H.export_host(ptr)
            self._exported[handle.base] = handle
        return TensorRecord(handle, ptr - handle.base, tuple(tensor.shape), tensor.dtype)

    def open(self, rank: int, handle: H.Handle) -> int:
        """Map `handle` (exported by `rank`) here, once; returns the base address in this process."""
        self._check_open()
        key = (rank, handle.base)
        addr = self._opened.get(key)
        if addr is not None:
            return addr
        if handle.pid == os.getpid():
            raise IpcError(f"handle of rank {rank} (base 0x{handle.base:x}) was exported by this process; "
                           f"a process cannot open its own IPC handle: use the local tensor")
        addr = H.open_cuda(handle) if handle.kind == "cuda" else H.open_host(handle)
        self._opened[key] = addr
        self._counts["opened"] += 1
        return addr

    def peer(self, name: str, rank: int, *, offset_bytes: int = 0, shape=None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """`rank`'s tensor `name` (its own shape/dtype), or a `shape`/`dtype` view at `offset_bytes`
        from it. Rank == self.rank returns the local memory without opening anything."""
        self._check_open()
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise IpcError(f"rank {rank!r} is not in the group (0 <= rank < {self.world_size})")
        try:
            record = self._records[name][rank]
        except KeyError:
            raise IpcError(f"no exchanged tensor {name!r}; known: {sorted(self._records)}") from None
        shape = record.shape if shape is None else tuple(shape)
        dtype = record.dtype if dtype is None else dtype
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        start = record.offset_bytes + offset_bytes
        if offset_bytes < 0 or start + nbytes > record.handle.size_bytes:
            raise IpcError(f"{name!r} on rank {rank}: {nbytes} bytes at offset {start} exceed the "
                           f"allocation of {record.handle.size_bytes} bytes")
        key = (name, rank, start, shape, dtype)
        view = self._views.get(key)
        if view is None:
            view = self._bytes(rank, record.handle)[start:start + nbytes].view(dtype).view(shape)
            self._views[key] = view
        return view

    def _bytes(self, rank: int, handle: H.Handle) -> torch.Tensor:
        key = ("__base__", rank, handle.base)
        base = self._views.get(key)
        if base is None:
            if rank == self.rank:
                addr = handle.base
            else:
                addr = self.open(rank, handle)
            base = (H.cuda_bytes(addr, handle.size_bytes, self._device) if handle.kind == "cuda"
                    else H.host_bytes(addr, handle.size_bytes))
            self._views[key] = base
        return base

    def stats(self) -> IpcStats:
        """Counters; valid after close too (then handles_open is 0)."""
        return IpcStats(exchanges=self._counts["exchanges"], exported=len(self._exported),
                        opened=self._counts["opened"], closed=self._counts["closed"],
                        handles_open=len(self._opened))

    def close(self) -> None:
        """Close every opened peer handle (exactly once). Idempotent."""
        global _live
        if self._closed:
            return
        self._closed = True
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self._views.clear()
        for (rank, base), addr in self._opened.items():
            handle = self._records_handle(rank, base)
            (H.close_cuda if handle.kind == "cuda" else H.close_host)(addr, handle)
            self._counts["closed"] += 1
        self._opened.clear()
        _live -= 1

    def _records_handle(self, rank: int, base: int) -> H.Handle:
        for records in self._records.values():
            if records[rank].handle.base == base:
                return records[rank].handle
        raise IpcError(f"no handle for rank {rank} base 0x{base:x}")  # unreachable by construction

    def __enter__(self) -> "IpcPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
