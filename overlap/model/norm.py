"""RMSNorm on this rank's rows of a sequence-parallel model: the weight is the same on every rank, each rank
applies it to its own rows, so its gradient is summed over the group (`sum_grad`). The formula is the Llama
one (fp32 statistics, the weight applied in the input's dtype); `plan._check_norm` checks that the module it
replaces computes the same."""

from __future__ import annotations

import torch
from torch import nn

from .sequence import sum_grad

__all__ = ["SequenceParallelRMSNorm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class SequenceParallelRMSNorm(nn.Module):
    """Replaces an RMSNorm inside the blocks; keeps its parameter name (`weight`) and value."""

    def __init__(self, norm: nn.Module, *, eps: float, group_id: int):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon, self.group_id = eps, group_id

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, sum_grad(self.weight, self.group_id), self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, sequence-parallel"
