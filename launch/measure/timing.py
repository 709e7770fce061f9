"""The timing harness every benchmark uses (docs/ARCHITECTURE.md, "Timing").

Per repetition and per variant (variants interleaved round-robin, the order rotated each rep): the
device is drained, the ranks meet at a barrier, L2 is flushed, then the variant runs between two events
on the current stream (host clock on CPU). A variant that uses side streams must join them back into the
current stream before it returns. With `hold_device_us`, a spin kernel keeps the stream busy that long
after the flush, so that the variant's launches are all queued before its start event fires: the time is
then device time only (for kernel comparisons), except in a rep whose host enqueue outlasts the hold (counted
per variant as `late_reps`: its time includes host latency; `host_median_ms` says how long the variant's call
took to return); without it, host launch latency the flush does not hide is included (the default: what one
eager call costs from an idle device). After all reps the per-rep times are reduced with MAX over the ranks of
the group, and each variant reports median / min / max of those maxima.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from tp_overlap.config import envs

L2_FLUSH_BYTES = 256 << 20  # > 4x the 60 MB L2 of an H200
SLEEP_CYCLES_PER_US = 2000  # torch.cuda._sleep spins for clock cycles; ~1.98 GHz on an H200 (at least as long below)
PROGRESS_INTERVAL_S = 2.0  # bench_interleaved with a label: at most one progress line per interval


@dataclass(frozen=True)
class Stats:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    late_reps: int = 0  # reps whose host enqueue outlasted the device hold (max over ranks)
    host_median_ms: float = 0.0  # the median time the variant's call took to return on the host (max over ranks)

    @property
    def spread(self) -> float:
        """(max - min) / median: how much to trust a difference between two variants."""
        return (self.max_ms - self.min_ms) / self.median_ms if self.median_ms else 0.0

    def as_dict(self, prefix: str = "") -> dict:
        return {f"{prefix}median_ms": self.median_ms, f"{prefix}min_ms": self.min_ms,
                f"{prefix}max_ms": self.max_ms, f"{prefix}reps": self.reps, f"{prefix}late_reps": self.late_reps,
                f"{prefix}host_median_ms": self.host_median_ms}


def mark(stream=None):
    """A point in time: a CUDA event recorded on `stream`, or the host clock when `stream` is None."""
    if stream is None:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def mark_ms(start, end) -> float:
    """Milliseconds between two marks (events: after they completed)."""
    return start.elapsed_time(end) if isinstance(start, torch.cuda.Event) else (end - start) * 1e3


def progress(message: str, *, rank: int = 0) -> None:
    if rank == 0 and envs.progress_enabled():
        print(f"[overlap] {message}", file=sys.stderr, flush=True)


class Ticker:
    """Progress of a long loop on rank 0: a line when a phase starts, when its last call starts, and at
    most one per PROGRESS_INTERVAL_S in between, so that a slow run is never silent for long."""

    def __init__(self, label: str):
        self.label = label
        self.rank = dist.get_rank() if label and dist.is_available() and dist.is_initialized() else 0
        self.last, self.phase = -math.inf, None

    def __call__(self, phase: str, i: int, total: int, name: str, *, last: bool | None = None) -> None:
        if not self.label:
            return
        now = time.monotonic()
        last = i == total - 1 if last is None else last
        if phase != self.phase or last or now - self.last >= PROGRESS_INTERVAL_S:
            self.last, self.phase = now, phase
            progress(f"{self.label}{phase} {i + 1}/{total} ({name})", rank=self.rank)


class Timer:
    """Start/stop around a region of the current stream: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pending: list = []
        self.host_ms: list[float] = []  # per ticket: how long fn took to return (its host enqueue on GPU)

    def time(self, fn: Callable[[], object]) -> int:
        """Run fn between two marks; returns a ticket redeemed by `elapsed_ms` after `sync`."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            self.host_ms.append((time.perf_counter() - t0) * 1e3)
            end.record()
            self._pending.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            self.host_ms.append((t1 - t0) * 1e3)
            self._pending.append((t0, t1))
        return len(self._pending) - 1

    def elapsed_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self._pending]
        return [(e - s) * 1e3 for s, e in self._pending]


def barrier(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Drain this rank's device, then meet the group's other ranks (no group: only drain)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None:
        dist.barrier(group=group)


def bench_interleaved(variants: dict[str, Callable[[], object]], *, group: dist.ProcessGroup | None,
                      device: torch.device, warmup: int = 3, reps: int = 20, flush_l2: bool = True,
                      hold_device_us: float = 0.0, label: str = "") -> dict[str, Stats]:
    """Time every variant `reps` times, interleaved; returns Stats per variant (max over ranks). With a
    `label`, rank 0 reports progress ("<label>warm-up i/N", "<label>timed step i/N") on stderr."""
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    names = list(variants)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) \
        if flush_l2 and device.type == "cuda" else None
    tick = Ticker(label)
    for i in range(warmup):
        for name in names:
            tick("warm-up", i, warmup, name, last=i == warmup - 1 and name == names[-1])
            variants[name]()
    barrier(group, device)
    timer = Timer(device)
    tickets: dict[str, list[int]] = {n: [] for n in names}
    for rep in range(reps):
        shift = rep % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            tick("timed step", rep, reps, name, last=rep == reps - 1 and name == order[-1])
            barrier(group, device)
            if flush is not None:
                flush.zero_()
            if hold_device_us > 0 and device.type == "cuda":
                torch.cuda._sleep(int(hold_device_us * SLEEP_CYCLES_PER_US))
            tickets[name].append(timer.time(variants[name]))
    elapsed = timer.elapsed_ms()
    # two extra columns per variant: its late reps, whose host enqueue outlasted the hold (on CPU, where no hold
    # runs: the reps that a hold of that length would not have covered), and its median host enqueue time
    hold_ms = hold_device_us / 1e3 if hold_device_us > 0 else math.inf
    table = torch.tensor([[elapsed[t] for t in tickets[n]] + [sum(timer.host_ms[t] > hold_ms for t in tickets[n]),
                                                              statistics.median(timer.host_ms[t] for t in tickets[n])]
                          for n in names], dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        reduce_on = table.to(device) if device.type == "cuda" else table
        dist.all_reduce(reduce_on, op=dist.ReduceOp.MAX, group=group)
        table = reduce_on.cpu()
    del flush
    out = {}
    for i, name in enumerate(names):
        samples = table[i, :-2].tolist()
        out[name] = Stats(statistics.median(samples), min(samples), max(samples), len(samples),
                          late_reps=int(table[i, -2]), host_median_ms=float(table[i, -1]))
    return out
