"""Process-group set-up shared by the launchers: torchrun's environment, or a single local rank."""

from __future__ import annotations

import datetime
import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from overlap import envs

GPU_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"


def init(*, force_cpu: bool = False) -> DistContext:
    """Join the job (NCCL on GPUs, gloo on CPU); multicast stays off whatever the caller's env says."""
    for key, value in GPU_SAFE_ENV.items():
        os.environ[key] = value
    world = envs.torchrun_world()
    if world is None:  # plain `python -m launch.x`: a one-rank job
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        rank, local_rank, world_size = 0, 0, 1
    else:
        rank, local_rank, world_size = world
    use_cuda = torch.cuda.is_available() and not force_cpu
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    # The first custom-op call imports torch._dynamo; imported after init_process_group, it made the
    # group outlive destroy_process_group ("terminate called without an active exception" at exit).
    importlib.import_module("torch._dynamo")
    timeout = datetime.timedelta(seconds=max(60.0, 4 * envs.timeout_s()))
    kwargs = {"device_id": device} if use_cuda else {}
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)
    return DistContext(rank, world_size, device, dist.group.WORLD)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
