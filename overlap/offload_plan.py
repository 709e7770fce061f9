"""The offload planner: keep / offload / recompute per saved tensor of a stack of TP MLPs. Pure functions.

`plan_offload(shape, rates, ...)` simulates one training step (forward of layers 0..L-1, backward L-1..0)
for every plan of a small family and picks one:

* explicit budget_bytes: the least added step time among plans whose predicted peak fits the budget (ties:
  fewer bytes moved, fewer recomputes, lower peak, then a fixed order); OffloadPlanError when none fits;
* budget "auto": the lowest predicted peak among plans that add at most `AUTO_MAX_ADDED` of the step (when
  forced decisions leave none that cheap: the least added time).

The model (all times in ms, one compute stream, one device-to-host and one host-to-device copy queue):

    forward layer p:  save x | fc1 | save h | act | save a | fc2
    backward layer p: prefetch trigger | [recompute a from h] | fc2 dgrad, wgrad (a) | act bwd (h) |
                      fc1 dgrad, wgrad (x)
A tensor is unpacked when its autograd node starts, so the compute waits there for its host-to-device copy.
A device-to-host copy starts at its save point (pacing may defer it by whole save points) once the queue
is free and lasts bytes / bandwidth * k_copy; its device memory is released at the first later save point
the copy has landed by (else at the start of backward, waiting for it). Backward of layer p issues the
host-to-device copies of layers p..p-depth. With any copy in the plan, GEMMs take k_gemm times longer.
Memory: saved tensors while resident, plus the backward working set of the layer being differentiated
(da, dh), plus `fixed_bytes` (weights, grads, inputs: the same for every plan).

The family: per tensor, offload in the first k layers (their windows are the longest); for `a`, recompute
or keep in the rest (split at a second threshold). Plans differ only in what the model can see, so the
table next to the choice shows, per tensor, what each alternative would add and save.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .host_pool import OffloadError
from .offload_config import CANDIDATES

__all__ = ["MLPShape", "Rates", "LayerTimes", "PlanRow", "OffloadPlan", "OffloadPlanError", "plan_offload",
           "simulate", "layer_times", "tensor_bytes", "pacing_offset", "AUTO_MAX_ADDED", "SAVE_POINTS_PER_LAYER"]

AUTO_MAX_ADDED = 0.01      # budget "auto": plans may add at most 1 % of the step
RELEASE_MARGIN = 0.10      # release a copy's device memory only once 10 % past its predicted landing
SAVE_POINTS_PER_LAYER = 3  # x, h, a
_ORDER = {"keep": 0, "recompute": 1, "offload": 2}
_MAX_THRESHOLDS = 9


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


def pacing_offset(pacing: str, local_rank: int, local_world: int) -> int:
    """Save points by which this rank defers its device-to-host copies (node-wide pacing).

    "none": 0. "stagger": local ranks take phases 0, 1, 2 (rank mod min(local ranks, 3)) one save point
    apart, so at most a third of a node's ranks start copying at the same save point. Bounded by one
    layer's save points: a longer delay would push copies into the start of backward."""
    if pacing == "none":
        return 0
    if pacing != "stagger":
        raise OffloadPlanError(f"pacing={pacing!r}; allowed: none | stagger")
    if not 0 <= local_rank < local_world:
        raise OffloadPlanError(f"local_rank={local_rank} outside 0..{local_world - 1}")
    return local_rank % min(local_world, SAVE_POINTS_PER_LAYER)


def tensor_bytes(shape: MLPShape) -> dict[str, int]:
    """Bytes of each candidate of one layer: x [M, H], h [M, width/W], a [M, F/W]."""
    width = 2 * shape.ffn_hidden if shape.activation == "swiglu" else shape.ffn_hidden
    s, w = shape.dtype_bytes, shape.world_size
    return {"x": shape.m * shape.hidden * s, "h": shape.m * (width // w) * s, "a": shape.m * (shape.ffn_hidden // w) * s}


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


@dataclass(frozen=True)
class PlanRow:
    tensor: str          # "L<p>.<name>"
    bytes: int
    offload_ms: float    # D2H + H2D copy time at the measured rates (x k_copy)
    recompute_ms: float | None
    decision: str
    why: str


@dataclass(frozen=True)
class OffloadPlan:
    """The chosen decisions, what the engine needs to run them, and the prediction behind them."""
    shape: MLPShape
    decisions: tuple      # ((layer, tensor, decision), ...) for every layer and candidate
    prefetch_depth: int
    release_at: tuple     # ((layer, tensor, save-point index or -1), ...) for offloaded tensors
    pacing_offset: int
    mode: str             # "budget" | "auto"
    budget_bytes: int | None
    step_ms: float
    baseline_step_ms: float
    peak_bytes: int
    keep_peak_bytes: int
    rows: tuple

    def decision(self, layer: int, tensor: str) -> str:
        return next((d for p, n, d in self.decisions if p == layer and n == tensor), "keep")

    def release_index(self, layer: int, tensor: str) -> int:
        return next((i for p, n, i in self.release_at if p == layer and n == tensor), -1)

    @property
    def added_ms(self) -> float:
        return self.step_ms - self.baseline_step_ms

    def table(self) -> str:
        lines = ["| tensor | MiB | offload ms | recompute ms | decision | why |", "|---|---|---|---|---|---|"]
        for r in self.rows:
            rec = "-" if r.recompute_ms is None else f"{r.recompute_ms:.3f}"
            lines.append(f"| {r.tensor} | {r.bytes / 2**20:.1f} | {r.offload_ms:.3f} | {rec} | {r.decision} | {r.why} |")
        budget = "auto" if self.budget_bytes is None else _fmt(self.budget_bytes)
        lines.append(f"predicted: step {self.step_ms:.3f} ms ({self.added_ms:+.3f} vs keep-all), peak "
                     f"{_fmt(self.peak_bytes)} (keep-all {_fmt(self.keep_peak_bytes)}), budget {budget}, "
                     f"prefetch depth {self.prefetch_depth}, pacing offset {self.pacing_offset}")
        return "\n".join(lines)


def _thresholds(num_layers: int) -> list[int]:
    if num_layers + 1 <= _MAX_THRESHOLDS:
        return list(range(num_layers + 1))
    return sorted({round(i * num_layers / (_MAX_THRESHOLDS - 1)) for i in range(_MAX_THRESHOLDS)})


def _family(shape: MLPShape, allowed: dict, forced: dict):
    """Every plan of the family as {(layer, tensor): decision}."""
    L, ks = shape.num_layers, _thresholds(shape.num_layers)
    opts = {n: (ks if "offload" in allowed[n] and n not in forced else [0]) for n in CANDIDATES}
    rec = "recompute" in allowed["a"] and "a" not in forced
    splits = [(ka, kr) for ka in opts["a"] for kr in (ks if rec else [ka]) if kr >= ka]
    for kx, kh, (ka, kr) in itertools.product(opts["x"], opts["h"], splits):
        plan = {}
        for p in range(L):
            for n, k in (("x", kx), ("h", kh)):
                plan[(p, n)] = forced.get(n, "offload" if p < k else "keep")
            plan[(p, "a")] = forced.get("a", "offload" if p < ka else "recompute" if p < kr else "keep")
        yield plan


def plan_offload(shape: MLPShape, rates: Rates, *, budget_bytes: int | str = "auto",
                 candidates: tuple[str, ...] = CANDIDATES, prefetch_depth: int | str = "auto",
                 forced: dict | None = None, fixed_bytes: int = 0, pacing_offset: int = 0) -> OffloadPlan:
    """Choose keep / offload / recompute for every (layer, candidate); see the module doc."""
    forced = dict(forced or {})
    allowed = {n: {"keep"} for n in CANDIDATES}
    for n in candidates:
        allowed[n] = {"keep", "offload"} | ({"recompute"} if n == "a" else set())
    if shape.gathered_is_view:
        allowed["x"] = {"keep"}
        if forced.get("x", "keep") != "keep":
            raise OffloadPlanError("x is a pool view (save_gathered='view'): it costs no memory and cannot be "
                                   "offloaded; build the layer with save_gathered='copy' or drop x")
    for n, d in forced.items():
        if d not in allowed.get(n, ()):
            raise OffloadPlanError(f"forced {n}={d}, but {n} allows {sorted(allowed.get(n, ()))}")
    L = shape.num_layers
    depths = [prefetch_depth] if prefetch_depth != "auto" else list(range(1, min(4, max(1, L - 1)) + 1))
    keep = simulate(shape, rates, {}, 1, fixed_bytes=fixed_bytes)
    scored = []
    for plan, depth in itertools.product(list(_family(shape, allowed, forced)), depths):
        sim = simulate(shape, rates, plan, depth, fixed_bytes=fixed_bytes, pacing_offset=pacing_offset)
        canon = tuple(_ORDER[plan[(p, n)]] for p in range(L) for n in CANDIDATES)
        n_rec = sum(d == "recompute" for d in plan.values())
        scored.append((round(sim.step_ms - keep.step_ms, 6), sim, plan, depth, canon, n_rec))
    if budget_bytes == "auto":
        limit = AUTO_MAX_ADDED * keep.step_ms
        fits = [s for s in scored if s[0] <= limit]
        if fits:
            best = min(fits, key=lambda s: (s[1].peak_bytes, s[0], s[1].moved_bytes, s[5], s[4], s[3]))
        else:  # forced decisions cost more than the tolerance: at least lose as little time as they allow
            best = min(scored, key=lambda s: (s[0], s[1].peak_bytes, s[1].moved_bytes, s[5], s[4], s[3]))
    else:
        fits = [s for s in scored if s[1].peak_bytes <= budget_bytes]
        if not fits:
            low = min(scored, key=lambda s: s[1].peak_bytes)
            raise OffloadPlanError(
                f"no plan fits budget_bytes={budget_bytes} ({_fmt(budget_bytes)}): the least predicted peak is "
                f"{_fmt(low[1].peak_bytes)} ({_describe(low[2])}, prefetch depth {low[3]}); raise the budget, "
                f"allow more candidates (allowed: {', '.join(candidates) or 'none'}) or a smaller prefetch depth")
        best = min(fits, key=lambda s: (s[0], s[1].moved_bytes, s[5], s[1].peak_bytes, s[4], s[3]))
    added, sim, plan, depth, _, _ = best
    rows = _rows(shape, rates, plan, depth, sim, allowed, forced, fixed_bytes, pacing_offset)
    return OffloadPlan(
        shape=shape, decisions=tuple((p, n, plan[(p, n)]) for p in range(L) for n in CANDIDATES),
        prefetch_depth=depth, release_at=tuple((p, n, i) for (p, n), i in sorted(sim.release_at.items())),
        pacing_offset=pacing_offset, mode="auto" if budget_bytes == "auto" else "budget",
        budget_bytes=None if budget_bytes == "auto" else budget_bytes, step_ms=sim.step_ms,
        baseline_step_ms=keep.step_ms, peak_bytes=sim.peak_bytes, keep_peak_bytes=keep.peak_bytes, rows=rows)


def _fmt(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3f} {unit}"
    return f"{nbytes:.0f} B"


def _describe(plan: dict) -> str:
    moved = [f"L{p}.{n}={d}" for (p, n), d in sorted(plan.items()) if d != "keep"]
    return ", ".join(moved) or "keep all"


def _evidence(sim: SimResult, key, decision: str) -> str:
    """What the simulation saw for this tensor: its copy windows, or whether it is resident at the peak."""
    if decision == "offload":
        saved, landed, released, fetched, needed = sim.windows[key]
        slack = needed - fetched
        back = f"back {slack:.2f} ms early" if slack >= 0 else f"back {-slack:.2f} ms late"
        return f"D2H lands {landed - saved:.2f} ms after its save, {back}"
    return "resident at the peak" if key in sim.at_peak else "not resident at the peak"


def _rows(shape, rates, plan, depth, sim, allowed, forced, fixed_bytes, pacing_offset) -> tuple:
    """One row per (layer, candidate): what each other decision would add and save, all else equal."""
    b, t = tensor_bytes(shape), layer_times(shape, rates)
    rows = []
    for p in range(shape.num_layers):
        for n in CANDIDATES:
            here = plan[(p, n)]
            copy_ms = b[n] * 1e3 * rates.k_copy * (1 / (rates.d2h_gbps * 1e9) + 1 / (rates.h2d_gbps * 1e9))
            if n in forced:
                why = "forced by the caller"
            elif allowed[n] == {"keep"}:
                why = "pool view: costs no memory" if n == "x" and shape.gathered_is_view else "not a candidate"
            else:
                parts = [_evidence(sim, (p, n), here)]
                for alt in sorted(allowed[n] - {here}, key=_ORDER.get):
                    other = simulate(shape, rates, {**plan, (p, n): alt}, depth, fixed_bytes=fixed_bytes,
                                     pacing_offset=pacing_offset)
                    parts.append(f"{alt}: {other.step_ms - sim.step_ms:+.3f} ms, "
                                 f"{(other.peak_bytes - sim.peak_bytes) / 2**20:+.0f} MiB peak")
                why = parts[0] + "; vs " + "; ".join(parts[1:])
            rows.append(PlanRow(f"L{p}.{n}", b[n] if not (n == "x" and shape.gathered_is_view) else 0,
                                copy_ms, t.recompute if n == "a" else None, here, why))
    return tuple(rows)
