"""The tensors of one op call, as the steps of its Program read them, and the keys of the plans. A Program is
built once per plan key (`base.Plan`) and reads a call's tensors only through these: follow a field (e.g.
`AgCall.a_shard`) from the op's `__call__` to the copy and the GEMM steps that read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

__all__ = ["AgCall", "RsCall", "AgPlanKey", "RsPlanKey"]


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


class AgPlanKey(NamedTuple):
    """What a plan depends on besides the op: the call's M, consumer and variant, and w's width N."""
    m: int
    consumer: str          # "op" (the config's method), "none" (all_gather), "compute" (compute_alone)
    wgrad: str | None      # a row layer's weight grad: None, "lead" or "after"
    lead: bool             # a caller's lead callable runs before the GEMM over the gathered rows
    zero_copy: bool        # the caller wrote a_shard into the slot
    claimed: bool          # input_slot was called for this call
    stamp: bool            # the call stamps its gathered input (a column layer's forward)
    n: int                 # w's width (0: no consumer)
    b_transposed: bool     # w is the transpose view of a row-major [N, K] (nn.Linear's layout; blocks by layout)


class RsPlanKey(NamedTuple):
    """What a plan depends on besides the op: the call's M and schedule, and a's width K."""
    m: int
    schedule: str          # "op" (the config's method), "bulk", "compute" (compute_alone), "comm_only"
    wgrad: bool            # a column layer's weight grad g^T @ a
    work: bool             # bulk with a caller's work callable
    check: bool            # the call checks a producer's version stamp first
    k: int                 # a's width K_local (0: no GEMM)
    b_transposed: bool     # w is the transpose view of a row-major [N, K_local] (blocks by layout)
