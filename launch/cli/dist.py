"""Process-group set-up shared by the launchers: torchrun's environment, or a single local rank (no torchrun;
on CPU with an in-process store, so that no port can collide)."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_overlap.config import envs

from .common import UsageError

GPU_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Placement:
    """Where this process runs, known before any process group exists: torchrun's environment (or a
    one-rank job) and the visible GPUs. The launchers validate their arguments against it first."""
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"


def placement(*, force_cpu: bool = False) -> Placement:
    """This process's rank, world size and device, from the environment alone (no communication)."""
    world = envs.torchrun_world()
    rank, local_rank, world_size = world if world is not None else (0, 0, 1)  # plain `python -m tp_overlap.launch.x`
    if torch.cuda.is_available() and not force_cpu:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    return Placement(rank, local_rank, world_size, device)


def init(where: Placement | None = None, *, force_cpu: bool = False) -> DistContext:
    """Join the job (NCCL on GPUs, gloo on CPU); multicast stays off whatever the caller's env says."""
    for key, value in GPU_SAFE_ENV.items():
        os.environ[key] = value
    where = where or placement(force_cpu=force_cpu)
    use_cuda = where.device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(where.device)
    # The first custom-op call imports torch._dynamo; imported after init_process_group, it made the
    # group outlive destroy_process_group ("terminate called without an active exception" at exit).
    importlib.import_module("torch._dynamo")
    timeout = datetime.timedelta(seconds=max(60.0, 4 * envs.timeout_s()))
    if envs.torchrun_world() is None and not use_cuda:  # one CPU rank: an in-process store, no port to collide on
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        if envs.torchrun_world() is None:  # one GPU rank, no torchrun (as before: a local TCP store)
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29517")
        # NCCL refuses two ranks on one device: processes sharing a GPU (one-GPU checks) join with gloo
        nccl = use_cuda and where.world_size <= torch.cuda.device_count()
        dist.init_process_group("nccl" if nccl else "gloo", rank=where.rank, world_size=where.world_size,
                                timeout=timeout, **({"device_id": where.device} if nccl else {}))
    return DistContext(where.rank, where.world_size, where.device, dist.group.WORLD)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def check_ranks(prog: str, where: Placement, min_ranks: int) -> None:
    """Refuse fewer than `min_ranks` ranks (a UsageError: the same on every rank, before any communication)."""
    if where.world_size < min_ranks:
        raise UsageError(f"needs at least {min_ranks} ranks, got {where.world_size} (run it under torchrun "
                         f"--nproc-per-node N, N >= {min_ranks}); one rank has nothing to overlap")


@contextlib.contextmanager
def job(prog: str, *, force_cpu: bool = False, min_ranks: int = 2, where: Placement | None = None):
    """The launchers' frame: refuse fewer than `min_ranks` ranks before joining (UsageError), join the job,
    and leave the process group however the body ends (an error then exits through launch.cli.common)."""
    # torch >= 2.13 renames all_gather_into_tensor; the GPU machine's 2.11 has only the old name.
    warnings.filterwarnings("ignore", message=".*is deprecated", category=FutureWarning)
    where = where or placement(force_cpu=force_cpu)
    check_ranks(prog, where, min_ranks)
    ctx = init(where)
    try:
        yield ctx
    finally:
        shutdown()
