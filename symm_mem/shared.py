"""Host memory shared by the ranks of a node: one anonymous memfd segment per rank, mapped by every rank.

Each rank creates its segment with `memfd_create` (no name in /dev/shm), the (pid, fd) pairs are exchanged
through the pool's bounded rendezvous, every rank maps every segment (a peer's through
`/proc/<pid>/fd/<fd>`), and after a second bounded step each rank closes its descriptor. The memory then
lives only in the mappings: a rank killed at any point of creation or later leaves nothing behind. A mapping
is released when the segments are closed and no tensor or array over it is left (`tp_overlap.ipc.mapping.SharedMapping`):
a view a caller still holds after the pool's close reads stale memory, never an unmapped page.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from tp_overlap.ipc.mapping import SharedMapping

from .errors import PoolError
from .rendezvous import Rendezvous

__all__ = ["SharedSegments", "SEGMENT_PREFIX"]

SEGMENT_PREFIX = "tpov-"  # appears in /proc/<pid>/maps as "/memfd:tpov-<what> (deleted)"


class SharedSegments:
    """`nbytes` of shared host memory per rank of the rendezvous' group; `addresses[r]` is rank r's
    segment mapped in this process. Zero-filled at creation (a fresh memfd reads as zeros)."""

    def __init__(self, nbytes: int, rendezvous: Rendezvous, *, what: str):
        self.nbytes = max(int(nbytes), 1)
        self.addresses: list[int] = []
        self._mappings: list[SharedMapping] = []
        fd = os.memfd_create(f"{SEGMENT_PREFIX}{what}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.nbytes)
            owners = rendezvous.exchange((os.getpid(), fd), what=f"{what}: exchange of segments")
            for rank, (pid, peer_fd) in enumerate(owners):
                try:
                    self._mappings.append(self._map(fd if rank == rendezvous.rank else None, pid, peer_fd))
                    self.addresses.append(self._mappings[-1].address)
                except OSError as exc:
                    raise PoolError(f"{what}: cannot map rank {rank}'s segment (pid {pid}): {exc.strerror or exc}; "
                                    f"its process may have exited") from None
            # every rank has mapped every segment before any descriptor goes away
            rendezvous.barrier(what=f"{what}: segments mapped")
        except BaseException:
            self.close()
            raise
        finally:
            os.close(fd)

    def _map(self, own_fd: int | None, pid: int, peer_fd: int) -> SharedMapping:
        fd = own_fd if own_fd is not None else os.open(f"/proc/{pid}/fd/{peer_fd}", os.O_RDWR)
        try:
            return SharedMapping(fd, self.nbytes)
        finally:
            if own_fd is None:
                os.close(fd)

    def int32(self, rank: int, count: int | None = None) -> np.ndarray:
        """Rank `rank`'s segment as int32 words (a view: reads and writes go to the shared memory)."""
        return self._mappings[rank].int32(self.nbytes // 4 if count is None else count)

    def bytes(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s segment as a uint8 tensor (a view of the shared memory)."""
        return self._mappings[rank].bytes()

    def close(self) -> None:
        """Drop this object's mappings: each is unmapped now, or when the last view over it goes."""
        self._mappings = []
        self.addresses = []
