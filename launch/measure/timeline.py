"""Per-stream timelines of one profiled step: where a step's device time goes, stream by stream.

`profile_steps` runs each step once under torch.profiler (after a barrier, from an idle device), writes
rank 0's Chrome trace per step, and returns, per step, the GPU activity of every stream: kernels and
copies as (start_ms, end_ms) intervals from the step's first GPU activity, the busy time of each stream
(the union of its intervals), and the step's span (read from the trace by launch/output/trace_lanes.py).
CUDA-graph replays show their kernels individually. `step_timeline`: the lanes of one overlapped step.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from tp_overlap.launch.output.trace_lanes import stream_lanes, summarise

from .k_factor import _cpu_switch_interval, _PairRunner
from .timing import mark_ms as _ms

def profile_steps(steps: dict[str, Callable[[], object]], *, group: dist.ProcessGroup, rank: int,
                  out_dir: str | Path, stem: str) -> tuple[dict, dict]:
    """Profile one call of each step on every rank; rank 0 writes `<stem>_<name>_rank0.trace.json`.

    Returns ({name: summary}, {name: lanes}) on rank 0 (empty dicts on the other ranks).
    """
    from torch.profiler import ProfilerActivity, profile

    summaries, all_lanes = {}, {}
    out_dir = Path(out_dir)
    for name, step in steps.items():
        torch.cuda.synchronize()
        dist.barrier(group=group)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"{stem}_{name}_rank0.trace.json"
            prof.export_chrome_trace(str(path))
            lanes = stream_lanes(json.loads(path.read_text()))
            summaries[name] = summarise(lanes) | {"trace": str(path)}
            all_lanes[name] = lanes
    return summaries, all_lanes


def step_timeline(comm_fn, comp_fn, *, device: torch.device, group, lanes: Callable[[], dict] | None = None,
                  profile_path: str | None = None) -> dict[str, list[tuple[float, float]]]:
    """One overlapped step (collective): {lane: [(start_ms, end_ms)]} from the step's start.

    Lanes: "compute stream", "comm stream" and, from `lanes()` (e.g. RsCommOnly's push / reduce streams),
    one lane each (CPU: "compute thread", "comm thread" and the comm thread's phases). With
    `profile_path` this rank also records the step with torch.profiler (CPU activity, CUDA too on GPUs)
    and writes a Chrome trace there.
    """
    runner = _PairRunner(comm_fn, comp_fn, device, None)
    if runner.cuda:   # as measure_pair: the profiled step must start both sides at `go` too
        runner.set_hold_from_enqueue_time(group)
    for _ in range(2):   # warm: first calls compile kernels and open handles
        runner.overlap()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None:
        dist.barrier(group=group)
    with _cpu_switch_interval(device), _profiler(device, profile_path) as prof:
        runner.overlap()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if prof is not None:
        prof.export_chrome_trace(str(profile_path))
    marks = runner.steps["both"][-1]
    go = marks["go"]
    unit = "stream" if device.type == "cuda" else "thread"
    out = {f"compute {unit}": [marks["comp"]], f"comm {unit}": [marks["comm"]]}
    for name, (start, end) in (lanes() if lanes else {}).items():
        out[f"{name} stream" if device.type == "cuda" else f"comm thread: {name}"] = [(start, end)]
    return {lane: [(_ms(go, s), _ms(go, e)) for s, e in spans] for lane, spans in out.items()}


def _profiler(device: torch.device, path):
    if path is None:
        return nullcontext()
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:   # record the comm thread too (CPU mode); older torch lacks the option
        from torch.profiler import _ExperimentalConfig
        return profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True))
    except (ImportError, TypeError):
        return profile(activities=activities)
