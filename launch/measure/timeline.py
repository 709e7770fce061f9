"""Per-stream timelines of one profiled step: where a step's device time goes, stream by stream.

`profile_steps` runs each step once under torch.profiler (after a barrier, from an idle device), writes
rank 0's Chrome trace per step, and returns, per step, the GPU activity of every stream: kernels and
copies as (start_ms, end_ms) intervals from the step's first GPU activity, the busy time of each stream
(the union of its intervals), and the step's span. CUDA-graph replays show their kernels individually.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from .k_factor import _cpu_switch_interval, _PairRunner
from .timing import mark_ms as _ms

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# what a GPU event does, from its name (first match wins); "other" last
KINDS = {
    "GEMM": ("nvjet", "gemm", "cutlass", "xmma", "sm90_"),
    "NCCL collective": ("nccl",),
    "copy": ("memcpy",),
    "flag wait / signal": ("wait_kernel", "signal", "write_value", "wait_value"),
    "reduction of partials": ("reduce_partials",),
    "device hold (spin)": ("spin_kernel",),
    "memset": ("memset",),
    "elementwise / other": (),
}


def stream_lanes(trace: dict) -> dict[str, list[tuple[float, float, str]]]:
    """{`stream <id>`: [(start_ms, end_ms, name)]} of a Chrome trace's GPU events, from the first one."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not events:
        return {}
    t0 = min(e["ts"] for e in events)
    lanes: dict[str, list] = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        stream = e.get("args", {}).get("stream", e.get("tid"))
        start = (e["ts"] - t0) / 1e3
        lanes.setdefault(f"stream {stream}", []).append((start, start + e.get("dur", 0) / 1e3, e["name"]))
    return lanes


def event_kind(name: str) -> str:
    """The KINDS entry of a GPU event's name (a cuBLAS `nvjet_...` kernel is a GEMM, `Memcpy PtoP` a copy)."""
    low = name.lower()
    return next((kind for kind, keys in KINDS.items() if any(k in low for k in keys)), "elementwise / other")


def lane_roles(lanes: dict[str, list]) -> dict[str, str]:
    """{lane: what it runs}: its kinds by busy time, the two largest (`GEMM + copy`); the stream
    number, which says nothing to a reader and differs between runs, is left out (a repeat gets `#2`)."""
    roles: dict[str, str] = {}
    for lane, spans in lanes.items():
        busy: dict[str, float] = {}
        for start, stop, name in spans:
            kind = event_kind(name)
            busy[kind] = busy.get(kind, 0.0) + stop - start
        top = [k for k, _ in sorted(busy.items(), key=lambda kv: -kv[1]) if k != "memset"][:2] or ["memset"]
        role = " + ".join(top)
        count = sum(r.split(" #")[0] == role for r in roles.values())
        roles[lane] = f"{role} #{count + 1}" if count else role
    return roles


def _union_ms(intervals) -> float:
    total, end = 0.0, float("-inf")
    for start, stop, *_ in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarise(lanes: dict[str, list]) -> dict:
    """Span of the step and, per stream, busy ms, event count and the three longest kernel names."""
    if not lanes:
        return {"span_ms": 0.0, "streams": {}}
    span = max(stop for spans in lanes.values() for _, stop, _ in spans)
    streams = {}
    for lane, spans in lanes.items():
        by_name: dict[str, float] = {}
        for start, stop, name in spans:
            by_name[name] = by_name.get(name, 0.0) + stop - start
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:3]
        streams[lane] = {"busy_ms": round(_union_ms(spans), 4), "events": len(spans),
                         "top": [[name[:80], round(ms, 4)] for name, ms in top]}
    return {"span_ms": round(span, 4), "streams": streams}


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
