"""Host backend: the arena is shared host memory (`SharedSegments`: one memfd per rank, mapped by all).

Nothing is ever named in /dev/shm, so a rank killed at any point leaves nothing behind there; `SHM_DIR`
and `SHM_PREFIX` stay for the tests that check exactly that.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._backend import Backend
from .rendezvous import Rendezvous
from .shared import SEGMENT_PREFIX, SharedSegments

SHM_DIR = "/dev/shm"
SHM_PREFIX = SEGMENT_PREFIX


class HostBackend(Backend):
    name = "host"

    def __init__(self, size_bytes: int, group: dist.ProcessGroup, rendezvous: Rendezvous):
        super().__init__(size_bytes, group, torch.device("cpu"))
        self._segments = SharedSegments(size_bytes, rendezvous, what="arena")
        self._buffers = [self._segments.bytes(r) for r in range(self.world_size)]
        self.handles_open = len(self._buffers)

    def close(self) -> None:
        self._buffers = []
        self._segments.close()
        self.handles_open = 0
