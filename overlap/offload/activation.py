"""The MLP activation with one saved tensor: its input h (what offload moves or recompute starts from).

Autograd's own graph of `silu(gate) * up` saves three tensors (gate and up, views of h, plus silu(gate),
an extra [M, F] tensor). `SavedInputActivation` saves only h and recomputes silu(gate) in backward, with
gradients bitwise equal to the plain module's:

* on CUDA (swiglu, bf16 / fp16 / fp32, unit column stride) forward and backward are one kernel each
  (kernels/swiglu.py: the unfused ops' arithmetic, element by element), which read h once and write a or
  dh once: no [M, F] temporary, and faster than autograd's ops, which read the strided halves of h;
* elsewhere it runs the same ATen ops as autograd's formulas for mul, silu and split (gelu:
  gelu_backward), writing dgate and dup straight into the halves of dh instead of concatenating them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from tp_overlap.kernels.swiglu import swiglu_backward_kernel, swiglu_forward_kernel

__all__ = ["activation_forward", "lean_activation_forward", "fused_swiglu_available", "fused_swiglu_supported",
           "swiglu_forward",
           "swiglu_backward", "SavedInputActivation"]

_BLOCK = 1024      # 8 bf16 per thread of 4 warps: 16-byte accesses
_NUM_WARPS = 4
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def activation_forward(h: torch.Tensor, activation: str) -> torch.Tensor:
    """a = silu(gate) * up for h = [gate | up] [M, 2F] (swiglu), or gelu(h); the ops of TPMLP.forward."""
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=1)
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(h)
    raise ValueError(f"activation={activation!r}; allowed: swiglu | gelu")


def fused_swiglu_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of this device and dtype take the one-kernel swiglu (CUDA; bf16, fp16, fp32)."""
    return device.type == "cuda" and dtype in _FUSED_DTYPES


def fused_swiglu_supported(h: torch.Tensor) -> bool:
    """Whether h [M, 2F] takes the one-kernel swiglu: `fused_swiglu_available` and unit column stride."""
    return fused_swiglu_available(h.device, h.dtype) and h.dim() == 2 and h.shape[1] % 2 == 0 and h.stride(1) == 1


def lean_activation_forward(h: torch.Tensor, activation: str) -> torch.Tensor:
    """activation_forward's values, in one kernel where `fused_swiglu_supported` (no silu(gate) tensor)."""
    if activation == "swiglu" and fused_swiglu_supported(h):
        return swiglu_forward(h)
    return activation_forward(h, activation)


def _check_halves(h: torch.Tensor, where: str) -> int:
    if h.dim() != 2 or h.shape[1] % 2 or h.stride(1) != 1 or h.dtype not in _FUSED_DTYPES:
        raise ValueError(f"{where}: h must be [M, 2F] of {', '.join(map(str, _FUSED_DTYPES))} with unit column "
                         f"stride; got shape {tuple(h.shape)}, strides {h.stride()}, {h.dtype}")
    return h.shape[1] // 2


def _check_out(out: torch.Tensor, shape: tuple, like: torch.Tensor, where: str) -> None:
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device or out.stride(1) != 1:
        raise ValueError(f"{where}: out must be {list(shape)} {like.dtype} on {like.device} with unit column "
                         f"stride; got {tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}")


def swiglu_forward(h: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """a = silu(gate) * up [M, F] for h = [gate | up] [M, 2F], one kernel on h's device's current stream
    (a is valid there); bitwise equal to `activation_forward(h, "swiglu")` on CUDA."""
    f = _check_halves(h, "swiglu_forward")
    m = h.shape[0]
    if out is None:
        out = torch.empty((m, f), dtype=h.dtype, device=h.device)
    _check_out(out, (m, f), h, "swiglu_forward")
    if m and f:
        swiglu_forward_kernel[(m, triton.cdiv(f, _BLOCK))](h, out, f, h.stride(0), out.stride(0), BLOCK=_BLOCK,
                                                           INTERPRETED=not h.is_cuda, num_warps=_NUM_WARPS)
    return out


def swiglu_backward(grad_a: torch.Tensor, h: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """dh = [d gate | d up] [M, 2F] from grad_a [M, F] and h [M, 2F], one kernel on the current stream (dh
    valid there); bitwise equal on CUDA to autograd's backward of `activation_forward(h, "swiglu")`."""
    f = _check_halves(h, "swiglu_backward")
    m = h.shape[0]
    if tuple(grad_a.shape) != (m, f) or grad_a.dtype != h.dtype or grad_a.device != h.device:
        raise ValueError(f"swiglu_backward: grad_a must be [{m}, {f}] {h.dtype} on {h.device}; got "
                         f"{tuple(grad_a.shape)} {grad_a.dtype} on {grad_a.device}")
    if grad_a.stride(1) != 1:
        grad_a = grad_a.contiguous()
    if out is None:
        out = torch.empty((m, 2 * f), dtype=h.dtype, device=h.device)
    _check_out(out, (m, 2 * f), h, "swiglu_backward")
    if m and f:
        swiglu_backward_kernel[(m, triton.cdiv(f, _BLOCK))](grad_a, h, out, f, grad_a.stride(0), h.stride(0),
                                                            out.stride(0), BLOCK=_BLOCK, INTERPRETED=not h.is_cuda,
                                                            num_warps=_NUM_WARPS)
    return out


class SavedInputActivation(torch.autograd.Function):
    """a = activation_forward(h); saves h only. Gradient: dh [M, width], bitwise equal to autograd's."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, activation: str) -> torch.Tensor:
        ctx.activation = activation
        ctx.save_for_backward(h)
        return lean_activation_forward(h, activation)

    @staticmethod
    def backward(ctx, grad_a: torch.Tensor):
        (h,) = ctx.saved_tensors
        if ctx.activation == "gelu":
            return torch.ops.aten.gelu_backward(grad_a, h), None
        if fused_swiglu_supported(h):
            return swiglu_backward(grad_a, h), None
        gate, up = h.chunk(2, dim=1)
        grad_h = torch.empty_like(h, memory_format=torch.contiguous_format)
        grad_gate, grad_up = grad_h.chunk(2, dim=1)
        # autograd's mul backward: d(up) = grad * silu(gate), d(silu(gate)) = grad * up; silu's backward
        # then uses silu_backward(grad, gate); split's backward places both halves in one [M, 2F] tensor
        torch.mul(grad_a, F.silu(gate), out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad_a * up, gate, grad_input=grad_gate)
        return grad_h, None
