"""The GPU's power limit in the step model: GEMMs slow down as the GPU heats up.

An H200 running GEMMs back to back exceeds its power limit within tens of milliseconds and lowers its
clocks: the same GEMM that takes t ms on a cool GPU takes up to t * (1 + `Rates.gemm_heat`) on a hot one
(~+17 % for llama8b's fc1 at M 8192). Idle time (a compute stream stalled on a copy) cools it within a few
milliseconds; memory-bound kernels hold it at a middle level. One number, the heat h in [0, 1], stands
for all of that: it relaxes towards 1 while GEMMs run (time constant `heat_ms`), towards 0 while the
compute stream idles and towards `mem_heat` under memory-bound kernels (time constant `cool_ms` when h
falls); a GEMM of cool time t at heat h takes t * (1 + gemm_heat * h). `launch/measure/offload_measure.py`
fits the four numbers from per-GEMM times on the machine. Pure functions: no torch, no device.
"""

from __future__ import annotations

import math

__all__: list[str] = []


class Heat:
    """The heat of one GPU over a simulated step (starts at `mem_heat`: the optimizer's memory-bound
    kernels end the previous step)."""

    def __init__(self, gemm_heat: float, heat_ms: float, cool_ms: float, mem_heat: float):
        self.hot, self.tau_up, self.tau_down, self.mem = gemm_heat, heat_ms, cool_ms, mem_heat
        self.level = mem_heat

    def gemm(self, cool_ms: float) -> float:
        """The time of a GEMM that takes `cool_ms` on a cool GPU, starting now; heats the GPU."""
        if self.hot <= 0 or cool_ms <= 0:
            return cool_ms
        # the mean heat over the GEMM, taken over its cool time (hot is small: the difference is second order)
        gap = 1.0 - self.level
        mean = 1.0 - gap * self.tau_up / cool_ms * (1.0 - math.exp(-cool_ms / self.tau_up))
        ms = cool_ms * (1.0 + self.hot * mean)
        self.level = 1.0 - gap * math.exp(-ms / self.tau_up)
        return ms

    def memory_bound(self, ms: float) -> None:
        self._relax(self.mem, ms)

    def idle(self, ms: float) -> None:
        self._relax(0.0, ms)

    def _relax(self, target: float, ms: float) -> None:
        if self.hot <= 0 or ms <= 0:
            return
        tau = self.tau_down if target < self.level else self.tau_up
        self.level = target + (self.level - target) * math.exp(-ms / tau)


def _grid(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def _best(candidates, error):
    return min(candidates, key=error)


def fit_heat(heating: list[float], cooling: list[tuple[float, float, float]],
             alternating: list[tuple[float, float]]) -> dict:
    """The four numbers of `Heat` from per-GEMM times (ms) of one GEMM on the machine:

    * heating: back to back from a cool GPU (after an idle pause); the fastest of the first three is the
      cool time, the median of the last fifth the hot one; heat_ms fits the curve between;
    * cooling: (time of the last GEMM of a hot run, the idle gap after it, the times of the GEMMs after
      the gap) per gap: cool_ms;
    * alternating: (GEMM ms, memory-bound kernel ms) pairs, in order, started on a hot GPU: mem_heat fits
      the GEMM times of the second half.
    Returns gemm_heat (0 when the GEMM does not slow by 1 % or more: no power model), heat_ms, cool_ms,
    mem_heat, cool_gemm_ms and hot_gemm_ms."""
    if len(heating) < 10:
        raise ValueError(f"fit_heat: {len(heating)} heating samples; need at least 10")
    cool = min(heating[:3])
    tail = sorted(heating[-max(2, len(heating) // 5):])
    hot = tail[len(tail) // 2]
    out = {"cool_gemm_ms": cool, "hot_gemm_ms": hot, "gemm_heat": 0.0, "heat_ms": 50.0, "cool_ms": 5.0,
           "mem_heat": 0.0}
    if hot < 1.01 * cool:
        return out
    rise = hot / cool - 1.0

    def level_of(ms):
        return min(1.0, max(0.0, (ms / cool - 1.0) / rise))

    def heating_error(tau):
        heat = Heat(rise, tau, 5.0, 0.0)
        heat.level = 0.0
        return sum((heat.gemm(cool) - t) ** 2 for t in heating)

    tau_up = _best(_grid(1.0, 2000.0, 160), heating_error)

    def cooling_error(tau):
        err = 0.0
        for last, gap, after in cooling:
            heat = Heat(rise, tau_up, tau, 0.0)
            heat.level = level_of(last)
            heat.idle(gap)
            err += sum((heat.gemm(cool) - t) ** 2 for t in after)
        return err

    tau_down = _best(_grid(0.1, 2000.0, 180), cooling_error) if cooling else 5.0
    half = alternating[len(alternating) // 2:]

    def alternating_error(mem):
        heat = Heat(rise, tau_up, tau_down, mem)
        heat.level = 1.0
        err = 0.0
        for i, (gemm_ms, mem_ms) in enumerate(alternating):
            model = heat.gemm(cool)
            heat.memory_bound(mem_ms)
            if i >= len(alternating) - len(half):
                err += (model - gemm_ms) ** 2
        return err

    mem = _best([i / 100 for i in range(101)], alternating_error) if alternating else 0.0
    out.update(gemm_heat=rise, heat_ms=tau_up, cool_ms=tau_down, mem_heat=mem)
    return out
