"""The MLP activation with one saved tensor: its input h (what offload moves or recompute starts from).

Autograd's own graph of `silu(gate) * up` saves three tensors (gate and up, views of h, plus silu(gate),
an extra [M, F] tensor). `SavedInputActivation` saves only h and recomputes silu(gate) in backward. Its
backward runs the same ATen ops as autograd's formulas for mul, silu and split (gelu: gelu_backward), so
the gradients are bitwise equal to the plain module's; it writes dgate and dup straight into the halves of
dh instead of concatenating them afterwards (one [M, 2F] buffer fewer at the backward's peak).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["activation_forward", "SavedInputActivation"]


def activation_forward(h: torch.Tensor, activation: str) -> torch.Tensor:
    """a = silu(gate) * up for h = [gate | up] [M, 2F] (swiglu), or gelu(h); the ops of TPMLP.forward."""
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=1)
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(h)
    raise ValueError(f"activation={activation!r}; allowed: swiglu | gelu")


class SavedInputActivation(torch.autograd.Function):
    """a = activation_forward(h); saves h only. Gradient: dh [M, width], bitwise equal to autograd's."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, activation: str) -> torch.Tensor:
        ctx.activation = activation
        ctx.save_for_backward(h)
        return activation_forward(h, activation)

    @staticmethod
    def backward(ctx, grad_a: torch.Tensor):
        (h,) = ctx.saved_tensors
        if ctx.activation == "gelu":
            return torch.ops.aten.gelu_backward(grad_a, h), None
        gate, up = h.chunk(2, dim=1)
        grad_h = torch.empty_like(h, memory_format=torch.contiguous_format)
        grad_gate, grad_up = grad_h.chunk(2, dim=1)
        # autograd's mul backward: d(up) = grad * silu(gate), d(silu(gate)) = grad * up; silu's backward
        # then uses silu_backward(grad, gate); split's backward places both halves in one [M, 2F] tensor
        torch.mul(grad_a, F.silu(gate), out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad_a * up, gate, grad_input=grad_gate)
        return grad_h, None
