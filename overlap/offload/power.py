"""The GPU's power limit in the step model: GEMMs slow down as the GPU heats up.

An H200 running GEMMs back to back exceeds its power limit within tens of milliseconds and lowers its
clocks: the same GEMM that takes t ms on a cool GPU takes up to t * (1 + `Rates.gemm_heat`) on a hot one
(+17-18 % for the llama fc1 GEMMs, results/offload_h200.json). Idle time (a compute stream stalled on a
copy) cools it over tens of milliseconds (gaps of a few ms barely do, 50 ms fully); memory-bound kernels
hold it at a middle level. One number, the heat h in [0, 1], stands for all of that: it relaxes towards 1
while GEMMs run (time constant `heat_ms`), towards 0 while the compute stream idles and towards `mem_heat`
under memory-bound kernels (time constant `cool_ms` when h falls); a GEMM of cool time t at heat h takes
t * (1 + gemm_heat * h). `launch/measure/offload_measure.py` measures per-GEMM times on the machine and
`fit_heat` turns them into the four numbers. No torch, no device.
"""

from __future__ import annotations

import math

__all__: list[str] = []

MAX_GEMM_HEAT = 1.0   # Rates accepts gemm_heat in [0, 1]: a fit above is clamped (and flagged)
NO_HEAT = {"gemm_heat": 0.0, "heat_ms": 50.0, "cool_ms": 5.0, "mem_heat": 0.0}  # no power model (Rates' defaults)


class Heat:
    """The heat of one GPU over a simulated step (starts at `mem_heat`: the optimizer's memory-bound
    kernels end the previous step)."""

    def __init__(self, gemm_heat: float, heat_ms: float, cool_ms: float, mem_heat: float):
        self.rise, self.tau_up, self.tau_down, self.mem = gemm_heat, heat_ms, cool_ms, mem_heat
        self.level = mem_heat

    def gemm(self, t_cool: float) -> float:
        """The time of a GEMM that takes `t_cool` ms on a cool GPU, starting now; heats the GPU."""
        if self.rise <= 0 or t_cool <= 0:
            return t_cool
        # the mean heat over the GEMM, taken over its cool time (the rise is small: the difference is second order)
        gap = 1.0 - self.level
        mean = 1.0 - gap * self.tau_up / t_cool * (1.0 - math.exp(-t_cool / self.tau_up))
        ms = t_cool * (1.0 + self.rise * mean)
        self.level = 1.0 - gap * math.exp(-ms / self.tau_up)
        return ms

    def memory_bound(self, ms: float) -> None:
        self._relax(self.mem, ms)

    def idle(self, ms: float) -> None:
        self._relax(0.0, ms)

    def _relax(self, target: float, ms: float) -> None:
        if self.rise <= 0 or ms <= 0:
            return
        tau = self.tau_down if target < self.level else self.tau_up
        self.level = target + (self.level - target) * math.exp(-ms / tau)


def _grid(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def _rms(squares: float, count: int) -> float:
    return math.sqrt(squares / max(1, count))


HEAT_GRID = _grid(1.0, 2000.0, 160)     # heat_ms candidates
COOL_GRID = _grid(0.1, 2000.0, 180)     # cool_ms candidates
MEM_GRID = [i / 100 for i in range(101)]


class _Residuals:
    """Sums of squared differences (ms^2) between the samples of `fit_heat` and what `Heat` predicts."""

    def __init__(self, heating, cooling, alternating, t_cool: float, rise: float):
        self.heating, self.cooling, self.alternating = heating, cooling, alternating
        self.t_cool, self.rise = t_cool, rise

    def level_of(self, ms: float) -> float:
        return min(1.0, max(0.0, (ms / self.t_cool - 1.0) / self.rise))

    def of_heating(self, tau_up: float) -> float:
        heat = Heat(self.rise, tau_up, NO_HEAT["cool_ms"], 0.0)  # cooling plays no part here
        heat.level = 0.0
        return sum((heat.gemm(self.t_cool) - t) ** 2 for t in self.heating)

    def of_cooling(self, tau_up: float, tau_down: float) -> float:
        err = 0.0
        for last, gap, after in self.cooling:
            heat = Heat(self.rise, tau_up, tau_down, 0.0)
            heat.level = self.level_of(last)
            heat.idle(gap)
            err += sum((heat.gemm(self.t_cool) - t) ** 2 for t in after)
        return err

    def of_alternating(self, tau_up: float, tau_down: float, mem: float) -> float:
        heat = Heat(self.rise, tau_up, tau_down, mem)
        heat.level = 1.0
        err = 0.0
        for i, (gemm_ms, mem_ms) in enumerate(self.alternating):
            model = heat.gemm(self.t_cool)
            heat.memory_bound(mem_ms)
            if i >= len(self.alternating) // 2:
                err += (model - gemm_ms) ** 2
        return err


def fit_heat(heating: list[float], cooling: list[tuple[float, float, list[float]]],
             alternating: list[tuple[float, float]]) -> dict:
    """The four numbers of `Heat` from per-GEMM times (ms) of one GEMM on the machine:

    * heating: back to back from a cool GPU (after an idle pause); the fastest of the first three is the
      cool time, the median of the last fifth the hot one; heat_ms fits the curve between;
    * cooling: (time of the last GEMM of a hot run, the idle gap after it, the times of the GEMMs after
      the gap) per gap: cool_ms;
    * alternating: (GEMM ms, memory-bound kernel ms) pairs, in order, started on a hot GPU: mem_heat fits
      the GEMM times of the second half.
    Returns gemm_heat (0 when the GEMM does not slow by 1 % or more: no power model), heat_ms, cool_ms,
    mem_heat, cool_gemm_ms, hot_gemm_ms, the RMS residual (ms) of each fit, and `at_bound`: the numbers
    that ended on the edge of their search range (a fit to read with care)."""
    if len(heating) < 10:
        raise ValueError(f"fit_heat: {len(heating)} heating samples; need at least 10")
    t_cool = min(heating[:3])
    tail = sorted(heating[-max(2, len(heating) // 5):])
    t_hot = tail[len(tail) // 2]
    out = {"cool_gemm_ms": t_cool, "hot_gemm_ms": t_hot, **NO_HEAT, "at_bound": []}
    if t_hot < 1.01 * t_cool:
        return out
    rise = min(MAX_GEMM_HEAT, t_hot / t_cool - 1.0)
    res = _Residuals(heating, cooling, alternating, t_cool, rise)
    tau_up = min(HEAT_GRID, key=res.of_heating)
    tau_down = min(COOL_GRID, key=lambda tau: res.of_cooling(tau_up, tau)) if cooling else NO_HEAT["cool_ms"]
    mem = min(MEM_GRID, key=lambda m: res.of_alternating(tau_up, tau_down, m)) if alternating else 0.0
    bounds = {"gemm_heat": (rise, 0.0, MAX_GEMM_HEAT), "heat_ms": (tau_up, HEAT_GRID[0], HEAT_GRID[-1]),
              "cool_ms": (tau_down, COOL_GRID[0], COOL_GRID[-1]), "mem_heat": (mem, MEM_GRID[0], MEM_GRID[-1])}
    after = sum(len(c[2]) for c in cooling)
    out.update(gemm_heat=rise, heat_ms=tau_up, cool_ms=tau_down, mem_heat=mem,
               at_bound=[name for name, (value, lo, hi) in bounds.items() if value in (lo, hi)],
               heating_rms_ms=_rms(res.of_heating(tau_up), len(heating)),
               cooling_rms_ms=_rms(res.of_cooling(tau_up, tau_down), after) if cooling else None,
               alternating_rms_ms=(_rms(res.of_alternating(tau_up, tau_down, mem),
                                        len(alternating) - len(alternating) // 2) if alternating else None))
    return out
