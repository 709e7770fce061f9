"""The tensors of one op call, as the steps of its Program read them. A Program is built once per plan
(`base.Plan`) and reads a call's tensors only through these: follow a field (e.g. `AgCall.a_shard`) from the
op's `__call__` to the copy and the GEMM steps that read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["AgCall", "RsCall"]


@dataclass(slots=True)
class AgCall:
    """The tensors of one call: what the steps of its Program read (a Program is built once per plan and
    reads a call's tensors only through this). All on the current stream's device."""
    a_shard: torch.Tensor | None = None   # [M/W, K] this rank's rows: published, then read by the local GEMM
    w: torch.Tensor | None = None         # [K, N_local]
    out: torch.Tensor | None = None       # [M, N_local], fresh for this call
    lead: Callable | None = None          # run before the GEMM over gathered rows (reads local data only)
    stamp: torch.Tensor | None = None     # int64 [1]: receives the op's version (column layers)
    x: torch.Tensor | None = None         # weight grad: the other operand [M, J]
    grad: torch.Tensor | None = None      # weight grad: the result [J, K] = x^T @ gathered a
    w_fp8: tuple | None = None            # FP8: (e4m3 w^T [N_local, K], its 128x128 scales)


@dataclass(slots=True)
class RsCall:
    """The tensors of one call: what the steps of its Program read (a Program is built once per plan and
    reads a call's tensors only through this). All on the current stream's device."""
    out: torch.Tensor                     # [M/W, N] this rank's reduced rows ([M, N] for compute_alone)
    a: torch.Tensor | None = None         # [M, K_local] (None for `reduce_scatter`)
    w: torch.Tensor | None = None         # [K_local, N]
    work: Callable | None = None          # bulk: the work overlapped with the reduce-scatter, returns `result`
    check: tuple | None = None            # (stamp, version, failure code): the producer's version check
    g: torch.Tensor | None = None         # weight grad: the output grad [M, J]
    result: torch.Tensor | None = None    # weight grad [J, K_local] = g^T @ a, or what `work` returned
    a_fp8: tuple | None = None            # FP8: (e4m3 a, 1x128 scales), quantised once per call
    w_fp8: tuple | None = None            # FP8: (e4m3 w^T, 128x128 scales)
    partials: torch.Tensor | None = None  # `reduce_scatter`: the partials [M, N] to reduce
