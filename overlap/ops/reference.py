"""Plain torch + collective versions of the fused ops: the oracle for tests, the "seq" baseline."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ag_gemm_reference", "gemm_rs_reference"]


def ag_gemm_reference(a_shard: torch.Tensor, w: torch.Tensor, *, group) -> tuple[torch.Tensor, torch.Tensor]:
    """AllGather a_shard [M/W, K] over `group`, then a [M, K] @ w [K, N]; returns (out, a)."""
    world = dist.get_world_size(group)
    a = torch.empty(world * a_shard.shape[0], a_shard.shape[1], dtype=a_shard.dtype, device=a_shard.device)
    dist.all_gather_into_tensor(a, a_shard, group=group)
    return torch.mm(a, w), a


def gemm_rs_reference(a: torch.Tensor, w: torch.Tensor, *, group) -> torch.Tensor:
    """a [M, K_local] @ w [K_local, N], then ReduceScatter (sum) over `group` -> [M/W, N]."""
    world = dist.get_world_size(group)
    partial = torch.mm(a, w)
    out = torch.empty(a.shape[0] // world, w.shape[1], dtype=a.dtype, device=a.device)
    dist.reduce_scatter_tensor(out, partial, group=group)
    return out
