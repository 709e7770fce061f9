"""Process-group set-up shared by the launchers: torchrun's environment, or a single local rank."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import sys
import warnings
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
    # NCCL refuses two ranks on one device: processes sharing a GPU (one-GPU checks) join with gloo
    nccl = use_cuda and world_size <= torch.cuda.device_count()
    kwargs = {"device_id": device} if nccl else {}
    dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    return DistContext(rank, world_size, device, dist.group.WORLD)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def job(prog: str, *, force_cpu: bool = False, min_ranks: int = 2):
    """The launchers' frame: join the job, refuse fewer than `min_ranks` ranks (exit status 2, the same on
    every rank), and leave the process group however the body ends."""
    # torch >= 2.13 renames all_gather_into_tensor; the GPU machine's 2.11 has only the old name.
    warnings.filterwarnings("ignore", message=".*is deprecated", category=FutureWarning)
    ctx = init(force_cpu=force_cpu)
    try:
        if ctx.world_size < min_ranks:
            print(f"{prog} needs at least {min_ranks} ranks (torchrun --nproc-per-node N, N >= {min_ranks})",
                  file=sys.stderr)
            raise SystemExit(2)
        yield ctx
    finally:
        shutdown()
