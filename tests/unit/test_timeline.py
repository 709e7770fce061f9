"""Per-stream timelines from a Chrome trace: lanes per stream, busy time as the union of intervals."""

from tp_overlap.launch.output.trace_lanes import stream_lanes, summarise


def _event(cat, ts, dur, stream, name="k"):
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}


def test_busy_time_is_the_union_of_overlapping_intervals_per_stream():
    trace = {"traceEvents": [
        _event("kernel", 1000, 100, 7, "gemm"), _event("kernel", 1050, 100, 7, "gemm"),   # overlap: 150 us
        _event("kernel", 1300, 50, 7, "act"),
        _event("gpu_memcpy", 1000, 400, 21, "Memcpy DtoD"),
        _event("cpu_op", 900, 2000, 0, "aten::mm"),                                      # not GPU: ignored
        {"ph": "i", "cat": "kernel", "ts": 5, "name": "instant"},                         # not a span: ignored
    ]}
    lanes = stream_lanes(trace)
    assert set(lanes) == {"stream 7", "stream 21"}
    assert lanes["stream 7"][0] == (0.0, 0.1, "gemm")          # ms from the first GPU event
    summary = summarise(lanes)
    assert summary["span_ms"] == 0.4
    assert summary["streams"]["stream 7"]["busy_ms"] == 0.2     # 0.15 + 0.05
    assert summary["streams"]["stream 7"]["events"] == 3
    assert summary["streams"]["stream 7"]["top"][0] == ["gemm", 0.2]
    assert summary["streams"]["stream 21"]["busy_ms"] == 0.4


def test_an_empty_trace_summarises_to_zero():
    assert summarise(stream_lanes({"traceEvents": []})) == {"span_ms": 0.0, "streams": {}}
