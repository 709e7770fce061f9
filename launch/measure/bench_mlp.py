"""A one-GPU MLP made of torch ops that saves what `tp_overlap.ops.layers.TPMLP` saves at W = 1 (baseline ops).

TPMLP's column layer at W = 1 gathers into a new [M, H] tensor (`ag_gemm_reference`) and keeps that copy
for its weight grad; its row layer keeps its input a; the activation is `silu(gate) * up` (or gelu) in
plain autograd. This module does the same with two autograd Functions and no process group, so the
offload benchmark needs neither NCCL nor the symmetric pool; `fc1`, `fc2`, `activation`, `world_size`
are the attributes the offload engine uses.
"""

from __future__ import annotations

import torch
from torch import nn

from tp_overlap.offload.activation import activation_forward

class _Column(torch.autograd.Function):
    """y = gathered @ w with gathered = a copy of x (W = 1's all_gather); saves (gathered, w)."""

    @staticmethod
    def forward(ctx, x, w):
        gathered = x.clone()
        ctx.save_for_backward(gathered, w)
        return gathered @ w

    @staticmethod
    def backward(ctx, grad_y):
        gathered, w = ctx.saved_tensors
        return grad_y @ w.t(), gathered.t() @ grad_y


class _Row(torch.autograd.Function):
    """y = a @ w; saves (a, w)."""

    @staticmethod
    def forward(ctx, a, w):
        ctx.save_for_backward(a, w)
        return a @ w

    @staticmethod
    def backward(ctx, grad_y):
        a, w = ctx.saved_tensors
        return grad_y @ w.t(), a.t() @ grad_y


class _Linear(nn.Module):
    def __init__(self, fn, rows: int, cols: int, *, device, dtype):
        super().__init__()
        self.fn = fn
        self.weight = nn.Parameter((torch.randn(rows, cols, device=device) * rows ** -0.5).to(dtype))

    def forward(self, x):
        return self.fn.apply(x, self.weight)


class BenchMLP(nn.Module):
    """x [M, hidden] -> [M, hidden]; fc1 weight [hidden, width], fc2 weight [ffn_hidden, hidden]."""

    world_size = 1

    def __init__(self, hidden: int, ffn_hidden: int, *, activation: str = "swiglu", device="cpu",
                 dtype=torch.bfloat16):
        super().__init__()
        self.hidden, self.ffn_hidden, self.activation = hidden, ffn_hidden, activation
        width = 2 * ffn_hidden if activation == "swiglu" else ffn_hidden
        self.fc1 = _Linear(_Column, hidden, width, device=device, dtype=dtype)
        self.fc2 = _Linear(_Row, ffn_hidden, hidden, device=device, dtype=dtype)

    def forward(self, x):
        return self.fc2(activation_forward(self.fc1(x), self.activation))
