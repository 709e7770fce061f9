"""CUDA backend through plain CUDA IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle via ipc.IpcPool).

Works wherever legacy CUDA IPC works, including several processes sharing one GPU (which torch's
symmetric memory refuses). The handles travel through the pool's bounded rendezvous.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._backend import Backend
from .rendezvous import Rendezvous


class IpcBackend(Backend):
    name = "ipc"

    def __init__(self, size_bytes: int, group: dist.ProcessGroup, device: torch.device, rendezvous: Rendezvous):
        from tp_overlap.ipc.pool import IpcPool

        super().__init__(size_bytes, group, device)
        self._local = torch.empty(size_bytes, dtype=torch.uint8, device=device)
        self._ipc = IpcPool(group=group, gather=lambda local: rendezvous.exchange(local, what="ipc handles"))
        try:
            self._ipc.exchange({"pool": self._local})
            self._buffers = [self._ipc.peer("pool", r) for r in range(self.world_size)]
        except BaseException:
            self._ipc.close()
            raise
        self.handles_open = self._ipc.stats().handles_open

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self._buffers = []
        self._ipc.close()
        self._local = None
        self.handles_open = 0
