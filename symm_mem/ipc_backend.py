"""CUDA backend through plain CUDA IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle via ipc.IpcPool).

Works wherever legacy CUDA IPC works, including several processes sharing one GPU (which torch's
symmetric memory refuses); the barrier is a host barrier of the group after draining the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._backend import Backend


class IpcBackend(Backend):
    name = "ipc"

    def __init__(self, size_bytes: int, group: dist.ProcessGroup, device: torch.device):
        from ipc import IpcPool

        super().__init__(size_bytes, group, device)
        self._local = torch.empty(size_bytes, dtype=torch.uint8, device=device)
        self._ipc = IpcPool(group=group)
        self._ipc.exchange({"pool": self._local})
        self._buffers = [self._ipc.peer("pool", r) for r in range(self.world_size)]
        self.handles_open = self._ipc.stats().handles_open

    def barrier(self, timeout_s: float) -> None:
        del timeout_s  # the process group's own timeout bounds it
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self._buffers = []
        self._ipc.close()
        self._local = None
        self.handles_open = 0
