"""What every pool backend shares: the group geometry and the per-rank byte buffers."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Backend:
    """Subclasses fill `self._buffers` (one uint8 tensor per group rank: the arena and the device flag words)
    and `handles_open`, and implement `close()`."""

    name = "?"

    def __init__(self, size_bytes: int, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.size_bytes = size_bytes
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self.handles_open = 0

    def buffer(self, rank: int) -> torch.Tensor:
        return self._buffers[rank]
