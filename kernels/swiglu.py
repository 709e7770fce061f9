"""SwiGLU forward and backward in one pass each, bitwise equal to ATen's CUDA ops for the same math.

Only ``@triton.jit`` code. h = [gate | up] is [M, 2F] (row stride ``ld_h``, unit column stride).

``INTERPRETED`` (constexpr): True for CPU tensors run by Triton's interpreter, which has no libdevice exp
(numpy's instead) and truncates fp32 -> bf16 (rounded on the bits instead).
``swiglu_forward_kernel`` (grid ``(M, cdiv(F, BLOCK))``): a = silu(gate) * up, [M, F] (row stride ``ld_a``).
``swiglu_backward_kernel`` (same grid): from grad_a [M, F] and h, grad_h = [d gate | d up] [M, 2F].

Bitwise equality with the unfused ops (``F.silu(gate) * up`` and autograd's backward of it) needs their
exact arithmetic, element by element: every op computes in fp32 and rounds to the tensor's dtype between
ops (silu's output, both products, silu_backward's output are tensors of that dtype); silu(x) is
``x / (1 + exp(-x))`` and silu_backward ``dy * s * (1 + x * (1 - s))`` with ``s = 1 / (1 + exp(-x))``, the
inner multiply-add contracted to one fma as nvcc does; ``exp`` is libdevice's (CUDA's ``expf``), not
Triton's fast ``tl.exp``; divisions are ``div_rn`` (Triton's ``/`` on fp32 is approximate on the GPU).
Values in the subnormal range may be flushed to zero (Triton compiles with flush-to-zero for exp); normal
values are unaffected. The GPU check compares all 65536 bf16 gate values against ATen.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["swiglu_forward_kernel", "swiglu_backward_kernel"]


@triton.jit
def _exp(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return tl.exp(x)  # the interpreter has no libdevice: numpy's exp
    return libdevice.exp(x)


@triton.jit
def _round(x, dtype, INTERPRETED: tl.constexpr):
    """fp32 x rounded to dtype, to nearest, ties to even."""
    if INTERPRETED and dtype == tl.bfloat16:
        # the interpreter's fp32 -> bf16 conversion truncates: round on the bits first (then it is exact)
        bits = x.to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _silu(x, INTERPRETED: tl.constexpr):
    return tl.div_rn(x, 1.0 + _exp(-x, INTERPRETED))


@triton.jit
def _silu_backward(dy, x, INTERPRETED: tl.constexpr):
    s = tl.div_rn(1.0, 1.0 + _exp(-x, INTERPRETED))
    return dy * s * tl.fma(x, 1.0 - s, 1.0)


@triton.jit
def swiglu_forward_kernel(h_ptr, a_ptr, F, ld_h, ld_a, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(h_ptr + row * ld_h + cols, mask=mask, other=0.0)
    up = tl.load(h_ptr + row * ld_h + F + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    s = _round(_silu(gate.to(tl.float32), INTERPRETED), dtype, INTERPRETED)  # silu's output tensor
    tl.store(a_ptr + row * ld_a + cols, _round(s.to(tl.float32) * up.to(tl.float32), dtype, INTERPRETED), mask=mask)


@triton.jit
def swiglu_backward_kernel(grad_a_ptr, h_ptr, grad_h_ptr, F, ld_ga, ld_h, ld_gh, BLOCK: tl.constexpr,
                           INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    da = tl.load(grad_a_ptr + row * ld_ga + cols, mask=mask, other=0.0)
    gate = tl.load(h_ptr + row * ld_h + cols, mask=mask, other=0.0)
    up = tl.load(h_ptr + row * ld_h + F + cols, mask=mask, other=0.0)
    dtype = da.dtype
    da32, gate32 = da.to(tl.float32), gate.to(tl.float32)
    s = _round(_silu(gate32, INTERPRETED), dtype, INTERPRETED)  # the silu(gate) autograd would have saved
    # mul's backward: d up = da * silu(gate), d silu = da * up (tensors of the dtype)
    d_up = _round(da32 * s.to(tl.float32), dtype, INTERPRETED)
    d_silu = _round(da32 * up.to(tl.float32), dtype, INTERPRETED)
    d_gate = _round(_silu_backward(d_silu.to(tl.float32), gate32, INTERPRETED), dtype, INTERPRETED)
    tl.store(grad_h_ptr + row * ld_gh + cols, d_gate, mask=mask)
    tl.store(grad_h_ptr + row * ld_gh + F + cols, d_up, mask=mask)
