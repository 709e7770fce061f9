"""CUDA backend through nvshmem4py: uid bootstrap over the given group, one symmetric tensor per pool.

NVSHMEM is initialised once per process; its PEs are the ranks of the group that first initialised it.
Pools on another group in the same process are refused (NVSHMEM has one world per process).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._backend import Backend
from .errors import PoolError

_state = {"refs": 0, "group_ranks": None, "stream": None}


def _init_once(group: dist.ProcessGroup, device: torch.device) -> None:
    import nvshmem.core as nvshmem
    try:  # cuda-core >= 0.4 (the GPU machine has 1.2) exports at the top level, as nvshmem4py 0.4 expects
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device

    ranks = tuple(dist.get_process_group_ranks(group))
    if _state["refs"] > 0:
        if _state["group_ranks"] != ranks:
            raise PoolError(
                f"nvshmem is already initialised for ranks {_state['group_ranks']}; a pool on ranks "
                f"{ranks} needs backend='torch' (NVSHMEM has one world per process)"
            )
        _state["refs"] += 1
        return
    rank = dist.get_rank(group)
    uid = nvshmem.get_unique_id(empty=rank != 0)
    box = [uid]
    dist.broadcast_object_list(box, group=group, group_src=0)
    cuda_device = Device(device.index)
    cuda_device.set_current()
    nvshmem.init(device=cuda_device, uid=box[0], rank=rank, nranks=len(ranks), initializer_method="uid")
    _state.update(refs=1, group_ranks=ranks, stream=cuda_device.create_stream())


def _release() -> None:
    import nvshmem.core as nvshmem

    _state["refs"] -= 1
    if _state["refs"] == 0:
        _state["stream"] = None
        nvshmem.finalize()
        _state["group_ranks"] = None


class NvshmemBackend(Backend):
    name = "nvshmem"

    def __init__(self, size_bytes: int, group: dist.ProcessGroup, device: torch.device):
        import nvshmem.core as nvshmem

        super().__init__(size_bytes, group, device)
        _init_once(group, device)
        self._local = nvshmem.tensor((size_bytes,), dtype=torch.uint8)
        self._buffers = [
            self._local if r == self.rank else nvshmem.get_peer_tensor(self._local, r)
            for r in range(self.world_size)
        ]
        self.handles_open = self.world_size - 1

    def close(self) -> None:
        import nvshmem.core as nvshmem

        torch.cuda.synchronize(self.device)
        self._buffers = []
        nvshmem.free_tensor(self._local)
        self._local = None
        self.handles_open = 0
        _release()
