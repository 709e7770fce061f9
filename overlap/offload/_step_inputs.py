"""The step model's inputs: the stack's shape (`MLPShape`), the measured rates (`Rates`), and the times and
bytes of one layer derived from them (sim.py simulates the step and calibrates its compute on a measured one).
Pure functions: no torch, no device."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .host_pool import OffloadError
from .power import NO_HEAT

SAVE_POINTS_PER_LAYER = 3  # x, h, a
RELEASE_MARGIN = 0.10      # release a copy's device memory only once 10 % past its predicted landing
GRADS = ("step", "resident")


class OffloadPlanError(OffloadError):
    """No plan meets the request (the message names the budget and the least peak any plan reaches)."""


@dataclass(frozen=True, kw_only=True)
class MLPShape:
    """A stack of `num_layers` TP MLPs at M tokens on W ranks; dtype_bytes per element.
    gathered_is_view: the column layer keeps a pool view of the gathered input (x costs no memory).
    grads: "step" (weight grads allocated in backward, held to the end of the step) | "resident".
    fused_activation: the engine's swiglu runs as one kernel each way (CUDA): it allocates no [M, F]
    temporary besides its output."""
    hidden: int
    ffn_hidden: int
    m: int
    activation: str = "swiglu"
    world_size: int = 1
    dtype_bytes: int = 2
    num_layers: int = 1
    gathered_is_view: bool = False
    grads: str = "step"
    fused_activation: bool = False

    def __post_init__(self):
        if self.grads not in GRADS:
            raise OffloadPlanError(f"MLPShape.grads={self.grads!r}; allowed: {' | '.join(GRADS)}")
        if self.activation not in ("swiglu", "gelu"):
            raise OffloadPlanError(f"MLPShape.activation={self.activation!r}; allowed: swiglu | gelu")


@dataclass(frozen=True, kw_only=True)
class Rates:
    """Measured numbers: copy bandwidth each way (GB/s, 1e9 bytes), the copy's slowdown under the step's
    GEMMs (k_copy) and the GEMMs' under copies (k_gemm: under a device-to-host copy, k_gemm_h2d under a
    host-to-device one, default k_gemm; all taken as at least 1), dense GEMM rate (TFLOP/s)
    and memory bandwidth (GB/s) for derived layer times, or measured layer times (ms) that override them
    (backward GEMMs: dgrad and wgrad each, default the forward GEMM's time), and `step_extra_ms` (optimizer
    and anything else in the step outside the layers). `compute_scale` multiplies every compute time (layer
    pieces and step_extra_ms, not the copies): pieces measured alone add up to more than the step they run
    in, so `calibrate` sets it from a measured step without copies. `gemm_heat`, `heat_ms`, `cool_ms` and
    `mem_heat` describe the GPU's power limit (overlap/offload/power.py; gemm_heat 0: none)."""
    d2h_gbps: float
    h2d_gbps: float
    gemm_tflops: float = 700.0
    hbm_gbps: float = 3500.0
    k_copy: float = 1.0
    k_gemm: float = 1.0
    k_gemm_h2d: float | None = None
    fc1_ms: float | None = None
    fc2_ms: float | None = None
    act_ms: float | None = None
    act_plain_ms: float | None = None
    act_bwd_ms: float | None = None
    recompute_ms: float | None = None
    act_bwd_plain_ms: float | None = None
    fc1_bwd_ms: float | None = None
    fc2_bwd_ms: float | None = None
    step_extra_ms: float = 0.0
    compute_scale: float = 1.0
    gemm_heat: float = NO_HEAT["gemm_heat"]
    heat_ms: float = NO_HEAT["heat_ms"]
    cool_ms: float = NO_HEAT["cool_ms"]
    mem_heat: float = NO_HEAT["mem_heat"]

    def __post_init__(self):
        for name in ("d2h_gbps", "h2d_gbps", "gemm_tflops", "hbm_gbps", "k_copy", "k_gemm", "compute_scale", "heat_ms",
                     "cool_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise OffloadPlanError(f"Rates.{name} must be a positive number, got {value!r}")
        if not isinstance(self.gemm_heat, (int, float)) or not 0 <= self.gemm_heat <= 1:
            raise OffloadPlanError(f"Rates.gemm_heat must be a number in [0, 1], got {self.gemm_heat!r}")
        if not isinstance(self.mem_heat, (int, float)) or not 0 <= self.mem_heat <= 1:
            raise OffloadPlanError(f"Rates.mem_heat must be a number in [0, 1], got {self.mem_heat!r}")
        if self.k_gemm_h2d is not None and not (isinstance(self.k_gemm_h2d, (int, float)) and self.k_gemm_h2d > 0):
            raise OffloadPlanError(f"Rates.k_gemm_h2d must be a positive number or None, got {self.k_gemm_h2d!r}")
        for name in ("fc1_ms", "fc2_ms", "act_ms", "act_plain_ms", "act_bwd_ms", "recompute_ms", "act_bwd_plain_ms",
                     "fc1_bwd_ms", "fc2_bwd_ms", "step_extra_ms"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value < 0):
                raise OffloadPlanError(f"Rates.{name} must be a number >= 0 or None, got {value!r}")


@dataclass(frozen=True)
class LayerTimes:
    fc1: float
    act: float       # the engine's activation forward (saves h only); also the recompute of a
    fc2: float
    act_bwd: float
    recompute: float
    fc1_bwd: float   # dgrad + wgrad
    fc2_bwd: float
    act_bwd_plain: float  # autograd's activation backward (a layer that runs autograd's activation)
    act_plain: float      # autograd's activation forward
    extra: float     # the step outside the layers (optimizer)


def tensor_bytes(shape: MLPShape) -> dict[str, int]:
    """Bytes of each candidate of one layer: x [M, H], h [M, width/W], a [M, F/W], s [M, F/W] (swiglu's
    silu(gate); gelu saves none: 0)."""
    swiglu = shape.activation == "swiglu"
    width = 2 * shape.ffn_hidden if swiglu else shape.ffn_hidden
    s, w = shape.dtype_bytes, shape.world_size
    a = shape.m * (shape.ffn_hidden // w) * s
    return {"x": shape.m * shape.hidden * s, "h": shape.m * (width // w) * s, "a": a, "s": a if swiglu else 0}


def grad_bytes(shape: MLPShape) -> tuple[int, int]:
    """Weight gradient bytes of one layer (fc1, fc2) per rank, in the weights' dtype."""
    width = 2 * shape.ffn_hidden if shape.activation == "swiglu" else shape.ffn_hidden
    s, w = shape.dtype_bytes, shape.world_size
    return shape.hidden * (width // w) * s, (shape.ffn_hidden // w) * shape.hidden * s


def layer_times(shape: MLPShape, rates: Rates) -> LayerTimes:
    """Measured times where given, else GEMM FLOPs over the GEMM rate and activation bytes over HBM."""
    b = tensor_bytes(shape)
    flop_ms = 1e3 / (rates.gemm_tflops * 1e12)
    fc1 = rates.fc1_ms if rates.fc1_ms is not None else 2 * shape.hidden * b["h"] / shape.dtype_bytes * flop_ms
    fc2 = rates.fc2_ms if rates.fc2_ms is not None else 2 * shape.hidden * b["a"] / shape.dtype_bytes * flop_ms
    byte_ms = 1e3 / (rates.hbm_gbps * 1e9)
    act = rates.act_ms if rates.act_ms is not None else (b["h"] + b["a"]) * byte_ms
    act_bwd = rates.act_bwd_ms if rates.act_bwd_ms is not None else (2 * b["h"] + b["a"]) * byte_ms
    times = LayerTimes(fc1, act, fc2, act_bwd, rates.recompute_ms if rates.recompute_ms is not None else act,
                       rates.fc1_bwd_ms if rates.fc1_bwd_ms is not None else 2 * fc1,
                       rates.fc2_bwd_ms if rates.fc2_bwd_ms is not None else 2 * fc2,
                       rates.act_bwd_plain_ms if rates.act_bwd_plain_ms is not None else act_bwd,
                       rates.act_plain_ms if rates.act_plain_ms is not None else act, rates.step_extra_ms)
    scale = rates.compute_scale
    return LayerTimes(*(scale * v for v in dataclasses.astuple(times)))

