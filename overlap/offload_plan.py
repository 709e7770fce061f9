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

from ._offload_sim import (SAVE_POINTS_PER_LAYER, LayerTimes, MLPShape, OffloadPlanError, Rates, SimResult,
                           layer_times, simulate, tensor_bytes)
from .offload_config import CANDIDATES, OffloadConfig

__all__ = ["MLPShape", "Rates", "LayerTimes", "PlanRow", "OffloadPlan", "OffloadPlanError", "plan_offload",
           "simulate", "layer_times", "tensor_bytes", "pacing_offset", "plan_for", "AUTO_MAX_ADDED",
           "SAVE_POINTS_PER_LAYER"]

AUTO_MAX_ADDED = 0.01      # budget "auto": plans may add at most 1 % of the step
_ORDER = {"keep": 0, "recompute": 1, "offload": 2}
_MAX_THRESHOLDS = 9


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
            lines.append(f"| {r.tensor} | {r.bytes / 2**20:.1f} | {r.offload_ms:.3f} | {rec} | {r.decision} "
                         f"| {r.why} |")
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


def plan_for(mlps, config: OffloadConfig, rates: Rates, *, m: int, fixed_bytes: int = 0, local_rank: int = 0,
             local_world: int = 1) -> OffloadPlan:
    """The plan `config` asks for, for this stack of TPMLPs (forward order) at M tokens (the gathered rows).

    Shapes, TP size, dtype and whether the column layer keeps a pool view of its gathered input come from
    the modules (`hidden`, `ffn_hidden`, `activation`, `world_size`, the weights' dtype, fc1.ops)."""
    first = mlps[0]
    view = getattr(getattr(first.fc1, "ops", None), "save_gathered", "copy") == "view"
    shape = MLPShape(hidden=first.hidden, ffn_hidden=first.ffn_hidden, m=m, activation=first.activation,
                     world_size=first.world_size, dtype_bytes=first.fc1.weight.element_size(),
                     num_layers=len(mlps), gathered_is_view=view)
    forced = dict(config.forced)
    candidates = tuple(n for n in config.candidates if not (view and n == "x" and n not in forced))
    return plan_offload(shape, rates, budget_bytes=config.budget_bytes, candidates=candidates,
                        prefetch_depth=config.prefetch_depth, forced=forced, fixed_bytes=fixed_bytes,
                        pacing_offset=pacing_offset(config.pacing, local_rank, local_world))
