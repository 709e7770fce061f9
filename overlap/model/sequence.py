"""The sequence-parallel edges of a converted model, as torch custom ops with autograd: where the token
dimension is split (the first block's input), where it is gathered again (before the final norm), and the
gradient of a weight that every rank applies to its own rows only (a norm inside the blocks, a row layer's
bias), summed over the group.

    split_rows(x [M, ...], id)     -> this rank's rows [M/W, ...]       backward: all_gather of the grads
    gather_rows(x [M/W, ...], id)  -> every rank's rows [M, ...]        backward: this rank's rows of the grad
    sum_grad(w, id)                -> w                                 backward: all_reduce(sum) of the grad

Rows are those of the flattened token dimension: rank r holds rows [r M/W, (r+1) M/W) of the [B*S, H]
activations. What follows `gather_rows` runs the same on every rank (the final norm, the head, the loss), so
its gradient is the same everywhere and each rank keeps its rows; what precedes `split_rows` (the
embedding) gets the whole gradient back on every rank. `id` names a `GroupCollectives` in the registry of
custom_ops (a process group cannot be an op argument). Outputs are fresh tensors, valid on the current
stream (CUDA) when the op returns; the collectives run on the current stream (NCCL) or at once (gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.custom_ops import get_layer_ops, register_layer_ops, unregister_layer_ops
from ..ops.reference import all_gather_rows
from ..ops.validate import OpInputError

__all__ = ["GroupCollectives", "split_rows", "gather_rows", "sum_grad"]


class GroupCollectives:
    """The collectives of a converted model, reachable from the custom ops by an int id. With `ag` (the
    model's shared AgGemm, bf16 / fp32) every gather and sum runs through the pool like the layers' own
    AllGathers: the same copy-engine path, capturable, and working for processes that share one GPU;
    otherwise (overlap=False, fp8 rows, another width) through torch.distributed on `group`."""

    def __init__(self, group: dist.ProcessGroup, ag=None):
        self.group, self.ag = group, ag
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._via_host = dist.get_backend(group) == "gloo"   # gloo: CUDA tensors go through host memory
        self.id = register_layer_ops(self)

    def close(self) -> None:
        unregister_layer_ops(self.id)
        self.ag = None

    def rows(self, total: int) -> tuple[int, int]:
        """(first row, rows) of this rank's share of `total` rows."""
        if total % self.world_size:
            raise OpInputError(f"the converted model splits the B*S = {total} tokens of a step over the "
                               f"{self.world_size} ranks of its group: B*S must be a multiple of {self.world_size}")
        share = total // self.world_size
        return self.rank * share, share

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[W * rows, ...]: every rank's x [rows, ...] in rank order (a new tensor)."""
        if self._pooled(x) and x.dim() == 2:
            return self.ag.all_gather(x.contiguous()).clone()
        return self.dist_all_gather(x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of a 1-D x (a new tensor; summed in fp32 through the pool)."""
        if self._pooled(x) and x.dim() == 1:
            return self.ag.all_gather(x.view(1, -1)).float().sum(0).to(x.dtype)
        return self.dist_all_gather(x.view(1, -1)).float().sum(0).to(x.dtype)

    def dist_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """all_gather through torch.distributed (checkpoints, and what the pool cannot carry)."""
        source = x.detach().cpu() if self._via_host and x.is_cuda else x
        out = source.new_empty((x.shape[0] * self.world_size, *x.shape[1:]))
        all_gather_rows(out, source.contiguous(), group=self.group)
        return out.to(x.device)

    def _pooled(self, x: torch.Tensor) -> bool:
        ag = self.ag
        return (ag is not None and not ag.fp8 and x.dtype == ag.dtype and x.device == ag.device
                and x.shape[-1] == ag.k and x.numel() // ag.k * self.world_size <= ag.max_m)


def _collectives(group_id: int) -> GroupCollectives:
    return get_layer_ops(group_id)


# ----- split_rows: narrow forward, all_gather backward --------------------------------------------------
@torch.library.custom_op("tp_overlap::split_rows", mutates_args=())
def split_rows(x: torch.Tensor, group_id: int) -> torch.Tensor:
    first, share = _collectives(group_id).rows(x.shape[0])
    return x[first:first + share].clone(memory_format=torch.contiguous_format)


@split_rows.register_fake
def _(x, group_id):
    _, share = _collectives(group_id).rows(x.shape[0])
    return x.new_empty((share, *x.shape[1:]))


@torch.library.custom_op("tp_overlap::gather_rows", mutates_args=())
def gather_rows(x: torch.Tensor, group_id: int) -> torch.Tensor:
    return _collectives(group_id).all_gather(x)


@gather_rows.register_fake
def _(x, group_id):
    return x.new_empty((x.shape[0] * _collectives(group_id).world_size, *x.shape[1:]))


@torch.library.custom_op("tp_overlap::sum_grad", mutates_args=())
def sum_grad(w: torch.Tensor, group_id: int) -> torch.Tensor:
    return w.clone()


@sum_grad.register_fake
def _(w, group_id):
    return torch.empty_like(w)


@torch.library.custom_op("tp_overlap::all_reduce_sum", mutates_args=())
def _all_reduce_sum(x: torch.Tensor, group_id: int) -> torch.Tensor:
    return _collectives(group_id).all_reduce(x)


@_all_reduce_sum.register_fake
def _(x, group_id):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_group(ctx, inputs, output):
    ctx.group_id = inputs[1]


def _split_grad(ctx, grad):
    return torch.ops.tp_overlap.gather_rows(grad, ctx.group_id), None


def _gather_grad(ctx, grad):
    return torch.ops.tp_overlap.split_rows(grad, ctx.group_id), None


def _sum_grad_grad(ctx, grad):
    return torch.ops.tp_overlap.all_reduce_sum(grad, ctx.group_id), None


split_rows.register_autograd(_split_grad, setup_context=_setup_group)
gather_rows.register_autograd(_gather_grad, setup_context=_setup_group)
sum_grad.register_autograd(_sum_grad_grad, setup_context=_setup_group)
