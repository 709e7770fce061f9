"""Host backend: one POSIX shared-memory segment per rank, mapped by every rank of the group.

Each rank creates `/dev/shm/<name>`, the names are exchanged once (the pool's single rendezvous), every
rank maps every segment, and after a barrier each rank unlinks its own name. From then on the memory
lives only in the mappings, so a rank that is killed later leaves nothing behind in /dev/shm.
"""

from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist

from ._backend import Backend
from ._mapping import byte_tensor, map_fd, unmap

SHM_DIR = "/dev/shm"
SHM_PREFIX = "tpov-"


class HostBackend(Backend):
    name = "host"

    def __init__(self, size_bytes: int, group: dist.ProcessGroup):
        super().__init__(size_bytes, group, torch.device("cpu"))
        own_name = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        own_path = os.path.join(SHM_DIR, own_name)
        fd = os.open(own_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._maps: list[tuple[int, int]] = []
        try:
            os.ftruncate(fd, size_bytes)
            names: list[str | None] = [None] * self.world_size
            dist.all_gather_object(names, own_name, group=group)
            self._buffers = [self._open(n, fd if r == self.rank else None) for r, n in enumerate(names)]
            dist.barrier(group=group)
        finally:
            os.close(fd)
            os.unlink(own_path)
        self.handles_open = len(self._maps)

    def _open(self, name: str, own_fd: int | None) -> torch.Tensor:
        fd = own_fd if own_fd is not None else os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            addr = map_fd(fd, self.size_bytes)
        finally:
            if own_fd is None:
                os.close(fd)
        self._maps.append((addr, self.size_bytes))
        return byte_tensor(addr, self.size_bytes)

    def barrier(self, timeout_s: float) -> None:
        del timeout_s  # gloo enforces the process group's own timeout
        dist.barrier(group=self.group)

    def close(self) -> None:
        self._buffers = []
        for addr, size in self._maps:
            unmap(addr, size)
        self._maps = []
        self.handles_open = 0
