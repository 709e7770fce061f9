"""Sustained timing of training steps: blocks of back-to-back steps of one variant, with SM clock and power.

The interleaved medians (overlap.timing) put a barrier and an L2 flush between steps. A training loop does
not pause, and on a power-capped GPU the variant that does the same work in less time draws more power and
runs at a lower clock (results/NOTES.md, sixth session). Here every variant runs `seconds` of back-to-back
steps per block, blocks in the order A B A B (two rounds), and each block reports ms/step (the span of the
block over its steps, max over ranks) and, on CUDA where `nvidia-smi` answers, this rank's GPU's mean SM
clock and power draw over the block (20 ms samples; the first 0.2 s of a block is left out as ramp-up).
"""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from overlap.timing import progress

__all__ = ["GpuSampler", "sustained_blocks"]

SAMPLE_MS = 20
RAMP_S = 0.2
ROUNDS = 2


class GpuSampler:
    """`nvidia-smi` sampling one GPU's SM clock (MHz) and power (W) in a thread; inert without CUDA or
    nvidia-smi (every window then reads (None, None))."""

    def __init__(self, device: torch.device):
        self._samples: list[tuple[float, float, float]] = []  # (monotonic s, MHz, W)
        self._proc = None
        self._thread = None
        if device.type == "cuda" and shutil.which("nvidia-smi"):
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self._target = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"

    def __enter__(self) -> "GpuSampler":
        if getattr(self, "_target", None):
            cmd = ["nvidia-smi", "-i", self._target, "--query-gpu=clocks.sm,power.draw",
                   "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS)]
            try:
                self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self._proc = None
            else:
                self._thread = threading.Thread(target=self._read, name="gpu-sampler", daemon=True)
                self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                clock, power = (float(x) for x in line.split(","))
            except ValueError:  # "[N/A]" or a message: no sample
                continue
            self._samples.append((time.monotonic(), clock, power))

    def window(self, t0: float, t1: float) -> tuple[float | None, float | None]:
        """Mean (SM clock MHz, power W) of the samples taken in [t0, t1] (monotonic seconds)."""
        inside = [(c, p) for t, c, p in list(self._samples) if t0 <= t <= t1]
        if not inside:
            return None, None
        return statistics.fmean(c for c, _ in inside), statistics.fmean(p for _, p in inside)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._thread.join(timeout=5)


def _sync(group, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None:
        dist.barrier(group=group)


def _block(step: Callable[[], object], n: int, device) -> tuple[float, float, float]:
    """n back-to-back steps: (ms per step on this rank, monotonic start, monotonic end)."""
    t0 = time.monotonic()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n, t0, time.monotonic()
    for _ in range(n):
        step()
    t1 = time.monotonic()
    return (t1 - t0) * 1e3 / n, t0, t1


def sustained_blocks(steps: dict[str, Callable[[], object]], *, seconds: float, step_ms: float, group,
                     device: torch.device, rank: int, label: str = "") -> dict[str, dict]:
    """{variant: {"ms": median ms/step over the blocks, "sm_clock_mhz": mean, "power_w": mean}}, max over
    ranks for "ms" and this rank's GPU for the others (None without samples). Every variant runs the same
    number of steps per block: `seconds` worth of `step_ms` (the fastest variant's interleaved median)."""
    if seconds <= 0 or step_ms <= 0:
        raise ValueError(f"need seconds > 0 and step_ms > 0, got {seconds}, {step_ms}")
    n = max(3, math.ceil(seconds * 1e3 / step_ms))
    progress(f"{label}sustained: {ROUNDS} x {len(steps)} blocks of {n} steps", rank=rank)
    blocks: dict[str, list] = {name: [] for name in steps}
    with GpuSampler(device) as sampler:
        for _ in range(ROUNDS):
            for name, step in steps.items():
                _sync(group, device)
                ms, t0, t1 = _block(step, n, device)
                blocks[name].append((ms, *sampler.window(t0 + RAMP_S, t1)))
    ms_table = torch.tensor([[b[0] for b in blocks[name]] for name in steps], dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        on = ms_table.to(device) if device.type == "cuda" else ms_table
        dist.all_reduce(on, op=dist.ReduceOp.MAX, group=group)
        ms_table = on.cpu()
    out = {}
    for i, name in enumerate(steps):
        clocks = [b[1] for b in blocks[name] if b[1] is not None]
        powers = [b[2] for b in blocks[name] if b[2] is not None]
        out[name] = {"ms": statistics.median(ms_table[i].tolist()),
                     "sm_clock_mhz": statistics.fmean(clocks) if clocks else None,
                     "power_w": statistics.fmean(powers) if powers else None}
    return out
