"""The offload planner: keep / offload / recompute per saved tensor of a stack of TP MLPs. Pure functions.

`plan_offload(shape, rates, ...)` builds a path of plans, from the forced decisions (all else kept) one
tensor at a time, with the step model of overlap/offload/sim.py (measured copy bandwidth, k of the copies
and of the GEMMs, layer times, every device tensor of the step including the weight gradients):

* the moves: offload the next layer's x, h or a (the lowest layer first: its copy has the whole rest of
  the forward to leave and the backward to come back), or recompute the next layer's a or s (the highest
  first: the lowest layers are the offload's); a move that lowers no peak is dropped (e.g. the top layer's
  a, needed as soon as backward starts, or s of a layer that already runs the engine's activation);
* each step takes the move with the most peak saved per millisecond added (a free move: the most bytes);
  once the peak cannot drop (the weight gradients of "step" mode set it at the end of backward), the
  activation peak (`act_peak_bytes`, the peak with gradients resident) decides;
* one path per prefetch depth, and a second one where a is only recomputed (the copy queues are shared:
  a sent out early can crowd out h and x, which only a copy removes); small stacks (<= EXHAUSTIVE_PLANS
  plans) try every plan instead.

Then one plan of all those is chosen:

* explicit budget_bytes: the least step time among plans whose predicted peak fits (ties: fewer bytes
  moved, fewer recomputes, lower peak, a fixed order); OffloadPlanError when none fits;
* budget "auto": the lowest peak (then activation peak) among plans that add at most `max_added` of
  keep-all's step (the time budget; when forced decisions leave none that cheap: the least added time).

`OffloadPlan.frontier` holds the non-dominated (step time, peak) points of every plan tried: the
predicted Pareto curve. The table next to the choice shows, per tensor, what each decision would cost
against keeping that tensor (all else as chosen): "+0.378 ms, peak +0 MiB, act -112 MiB" = slower by
0.378 ms, the same peak (set by the gradients), 112 MiB less at the activation peak.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .activation import fused_swiglu_available
from ._step_inputs import SAVE_POINTS_PER_LAYER, MLPShape, OffloadPlanError, Rates, layer_times, tensor_bytes
from ..config.offload import ALLOWED, CANDIDATES, DEFAULT_MAX_ADDED, OffloadConfig
from .sim import SimResult, calibrate, simulate

__all__ = ["MLPShape", "Rates", "OffloadPlanError", "plan_offload", "plan_sweep", "plan_for", "simulate",
           "calibrate", "tensor_bytes", "pacing_offset"]

AUTO_MAX_ADDED = DEFAULT_MAX_ADDED   # budget "auto": plans may add at most this fraction of the step
EXHAUSTIVE_PLANS = 1024              # up to this many plans (per depth): try them all
_ORDER = {"keep": 0, "recompute": 1, "offload": 2}
_FREE_MS = 1e-3                      # a move adding less than this is free: ranked by bytes saved


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
    offload_ms: float    # D2H + H2D copy time at the measured rates, x k_copy (as if wholly beside GEMMs)
    recompute_ms: float | None  # a: the activation forward; s: the engine's activation forward + backward
                                # minus autograd's (s is recomputed inside it; negative when it is faster)
    decision: str
    vs_keep: dict        # decision -> (added ms, added peak bytes, added activation-peak bytes) against keep
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
    max_added: float
    step_ms: float
    baseline_step_ms: float
    peak_bytes: int
    keep_peak_bytes: int
    act_peak_bytes: int
    keep_act_peak_bytes: int
    fixed_bytes: int
    rows: tuple
    frontier: tuple = ()  # ({step_ms, peak_bytes, act_peak_bytes, moved_bytes, recomputed, depth}, ...)

    def decision(self, layer: int, tensor: str) -> str:
        return next((d for p, n, d in self.decisions if p == layer and n == tensor), "keep")

    @property
    def added_ms(self) -> float:
        return self.step_ms - self.baseline_step_ms

    def table(self) -> str:
        lines = ["| tensor | MiB | decision | offload: copy ms; vs keep | recompute: ms; vs keep | evidence |",
                 "|---|---|---|---|---|---|"]
        for r in self.rows:
            off = f"{r.offload_ms:.3f}; {_delta(r.vs_keep['offload'])}" if "offload" in r.vs_keep else "-"
            rec = f"{r.recompute_ms:.3f}; {_delta(r.vs_keep['recompute'])}" if "recompute" in r.vs_keep else "-"
            lines.append(f"| {r.tensor} | {r.bytes / 2**20:.1f} | {r.decision} | {off} | {rec} | {r.why} |")
        budget = f"auto (time budget +{self.max_added:.1%})" if self.budget_bytes is None else _fmt(self.budget_bytes)
        lines.append(f"predicted: step {self.step_ms:.3f} ms ({self.added_ms:+.3f} vs keep-all), peak "
                     f"{_fmt(self.peak_bytes)} (keep-all {_fmt(self.keep_peak_bytes)}), activations at their peak "
                     f"{_fmt(self.act_peak_bytes)} (keep-all {_fmt(self.keep_act_peak_bytes)}), budget {budget}, "
                     f"grads {self.shape.grads}, prefetch depth {self.prefetch_depth}, pacing offset "
                     f"{self.pacing_offset}")
        return "\n".join(lines)


def _delta(d) -> str:
    return f"{d[0]:+.3f} ms, peak {d[1] / 2**20:+.0f} MiB, act {d[2] / 2**20:+.0f} MiB"


def _fmt(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3f} {unit}"
    return f"{nbytes:.0f} B"


class _Search:
    """Plans tried, with their simulations (memoised: the table and the paths share them)."""

    def __init__(self, shape, rates, fixed_bytes, pacing):
        self.shape, self.rates, self.fixed, self.pacing = shape, rates, fixed_bytes, pacing
        self.seen: dict = {}

    def sim(self, plan: dict, depth: int) -> SimResult:
        key = (tuple(sorted((k, v) for k, v in plan.items() if v != "keep")), depth)
        if key not in self.seen:
            self.seen[key] = (dict(plan), depth, simulate(self.shape, self.rates, plan, depth,
                                                          fixed_bytes=self.fixed, pacing_offset=self.pacing))
        return self.seen[key][2]

    def run(self, start: dict, movable: dict, depths: list) -> None:
        count = 1
        for options in movable.values():
            count *= len(options)
        for depth in depths:
            if depth > depths[0] and not self.stalled(depth - 1):
                return  # nothing waited for a copy one layer less ahead: deeper prefetch only holds more memory
            if count <= EXHAUSTIVE_PLANS:
                self.exhaustive(start, movable, depth)
                continue
            self.greedy(start, movable, depth)
            if any("recompute" in options and "offload" in options for options in movable.values()):
                # the copy queues are shared: bytes of a sent out early can crowd out h and x later, which
                # only a copy can remove; a second path keeps the copies for them and recomputes a
                self.greedy(start, {k: tuple(o for o in v if o != "offload") if k[1] == "a" else v
                                    for k, v in movable.items()}, depth)

    def stalled(self, depth: int) -> bool:
        """Whether any plan tried at this prefetch depth waited for a copy coming back."""
        return any(d == depth and any(w[3] > w[4] for w in sim.windows.values())
                   for _, d, sim in self.seen.values())

    def exhaustive(self, start: dict, movable: dict, depth: int) -> None:
        keys = sorted(movable)
        for combo in itertools.product(*(movable[k] for k in keys)):
            self.sim({**start, **dict(zip(keys, combo))}, depth)

    def greedy(self, start: dict, movable: dict, depth: int) -> None:
        plan, L = dict(start), self.shape.num_layers
        offload_next = {n: [p for p in range(L) if "offload" in movable.get((p, n), ())] for n in CANDIDATES}
        recompute_next = {n: [p for p in reversed(range(L)) if "recompute" in movable.get((p, n), ())]
                          for n in CANDIDATES}
        cur = self.sim(plan, depth)
        while True:
            queues = ([(offload_next[n], n, "offload") for n in CANDIDATES]
                      + [(recompute_next[n], n, "recompute") for n in CANDIDATES])
            best = None
            for queue, n, d in queues:
                while queue:
                    p = queue[0]
                    new = self.sim({**plan, (p, n): d}, depth)
                    gain = (cur.peak_bytes - new.peak_bytes, cur.act_peak_bytes - new.act_peak_bytes)
                    if gain[0] > 0 or gain[1] > 0:
                        break
                    queue.pop(0)  # lowers no peak (e.g. the top layer's a, needed at once): not a move
                else:
                    continue
                level = 0 if gain[0] > 0 else 1
                rank = (level, -gain[level] / max(new.step_ms - cur.step_ms, _FREE_MS), _ORDER[d], p,
                        CANDIDATES.index(n))
                if best is None or rank < best[0]:
                    best = (rank, n, p, d, new)
            if best is None:
                return
            _, n, p, d, cur = best
            plan[(p, n)] = d
            for queue in (offload_next[n], recompute_next[n]):
                if p in queue:
                    queue.remove(p)

    @staticmethod
    def frontier(scored) -> tuple:
        """The plans no other plan beats in both step time and (peak, activation peak)."""
        points = sorted((s.step_ms, s.peak_bytes, s.act_peak_bytes, s.moved_bytes, n_rec, depth)
                        for _, s, _, depth, _, n_rec in scored)
        out, lowest = [], None
        for step, peak, act, moved, rec, depth in points:
            if lowest is None or (peak, act) < lowest:
                lowest = (peak, act)
                out.append({"step_ms": step, "peak_bytes": peak, "act_peak_bytes": act, "moved_bytes": moved,
                            "recomputed": rec, "depth": depth})
        return tuple(out)


def _allowed(shape: MLPShape, candidates, forced: dict) -> dict:
    allowed = {n: {"keep"} for n in CANDIDATES}
    for n in candidates:
        allowed[n] = set(ALLOWED[n])
    if shape.activation != "swiglu":
        allowed["s"] = {"keep"}  # gelu saves h only
        if forced.get("s", "keep") != "keep":
            raise OffloadPlanError("s is silu(gate), which only swiglu saves; this stack's activation is gelu")
    if shape.gathered_is_view:
        allowed["x"] = {"keep"}
        if forced.get("x", "keep") != "keep":
            raise OffloadPlanError("x is a pool view (save_gathered='view'): it costs no memory and cannot be "
                                   "offloaded; build the layer with save_gathered='copy' or drop x")
    for n, d in forced.items():
        if d not in allowed.get(n, ()):
            raise OffloadPlanError(f"forced {n}={d}, but {n} allows {sorted(allowed.get(n, ()))}")
    return allowed


def plan_offload(shape: MLPShape, rates: Rates, *, budget_bytes: int | str = "auto",
                 max_added: float = AUTO_MAX_ADDED, candidates: tuple[str, ...] = CANDIDATES,
                 prefetch_depth: int | str = "auto", forced: dict | None = None, fixed_bytes: int = 0,
                 pacing_offset: int = 0, explain: bool = True) -> OffloadPlan:
    """Choose keep / offload / recompute for every (layer, candidate); see the module doc. explain=False:
    no table rows (they simulate every alternative of every tensor)."""
    plan = plan_sweep(shape, rates, [(budget_bytes, max_added)], candidates=candidates,
                      prefetch_depth=prefetch_depth, forced=forced, fixed_bytes=fixed_bytes,
                      pacing_offset=pacing_offset, explain="all" if explain else "none")[0]
    if isinstance(plan, OffloadPlanError):
        raise plan
    return plan


def plan_sweep(shape: MLPShape, rates: Rates, budgets, *, candidates: tuple[str, ...] = CANDIDATES,
               prefetch_depth: int | str = "auto", forced: dict | None = None, fixed_bytes: int = 0,
               pacing_offset: int = 0, explain: str = "all") -> list:
    """One search, one choice per (budget_bytes, max_added) of `budgets`: an OffloadPlan, or the
    OffloadPlanError that plan_offload would raise for it (a budget no plan fits). explain: which plans get
    table rows, "all" | "first" | "none" (rows simulate every alternative of every tensor)."""
    if explain not in ("all", "first", "none"):
        raise OffloadPlanError(f"explain={explain!r}; allowed: all | first | none")
    forced = dict(forced or {})
    for _, max_added in budgets:
        if not (isinstance(max_added, (int, float)) and 0 <= max_added):
            raise OffloadPlanError(f"max_added={max_added!r}; allowed: a fraction of the step >= 0")
    allowed = _allowed(shape, candidates, forced)
    L = shape.num_layers
    start = {(p, n): forced.get(n, "keep") for p in range(L) for n in CANDIDATES}
    movable = {(p, n): tuple(sorted(allowed[n], key=_ORDER.get)) for p in range(L) for n in CANDIDATES
               if n not in forced and len(allowed[n]) > 1}
    depths = [prefetch_depth] if prefetch_depth != "auto" else list(range(1, min(3, max(1, L - 1)) + 1))
    search = _Search(shape, rates, fixed_bytes, pacing_offset)
    keep = search.sim({}, 1)
    search.run(start, movable, depths)
    scored = []
    for plan, depth, sim in search.seen.values():
        if all(plan.get(k, "keep") == v for k, v in start.items() if v != "keep") and depth in depths:
            canon = tuple(_ORDER[plan.get((p, n), "keep")] for p in range(L) for n in CANDIDATES)
            n_rec = sum(d == "recompute" for d in plan.values())
            scored.append((round(sim.step_ms - keep.step_ms, 6), sim, plan, depth, canon, n_rec))
    frontier = search.frontier(scored)
    out = []
    for index, (budget_bytes, max_added) in enumerate(budgets):
        best = _choose(scored, keep, budget_bytes, max_added, candidates)
        if isinstance(best, OffloadPlanError):
            out.append(best)
            continue
        _, sim, plan, depth, _, _ = best
        plan = {k: plan.get(k, "keep") for k in start}
        out.append(OffloadPlan(
            shape=shape, decisions=tuple((p, n, plan[(p, n)]) for p in range(L) for n in CANDIDATES),
            prefetch_depth=depth, release_at=tuple((p, n, i) for (p, n), i in sorted(sim.release_at.items())),
            pacing_offset=pacing_offset, mode="auto" if budget_bytes == "auto" else "budget",
            budget_bytes=None if budget_bytes == "auto" else budget_bytes, max_added=max_added,
            step_ms=sim.step_ms, baseline_step_ms=keep.step_ms, peak_bytes=sim.peak_bytes,
            keep_peak_bytes=keep.peak_bytes, act_peak_bytes=sim.act_peak_bytes,
            keep_act_peak_bytes=keep.act_peak_bytes, fixed_bytes=fixed_bytes,
            rows=_rows(search, plan, depth, sim, allowed, forced) if explain == "all" or (
                explain == "first" and index == 0) else (), frontier=frontier))
    return out


def _choose(scored, keep, budget_bytes, max_added, candidates):
    """The scored plan a budget asks for (see the module doc), or the OffloadPlanError naming the least peak."""
    if budget_bytes == "auto":
        fits = [s for s in scored if s[0] <= max_added * keep.step_ms]
        if fits:
            return min(fits, key=lambda s: (s[1].peak_bytes, s[1].act_peak_bytes, s[0], s[1].moved_bytes, s[5],
                                            s[4], s[3]))
        # forced decisions cost more than the time budget: at least lose as little time as they allow
        return min(scored, key=lambda s: (s[0], s[1].peak_bytes, s[1].moved_bytes, s[5], s[4], s[3]))
    fits = [s for s in scored if s[1].peak_bytes <= budget_bytes]
    if not fits:
        low = min(scored, key=lambda s: s[1].peak_bytes)
        return OffloadPlanError(
            f"no plan fits budget_bytes={budget_bytes} ({_fmt(budget_bytes)}): the least predicted peak is "
            f"{_fmt(low[1].peak_bytes)} ({_describe(low[2])}, prefetch depth {low[3]}); raise the budget, "
            f"allow more candidates (allowed: {', '.join(candidates) or 'none'}) or a smaller prefetch depth")
    return min(fits, key=lambda s: (s[0], s[1].moved_bytes, s[5], s[1].peak_bytes, s[4], s[3]))


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


def _rows(search: _Search, plan, depth, sim, allowed, forced) -> tuple:
    """One row per (layer, candidate): what each decision costs against keeping this tensor, all else equal."""
    shape, rates = search.shape, search.rates
    b, t = tensor_bytes(shape), layer_times(shape, rates)
    kc = max(1.0, rates.k_copy)
    rows = []
    for p in range(shape.num_layers):
        for n in CANDIDATES:
            here = plan[(p, n)]
            copy_ms = b[n] * 1e3 * kc * (1 / (rates.d2h_gbps * 1e9) + 1 / (rates.h2d_gbps * 1e9))
            kept = sim if here == "keep" else search.sim({**plan, (p, n): "keep"}, depth)
            vs_keep = {}
            for alt in sorted(allowed[n] - {"keep"}, key=_ORDER.get):
                other = sim if alt == here else search.sim({**plan, (p, n): alt}, depth)
                vs_keep[alt] = (other.step_ms - kept.step_ms, other.peak_bytes - kept.peak_bytes,
                                other.act_peak_bytes - kept.act_peak_bytes)
            if n in forced:
                why = "forced by the caller; " + _evidence(sim, (p, n), here)
            elif allowed[n] == {"keep"}:
                why = ("pool view: costs no memory" if n == "x" and shape.gathered_is_view else
                       "gelu saves none" if n == "s" else "not a candidate")
            else:
                why = _evidence(sim, (p, n), here)
            recompute_ms = {"a": t.recompute, "s": t.act_bwd - t.act_bwd_plain + t.act - t.act_plain}.get(n)
            rows.append(PlanRow(f"L{p}.{n}", b[n] if not (n == "x" and shape.gathered_is_view) else 0,
                                copy_ms, recompute_ms, here, vs_keep, why))
    return tuple(rows)


def plan_for(mlps, config: OffloadConfig, rates: Rates, *, m: int, fixed_bytes: int = 0, local_rank: int = 0,
             local_world: int = 1, grads: str = "step") -> OffloadPlan:
    """The plan `config` asks for, for this stack of TPMLPs (forward order) at M tokens (the gathered rows).

    Shapes, TP size, dtype and whether the column layer keeps a pool view of its gathered input come from
    the modules (`hidden`, `ffn_hidden`, `activation`, `world_size`, the weights' dtype, fc1.ops). `grads`:
    "step" when the step's backward allocates the weight gradients (zero_grad(set_to_none=True)),
    "resident" when they live across steps (counted in fixed_bytes)."""
    first = mlps[0]
    view = getattr(getattr(first.fc1, "ops", None), "save_gathered", "copy") == "view"
    weight = first.fc1.weight
    shape = MLPShape(hidden=first.hidden, ffn_hidden=first.ffn_hidden, m=m, activation=first.activation,
                     world_size=first.world_size, dtype_bytes=weight.element_size(),
                     num_layers=len(mlps), gathered_is_view=view, grads=grads,
                     fused_activation=fused_swiglu_available(weight.device, weight.dtype))
    forced = dict(config.forced)
    candidates = tuple(n for n in config.candidates if not (view and n == "x" and n not in forced))
    return plan_offload(shape, rates, budget_bytes=config.budget_bytes, max_added=config.max_added,
                        candidates=candidates, prefetch_depth=config.prefetch_depth, forced=forced,
                        fixed_bytes=fixed_bytes, pacing_offset=pacing_offset(config.pacing, local_rank, local_world))
