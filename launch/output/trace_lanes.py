"""Reading a Chrome trace of a step: the GPU events of each CUDA stream (a lane), what each lane ran, and its
busy time. Pure functions of the trace (launch/measure/timeline.py records it; the plots and the results page
read it)."""

from __future__ import annotations

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
