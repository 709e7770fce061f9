"""The one-kernel swiglu (kernels/swiglu.py) under Triton's interpreter: the values of the unfused ops
(`F.silu(gate) * up` and autograd's backward of it), every output element written (poisoned outputs),
column tails, padded row strides, every dtype it takes, and the checks of its launchers. Bitwise equality
with ATen's CUDA kernels is the GPU check's (tests/gpu/check_offload.py): on the CPU, ATen's exp and the
interpreter's may differ in the last fp32 bit, which rounding to bf16 almost always hides."""

import pytest
import torch
import torch.nn.functional as F

from tp_overlap.offload.activation import (SavedInputActivation, activation_forward, fused_swiglu_supported,
                                        swiglu_backward, swiglu_forward)

ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -22}


def _unfused(h, grad_a):
    h = h.detach().requires_grad_(True)
    a = activation_forward(h, "swiglu")
    (dh,) = torch.autograd.grad(a, h, grad_a)
    return a.detach(), dh


def _close(got, want, dtype):
    """Within two units in the last place (of the element, or of the largest where silu_backward's
    1 + x (1 - s) cancels); for 16-bit outputs, where rounding hides exp's last-bit differences, equal on
    nearly every element."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2 * ULP[dtype], atol=2 * ULP[dtype] * want.abs().max().item())
    if dtype != torch.float32:
        same = (got == want).float().mean().item()
        assert same >= 0.99, same


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m, f, pad", [(3, 1024, 0), (5, 1500, 8), (1, 40, 3)])
def test_forward_and_backward_match_the_unfused_ops(dtype, m, f, pad):
    torch.manual_seed(m * f + pad)
    h_full = (torch.randn(m, 2 * f + pad) * 3).to(dtype)
    h = h_full[:, :2 * f]                 # a padded row stride when pad > 0
    grad_a = torch.randn(m, f).to(dtype)
    a_want, dh_want = _unfused(h, grad_a)
    a_out = torch.full((m, f), float("nan"), dtype=dtype)
    dh_out = torch.full((m, 2 * f), float("nan"), dtype=dtype)
    a = swiglu_forward(h, out=a_out)
    dh = swiglu_backward(grad_a, h, out=dh_out)
    assert a.data_ptr() == a_out.data_ptr() and dh.data_ptr() == dh_out.data_ptr()
    assert not a.isnan().any() and not dh.isnan().any()  # every element written
    _close(a, a_want, dtype)
    _close(dh, dh_want, dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_extreme_inputs_stay_finite_where_the_unfused_ops_do():
    gate = torch.tensor([[-200.0, -88.5, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.5, 200.0, 3e38]]).to(torch.bfloat16)
    h = torch.cat([gate, torch.ones_like(gate)], dim=1)
    grad_a = torch.ones_like(gate)
    a_want, dh_want = _unfused(h, grad_a)
    torch.testing.assert_close(swiglu_forward(h), a_want, rtol=ULP[torch.bfloat16], atol=0)
    torch.testing.assert_close(swiglu_backward(grad_a, h), dh_want, rtol=ULP[torch.bfloat16], atol=0,
                               equal_nan=True)


def test_a_transposed_gradient_is_read_as_its_values():
    torch.manual_seed(1)
    h = torch.randn(6, 96)
    grad_a = torch.randn(48, 6).t()       # column stride 6: copied once by the launcher
    torch.testing.assert_close(swiglu_backward(grad_a, h), swiglu_backward(grad_a.contiguous(), h), rtol=0,
                               atol=0)


def test_launchers_refuse_what_the_kernel_cannot_read():
    h = torch.randn(4, 16)
    with pytest.raises(ValueError, match="unit column stride"):
        swiglu_forward(h.t())
    with pytest.raises(ValueError, match=r"\[M, 2F\]"):
        swiglu_forward(torch.randn(4, 15))
    with pytest.raises(ValueError, match="grad_a must be"):
        swiglu_backward(torch.randn(4, 7), h)
    with pytest.raises(ValueError, match="out must be"):
        swiglu_forward(h, out=torch.empty(4, 16))
    with pytest.raises(ValueError, match="out must be"):
        swiglu_backward(torch.randn(4, 8), h, out=torch.empty(4, 16, dtype=torch.float64))


def test_empty_rows_launch_nothing():
    assert swiglu_forward(torch.randn(0, 16)).shape == (0, 8)
    assert swiglu_backward(torch.randn(0, 8), torch.randn(0, 16)).shape == (0, 16)


def test_only_cuda_tensors_take_the_fused_path():
    # on the CPU the engine's activation runs ATen's ops: bitwise what autograd computes there
    h = torch.randn(4, 16, requires_grad=True)
    assert not fused_swiglu_supported(h)
    a = SavedInputActivation.apply(h, "swiglu")
    assert torch.equal(a, F.silu(h[:, :8]) * h[:, 8:])
