"""Sustained timing of training steps: blocks of back-to-back steps of one variant, with SM clock and power.

The interleaved medians (launch.measure.timing) put a barrier and an L2 flush between steps. A training loop does
not pause, and on a power-capped GPU the variant that does the same work in less time draws more power and
runs at a lower clock (2-4 % lower for the overlapped step on 2 x H200, a probe at 5c1a4fa listed under
"Experiments not kept" in results/README.md). Here every variant runs blocks of the same number of
back-to-back steps (`seconds` at the fastest variant's interleaved median), two rounds in the order
A B C, C B A (each variant's blocks sit at mirrored positions, so none always follows the pauses of the
interleaved phase), and each block reports ms/step (the span of the block over its steps, max over ranks)
and, on CUDA where `nvidia-smi` answers, this rank's GPU's mean SM clock and power over the block (20 ms
samples of the instantaneous power where the driver has it, else its 1 s average; the first 0.2 s of a
block, 1 s for an averaged power, is left out as ramp-up).
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

from tp_overlap.launch.measure.timing import Timer, barrier, progress

SAMPLE_MS = 20
RAMP_S = 0.2
AVERAGED_POWER_RAMP_S = 1.0  # `power.draw` is a 1 s average on Ampere and newer


class GpuSampler:
    """`nvidia-smi` sampling one GPU's SM clock (MHz) and power (W) in a thread; inert without CUDA or
    nvidia-smi (every window then reads (None, None))."""

    def __init__(self, device: torch.device):
        self._samples: list[tuple[float, float, float]] = []  # (monotonic s, MHz, W)
        self._proc = None
        self._thread = None
        self._target = None
        self.power_field, self.power_ramp_s = "power.draw.instant", RAMP_S
        if device.type == "cuda" and shutil.which("nvidia-smi"):
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self._target = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            if not self._answers(self.power_field):  # older drivers: only the 1 s average
                self.power_field, self.power_ramp_s = "power.draw", AVERAGED_POWER_RAMP_S

    def _answers(self, field: str) -> bool:
        try:
            probe = subprocess.run(["nvidia-smi", "-i", self._target, f"--query-gpu={field}",
                                    "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return False
        try:
            float(probe.stdout.strip())
        except ValueError:
            return False
        return probe.returncode == 0

    def __enter__(self) -> "GpuSampler":
        if self._target:
            cmd = ["nvidia-smi", "-i", self._target, f"--query-gpu=clocks.sm,{self.power_field}",
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
        """Mean (SM clock MHz, power W) of a block that ran from t0 to t1 (monotonic seconds), each without
        its ramp-up."""
        samples = list(self._samples)
        clocks = [c for t, c, _ in samples if t0 + RAMP_S <= t <= t1]
        powers = [p for t, _, p in samples if t0 + self.power_ramp_s <= t <= t1]
        return (statistics.fmean(clocks) if clocks else None, statistics.fmean(powers) if powers else None)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
            self._thread.join(timeout=5)


def _block(step: Callable[[], object], n: int, device) -> tuple[float, float, float]:
    """n back-to-back steps: (ms per step on this rank, monotonic start, monotonic end)."""
    def run() -> None:  # a plain loop: keeps no step's return value alive for the rest of the block
        for _ in range(n):
            step()

    timer = Timer(device)
    t0 = time.monotonic()
    timer.time(run)
    ms = timer.elapsed_ms()[0]  # synchronises
    return ms / n, t0, time.monotonic()


def sustained_blocks(steps: dict[str, Callable[[], object]], *, seconds: float, step_ms: float, group,
                     device: torch.device, rank: int, label: str = "") -> dict[str, dict]:
    """{variant: {"ms": mean ms/step of its two blocks, "block_ms": both, "sm_clock_mhz": mean, "power_w":
    mean}}: ms max over ranks, clock and power of this rank's GPU (None without samples). Every variant
    runs the same number of steps per block: `seconds` worth of `step_ms` (the fastest variant's
    interleaved median, the same on every rank)."""
    if not (math.isfinite(seconds) and math.isfinite(step_ms)) or seconds <= 0 or step_ms <= 0:
        raise ValueError(f"need finite seconds > 0 and step_ms > 0, got {seconds}, {step_ms}")
    n = max(3, math.ceil(seconds * 1e3 / step_ms))
    order = list(steps) + list(steps)[::-1]
    progress(f"{label}sustained: {len(order)} blocks of {n} steps ({' '.join(order)})", rank=rank)
    blocks: dict[str, list] = {name: [] for name in steps}
    with GpuSampler(device) as sampler:
        for i, name in enumerate(order):
            progress(f"{label}sustained block {i + 1}/{len(order)} ({name}, {n} steps)", rank=rank)
            barrier(group, device)
            ms, t0, t1 = _block(steps[name], n, device)
            blocks[name].append((ms, *sampler.window(t0, t1)))
    ms_table = torch.tensor([[b[0] for b in blocks[name]] for name in steps], dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        on = ms_table.to(device) if device.type == "cuda" else ms_table
        dist.all_reduce(on, op=dist.ReduceOp.MAX, group=group)
        ms_table = on.cpu()
    out = {}
    for i, name in enumerate(steps):
        clocks = [b[1] for b in blocks[name] if b[1] is not None]
        powers = [b[2] for b in blocks[name] if b[2] is not None]
        out[name] = {"ms": statistics.fmean(ms_table[i].tolist()), "block_ms": ms_table[i].tolist(),
                     "sm_clock_mhz": statistics.fmean(clocks) if clocks else None,
                     "power_w": statistics.fmean(powers) if powers else None}
    return out
