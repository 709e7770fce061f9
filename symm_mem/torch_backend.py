"""CUDA backend through torch.distributed._symmetric_memory (one allocation, one rendezvous)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._backend import Backend


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, size_bytes: int, group: dist.ProcessGroup, device: torch.device):
        import torch.distributed._symmetric_memory as symm

        super().__init__(size_bytes, group, device)
        self._local = symm.empty(size_bytes, dtype=torch.uint8, device=device)
        self._handle = symm.rendezvous(self._local, group)
        self._buffers = [
            self._local if r == self.rank
            else self._handle.get_buffer(r, (size_bytes,), torch.uint8, 0)
            for r in range(self.world_size)
        ]
        self.handles_open = self.world_size - 1

    def buffer_ptrs(self) -> list[int]:
        return [int(p) for p in self._handle.buffer_ptrs]

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self._buffers = []
        self._handle = None
        self._local = None
        self.handles_open = 0
