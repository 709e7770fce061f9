"""The step model behind the offload planner: shapes, measured rates, and a simulation of one training step.

A stack of L TP MLPs, forward 0..L-1 then backward L-1..0, on one compute stream with one device-to-host
and one host-to-device copy queue (see overlap/offload_plan.py for how the planner uses it). Pure functions:
no torch, no device.
"""

from __future__ import annotations

from dataclasses import dataclass

from .host_pool import OffloadError
from .offload_config import CANDIDATES

__all__ = ["MLPShape", "Rates", "LayerTimes", "SimResult", "OffloadPlanError", "tensor_bytes", "layer_times",
           "simulate", "SAVE_POINTS_PER_LAYER", "RELEASE_MARGIN"]

SAVE_POINTS_PER_LAYER = 3  # x, h, a
RELEASE_MARGIN = 0.10      # release a copy's device memory only once 10 % past its predicted landing


class OffloadPlanError(OffloadError):
    """No plan meets the request (the message names the budget and the least peak any plan reaches)."""


@dataclass(frozen=True, kw_only=True)
class MLPShape:
    """A stack of `num_layers` TP MLPs at M tokens on W ranks; dtype_bytes per element.
    gathered_is_view: the column layer keeps a pool view of the gathered input (x costs no memory)."""
    hidden: int
    ffn_hidden: int
    m: int
    activation: str = "swiglu"
    world_size: int = 1
    dtype_bytes: int = 2
    num_layers: int = 1
    gathered_is_view: bool = False


@dataclass(frozen=True, kw_only=True)
class Rates:
    """Measured numbers: copy bandwidth each way (GB/s, 1e9 bytes), the copy's slowdown under the step's
    GEMMs (k_copy) and the GEMMs' under copies (k_gemm), dense GEMM rate (TFLOP/s) and memory bandwidth
    (GB/s) for derived layer times, or measured layer times (ms) that override them."""
    d2h_gbps: float
    h2d_gbps: float
    gemm_tflops: float = 700.0
    hbm_gbps: float = 3500.0
    k_copy: float = 1.0
    k_gemm: float = 1.0
    fc1_ms: float | None = None
    fc2_ms: float | None = None
    act_ms: float | None = None
    act_bwd_ms: float | None = None
    recompute_ms: float | None = None

    def __post_init__(self):
        for name in ("d2h_gbps", "h2d_gbps", "gemm_tflops", "hbm_gbps", "k_copy", "k_gemm"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise OffloadPlanError(f"Rates.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class LayerTimes:
    fc1: float
    act: float
    fc2: float
    act_bwd: float
    recompute: float


def tensor_bytes(shape: MLPShape) -> dict[str, int]:
    """Bytes of each candidate of one layer: x [M, H], h [M, width/W], a [M, F/W]."""
    width = 2 * shape.ffn_hidden if shape.activation == "swiglu" else shape.ffn_hidden
    s, w = shape.dtype_bytes, shape.world_size
    return {"x": shape.m * shape.hidden * s, "h": shape.m * (width // w) * s,
            "a": shape.m * (shape.ffn_hidden // w) * s}


def layer_times(shape: MLPShape, rates: Rates) -> LayerTimes:
    """Measured times where given, else GEMM FLOPs over the GEMM rate and activation bytes over HBM."""
    b = tensor_bytes(shape)
    flop_ms = 1e3 / (rates.gemm_tflops * 1e12)
    fc1 = rates.fc1_ms if rates.fc1_ms is not None else 2 * shape.hidden * b["h"] / shape.dtype_bytes * flop_ms
    fc2 = rates.fc2_ms if rates.fc2_ms is not None else 2 * shape.hidden * b["a"] / shape.dtype_bytes * flop_ms
    byte_ms = 1e3 / (rates.hbm_gbps * 1e9)
    act = rates.act_ms if rates.act_ms is not None else (b["h"] + b["a"]) * byte_ms
    act_bwd = rates.act_bwd_ms if rates.act_bwd_ms is not None else (2 * b["h"] + b["a"]) * byte_ms
    return LayerTimes(fc1, act, fc2, act_bwd, rates.recompute_ms if rates.recompute_ms is not None else act)


@dataclass(frozen=True)
class SimResult:
    step_ms: float
    peak_bytes: int
    moved_bytes: int
    release_at: dict          # (layer, tensor) -> save-point index of its release, or -1: start of backward
    stall_ms: float
    at_peak: frozenset        # (layer, tensor) resident on the device at the peak
    windows: dict             # offloaded (layer, tensor) -> (saved, landed, released, fetched, needed) in ms


def simulate(shape: MLPShape, rates: Rates, decisions: dict, depth: int, *, fixed_bytes: int = 0,
             pacing_offset: int = 0) -> SimResult:
    """One step under `decisions` {(layer, tensor): keep|offload|recompute} (missing: keep)."""
    L, t, b = shape.num_layers, layer_times(shape, rates), tensor_bytes(shape)
    if shape.gathered_is_view:
        b["x"] = 0
    dec = lambda p, n: decisions.get((p, n), "keep")  # noqa: E731
    copies = any(v == "offload" for v in decisions.values())
    kg = rates.k_gemm if copies else 1.0
    d2h_ms = {n: b[n] / (rates.d2h_gbps * 1e9) * 1e3 * rates.k_copy for n in CANDIDATES}
    h2d_ms = {n: b[n] / (rates.h2d_gbps * 1e9) * 1e3 * rates.k_copy for n in CANDIDATES}
    resident: list[tuple] = []  # (from, to, bytes, (layer, tensor) or None for work) of device memory
    needed: dict = {}
    saved_at, landed, release, release_at = {}, {}, {}, {}
    now, d2h_free, stall, last = 0.0, 0.0, 0.0, SAVE_POINTS_PER_LAYER * L - 1
    deferred: list[tuple[int, tuple]] = []

    def issue_d2h(key, at: float) -> None:
        nonlocal d2h_free
        start = max(at, d2h_free)
        landed[key] = d2h_free = start + d2h_ms[key[1]]

    for p in range(L):
        for i, n in enumerate(CANDIDATES):
            now += (0.0, t.fc1 * kg, t.act)[i]
            k = SAVE_POINTS_PER_LAYER * p + i
            for key in [key for key in landed if key not in release and
                        now >= landed[key] + RELEASE_MARGIN * d2h_ms[key[1]]]:
                release[key], release_at[key] = now, k
            for due, key in [d for d in deferred if d[0] <= k]:
                deferred.remove((due, key))
                issue_d2h(key, now)
            saved_at[(p, n)] = now
            if dec(p, n) == "offload":
                # x is saved by the column op once its GEMM has run: its copy starts with h's
                due = k + (pacing_offset or (1 if n == "x" else 0))
                if due == k:
                    issue_d2h((p, n), now)
                else:
                    deferred.append((min(due, last + 1), (p, n)))
        now += t.fc2 * kg
        if dec(p, "a") == "recompute":
            resident.append((saved_at[(p, "a")], now, b["a"], (p, "a")))  # fc2's input until fc2 has run
    for _, key in deferred:
        issue_d2h(key, now)
    unreleased = [key for key in landed if key not in release]
    if unreleased:
        wait = max(landed[key] for key in unreleased)
        stall += max(0.0, wait - now)
        now = max(now, wait)
        for key in unreleased:
            release[key], release_at[key] = now, -1
    h2d_free, issued, done = 0.0, set(), {}
    for p in reversed(range(L)):
        b0 = now
        for q in range(p, p - depth - 1, -1):
            if q < 0 or q in issued:
                continue
            issued.add(q)
            for n in ("a", "h", "x"):  # in the order backward needs them
                if dec(q, n) == "offload":
                    start = max(b0, h2d_free, landed[(q, n)])
                    done[(q, n)] = h2d_free = start + h2d_ms[n]
                    resident.append((b0, -1.0, b[n], (q, n)))  # its end is filled in at its use below
                    done[(q, n, "slot")] = len(resident) - 1

        def need(n: str) -> None:
            nonlocal now, stall
            needed.setdefault((p, n), now)
            if dec(p, n) == "offload":
                stall += max(0.0, done[(p, n)] - now)
                now = max(now, done[(p, n)])

        ends = {}
        if dec(p, "a") == "recompute":
            need("h")
            a_from = now
            now += t.recompute
        else:
            need("a")
        now += 2 * t.fc2 * kg
        ends["a"] = now
        if dec(p, "a") == "recompute":
            resident.append((a_from, now, b["a"], (p, "a")))
        resident.append((b0, now, b["a"], None))           # da
        act_from = now
        need("h")
        now += t.act_bwd
        ends["h"] = now
        resident.append((act_from, now, b["h"] + b["a"], None))  # dh and da during the activation's backward
        dh_from = now
        need("x")
        now += 2 * t.fc1 * kg
        ends["x"] = now
        resident.append((dh_from, now, b["h"], None))     # dh until fc1's backward is done
        for n in CANDIDATES:
            d = dec(p, n)
            if d == "keep":
                resident.append((saved_at[(p, n)], ends[n], b[n], (p, n)))
            elif d == "offload":
                resident.append((saved_at[(p, n)], release[(p, n)], b[n], (p, n)))
                i = done[(p, n, "slot")]
                resident[i] = (resident[i][0], ends[n], resident[i][2], (p, n))
    points = sorted({r[0] for r in resident} | {0.0})
    peak, at = max((sum(r[2] for r in resident if r[0] <= x < r[1]), x) for x in points)
    at_peak = frozenset(r[3] for r in resident if r[3] is not None and r[0] <= at < r[1])
    moved = sum(b[n] for (p, n), d in decisions.items() if d == "offload")
    windows = {key: (saved_at[key], landed[key], release[key], done[key], needed.get(key, now))
               for key in landed if key in done}
    return SimResult(now, fixed_bytes + peak, moved, release_at, stall, at_peak, windows)
