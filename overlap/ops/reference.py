"""Plain torch + collective versions of the fused ops: the oracle for tests, the "seq" baseline."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ag_gemm_reference", "gemm_rs_reference", "all_gather_rows"]

# torch 2.13 renames the single-tensor collectives (the old names warn); the GPU machine's 2.11 has only those
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(out: torch.Tensor, rows: torch.Tensor, *, group) -> torch.Tensor:
    """out [W * rows.shape[0], ...] = every rank's `rows` (contiguous) in rank order; returns out."""
    _all_gather(out, rows, group=group)
    return out


def ag_gemm_reference(a_shard: torch.Tensor, w: torch.Tensor, *, group) -> tuple[torch.Tensor, torch.Tensor]:
    """AllGather a_shard [M/W, K] over `group`, then a [M, K] @ w [K, N]; returns (out, a)."""
    world = dist.get_world_size(group)
    a = torch.empty(world * a_shard.shape[0], a_shard.shape[1], dtype=a_shard.dtype, device=a_shard.device)
    all_gather_rows(a, a_shard, group=group)
    return torch.mm(a, w), a


def gemm_rs_reference(a: torch.Tensor, w: torch.Tensor, *, group) -> torch.Tensor:
    """a [M, K_local] @ w [K_local, N], then ReduceScatter (sum) over `group` -> [M/W, N]."""
    world = dist.get_world_size(group)
    partial = torch.mm(a, w)
    out = torch.empty(a.shape[0] // world, w.shape[1], dtype=a.dtype, device=a.device)
    _reduce_scatter(out, partial, group=group)
    return out
