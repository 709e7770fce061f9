"""Argument checks shared by the ops: every message names the argument, the value and what is allowed.

They only look at shapes, dtypes and devices, which are equal on all ranks of a correct program, so every
rank raises the same error before any communication starts.
"""

from __future__ import annotations

import torch

from tp_overlap.ipc.errors import OverlapError

from ..gemm import num_sms

__all__ = ["OpInputError", "check_tensor", "check_divisible", "check_at_most",
           "check_weight", "check_method_runs", "check_same_group", "triton_interpreted"]

# methods whose GEMM is the persistent Triton kernel on num_sms - sm_margin programs (config.op -> methods)
TRITON_METHODS = {"ag_gemm": ("fused",), "gemm_rs": ("fused", "epilogue_reduce")}


class OpInputError(OverlapError, ValueError):
    """A public op, layer or pool was called with arguments it cannot serve."""


def check_tensor(name: str, t, *, dtype: torch.dtype, device: torch.device, ndim: int = 2,
                 shape: tuple | None = None, contiguous: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise OpInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise OpInputError(f"{name} has dtype {t.dtype}; this op was built for {dtype}")
    if t.device != device:
        raise OpInputError(f"{name} is on {t.device}; this op runs on {device}")
    if t.dim() != ndim:
        raise OpInputError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise OpInputError(f"{name} has shape {tuple(t.shape)}; dim {axis} must be {want}")
    if contiguous and not t.is_contiguous():
        raise OpInputError(f"{name} must be contiguous (row-major), got strides {t.stride()} for shape "
                           f"{tuple(t.shape)}; call .contiguous() first")


def check_weight(name: str, w, *, dtype: torch.dtype, device: torch.device, shape: tuple) -> bool:
    """Like check_tensor for a [K, N] weight that may also be the transpose view of a row-major [N, K]
    (`weight.t()` of an nn.Linear-style tensor: no copy). Returns whether it is that transpose."""
    check_tensor(name, w, dtype=dtype, device=device, shape=shape, contiguous=False)
    if w.is_contiguous():
        return False
    if w.t().is_contiguous():
        return True
    raise OpInputError(f"{name} must be row-major [K, N] or the transpose view of a row-major [N, K] "
                       f"(weight.t()), got strides {w.stride()} for shape {tuple(w.shape)}; call .contiguous() "
                       f"first")


def check_divisible(name: str, value: int, divisor: int, what: str) -> None:
    if value % divisor:
        raise OpInputError(f"{name}={value} must be divisible by {what} ({divisor})")


def check_at_most(name: str, value: int, limit: int, what: str) -> None:
    if value > limit:
        raise OpInputError(f"{name}={value} exceeds {what} ({limit}); build the op with a larger one")


def check_same_group(name: str, group, pool) -> None:
    """An op runs on its pool's group: the same members, not just the same rank and size."""
    import torch.distributed as dist

    members = tuple(dist.get_process_group_ranks(group))
    if members != tuple(pool.group_ranks):
        raise OpInputError(f"{name}: pool= was built on the group of global ranks {list(pool.group_ranks)}, "
                           f"group= has {list(members)}; build the op on its pool's group")


def check_method_runs(name: str, config, device: torch.device) -> None:
    """Refuse, at construction, a config that cannot run on `device`: on CUDA every field against the GPU's
    SM count (ConfigError, as the preset loader reports it); on every device a Triton method needs the
    Triton runtime (a GPU, or the interpreter on CPU) and at least one GEMM program (num_sms - sm_margin)."""

    sms = num_sms(device)
    if device.type == "cuda":
        config.validate(num_sms=sms)
    if config.method not in TRITON_METHODS[config.op]:
        return
    programs = sms - config.sm_margin
    if device.type != "cuda":
        if config.method == "epilogue_reduce":
            raise OpInputError(f"{name}: method epilogue_reduce needs a GPU (its own-row waits run inside the GEMM "
                               f"that also produces the peers' rows); on CPU use fused, decomposed or pair")
        if not triton_interpreted():
            # both problems at once when both hold: advice that fixes one only would meet the other next
            margin = "" if programs >= 1 else (
                f" with at least 1 GEMM program (it counts as {sms} SMs: sm_margin <= {sms - 1}; this config has "
                f"sm_margin {config.sm_margin}, {sms} - {config.sm_margin} = {programs} programs)")
            raise OpInputError(f"{name}: method {config.method} runs a Triton kernel, which needs a GPU or, on "
                               f"{device.type}, the Triton interpreter (TRITON_INTERPRET=1 in the environment "
                               f"before triton is imported){margin}; without them use method decomposed")
    if programs < 1:
        raise OpInputError(f"{name}: method {config.method} runs its GEMM on num_sms - sm_margin = {sms} - "
                           f"{config.sm_margin} = {programs} programs on {device}; it needs at least 1 (sm_margin "
                           f"<= {sms - 1} here{_on_cpu(config, sms) if device.type != 'cuda' else ''})")


def _on_cpu(config, sms: int) -> str:
    example = "AgGemmConfig(method='fused', sm_margin=0)" if config.op == "ag_gemm" else \
        "GemmRsConfig(method='fused', sm_margin=1, num_comm_sms=1)"
    return (f"; the Triton interpreter on CPU counts as {sms} SMs: e.g. {example}, or method decomposed as "
            f"configs/cpu.yaml has it")


def triton_interpreted() -> bool:
    """Whether the GEMM kernel runs under Triton's interpreter (decided when kernels/ was imported)."""
    from tp_overlap.kernels.gemm import persistent_gemm_kernel

    return type(persistent_gemm_kernel).__name__ == "InterpretedFunction"
