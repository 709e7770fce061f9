"""An op call as a program of stream operations, written once per (op, M, variant) and run by a driver.

A `Program` lists, in host issue order, steps on named lanes: "compute" (the caller's current stream, or
thread) and side lanes ("comm", "reduce"; CUDA streams of the op, or worker threads on CPU).

    take(lane, flag, value)     wait until this rank's control flag holds `value`, then CLEAR it (a toggle)
    give(lane, flag, rank, value)  write `value` into `rank`'s control flag (after the lane's earlier work)
    clear(lane, words)          write CLEAR into device flag words (kernels' flags, reset between calls)
    set(lane, words)            write SET into device flag words
    copy(lane, dst, src)        copy-engine copy (`src` a view, or a callable `src(call)` for a tensor of the call)
    record(lane, name) / after(lane, name)   an ordering point between lanes
    run(lane, fn, local=False)  enqueue `fn(call)` (a GEMM, a kernel); `call` holds the call's tensors (the op's
                                AgCall / RsCall); local: see below
    await_device(lane, words, value)  host driver only: block until device flags hold `value`

A step that raises never leaves the ranks one call apart (a later call would take this call's flags and
return stale rows). A `local` run step writes only what this rank reads (this call's output, the caller's
`work` / `lead`): when it raises, the drivers skip the local steps after it and still issue every other step,
so the protocol completes (the peers' calls are right) before the error is raised here. Any other step that
raises (a GEMM whose rows a peer waits for, a copy, a flag wait that expired) aborts the pool: every rank
raises within the wait bound, none returns data (overlap/ops/failure.py).

`value` is SET or the call's M (overlap/ops/protocol.py): a take that finds another nonzero value reports a
disagreement on M to every rank. The CUDA driver compiles the steps once: consecutive flag steps of a lane
become one `cuStreamBatchMemOp` (no SM, ~2 us), copies between contiguous views one `cuMemcpyAsync` on the
lane's stream, ordering points events. Side lanes start after the compute steps issued before them (the
prologue), and the compute lane ends after every side lane. A program depends only on (op, M, variant), so
an eager enqueue, a capture into the op's own CUDA graph and a capture by the caller issue the same stream
operations.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .failure import CallState, LaneStopped, abandon, completed, is_local, join_lanes
from .protocol import CLEAR, SET, Flag

__all__ = ["Program", "CudaDriver", "HostDriver", "COMPUTE"]

COMPUTE = "compute"


@dataclass(frozen=True)
class _Step:
    kind: str
    lane: str
    args: tuple


class Program:
    def __init__(self, pool, *, op: str):
        self.pool, self.op = pool, op
        self.steps: list[_Step] = []

    def _add(self, kind: str, lane: str, *args) -> "Program":
        self.steps.append(_Step(kind, lane, args))
        return self

    def take(self, lane: str, flag: Flag, *, peer: int | None = None, value: int = SET):
        return self._add("take", lane, flag, peer, value)

    def give(self, lane: str, flag: Flag, rank: int, *, value: int = SET):
        return self._add("give", lane, flag, rank, value)

    def clear(self, lane: str, words: torch.Tensor):
        return self._add("clear", lane, words)

    def set(self, lane: str, words: torch.Tensor):
        return self._add("set", lane, words)

    def copy(self, lane: str, dst: torch.Tensor, src):
        return self._add("copy", lane, dst, src)

    def record(self, lane: str, name: str):
        return self._add("record", lane, name)

    def after(self, lane: str, name: str):
        return self._add("after", lane, name)

    def run(self, lane: str, fn: Callable, *, local: bool = False):
        """`local`: fn's writes are read by this rank only (see the module docstring: a local step that raises
        lets the call complete; any other aborts the pool)."""
        return self._add("run", lane, fn, local)

    def await_device(self, lane: str, words: torch.Tensor, *, value: int = SET, code: int = 0):
        """`code`: the error code that names these flags' region (`pool.device_error_code(region, 0)`)."""
        return self._add("await_device", lane, words, value, code)

    @property
    def lanes(self) -> list[str]:
        seen = []
        for step in self.steps:
            if step.lane != COMPUTE and step.lane not in seen:
                seen.append(step.lane)
        return seen

    def events(self) -> list[str]:
        return sorted({s.args[0] for s in self.steps if s.kind == "record"})


def _memops_of(pool, op: str, step: _Step, memops) -> list:
    """The memory operations of one flag step (CUDA)."""
    if step.kind == "take":
        flag, peer, value = step.args
        pool.expect(flag.region, flag.index, value, peer=peer, op=op)
        address = pool.control_address(flag.region, flag.index)
        board = pool.control_address(flag.region, flag.index, board=True)
        # the board holds the awaited value while the stream waits: the watchdog bounds the wait and reports
        # a flag at another nonzero value (a peer with another M)
        return [memops.write(board, value), memops.wait_eq(address, value), memops.write(board, 0),
                memops.write(address, CLEAR)]
    if step.kind == "give":
        flag, rank, value = step.args
        return [memops.write(pool.control_address(flag.region, flag.index, rank=rank), value)]
    words, value = step.args[0], (SET if step.kind == "set" else CLEAR)
    return [memops.write(words.data_ptr() + 4 * i, value) for i in range(words.numel())]


def _contiguous_bytes(t: torch.Tensor) -> int | None:
    return t.numel() * t.element_size() if t.is_contiguous() else None


def _pitched(t: torch.Tensor) -> bool:
    """Rows of contiguous elements at a stride of at least a row: what one 2D copy moves."""
    return t.dim() == 2 and t.numel() > 0 and t.stride(1) == 1 and t.stride(0) >= t.shape[1]


class CudaDriver:
    """Runs a program on CUDA streams: side lanes on the op's streams, "compute" on the given stream."""

    def __init__(self, program: Program, streams: dict[str, torch.cuda.Stream]):
        from tp_overlap.symm_mem import memops
        self.program, self.streams = program, streams
        self.events = {name: torch.cuda.Event() for name in program.events()}
        self.start = torch.cuda.Event()
        self.lane_end = {lane: torch.cuda.Event() for lane in program.lanes}
        self.trace: dict[str, list] | None = None  # lane -> [start event, end event] (timing), when tracing
        # (lane, enqueue(call, stream), needs the lane's stream to be current, local)
        self.items: list[tuple[str, Callable, bool, bool]] = []
        pending: list = []
        pending_lane = None

        def flush():
            nonlocal pending, pending_lane
            for first in range(0, len(pending), 255):
                batch = memops.MemOpBatch(pending[first:first + 255])
                self.items.append((pending_lane, lambda call, stream, b=batch: b.enqueue(stream.cuda_stream), False,
                                   False))
            pending, pending_lane = [], None

        for step in program.steps:
            if step.kind in ("take", "give", "clear", "set"):
                if pending_lane not in (None, step.lane):
                    flush()
                pending_lane = step.lane
                pending.extend(_memops_of(program.pool, program.op, step, memops))
                continue
            if pending:
                flush()
            if step.kind == "await_device":
                continue  # kernels wait for their device flags themselves
            self.items.append((step.lane, *self._enqueuer(step, memops), is_local(step)))
        if pending:
            flush()

    def _enqueuer(self, step: _Step, memops) -> tuple[Callable, bool]:
        if step.kind == "copy":
            dst, src = step.args
            nbytes = _contiguous_bytes(dst)
            if callable(src):
                return (lambda call, stream: dst.copy_(src(call), non_blocking=True)), True
            if nbytes is not None and _contiguous_bytes(src) == nbytes:
                d, s = dst.data_ptr(), src.data_ptr()
                return (lambda call, stream: memops.memcpy_async(d, s, nbytes, stream.cuda_stream)), False
            if _pitched(dst) and _pitched(src) and dst.shape == src.shape and dst.dtype == src.dtype:
                size = dst.element_size()  # rows of columns: one copy-engine copy, not torch's copy kernel
                copy = memops.Memcpy2D(dst=dst.data_ptr(), dst_pitch=dst.stride(0) * size, src=src.data_ptr(),
                                       src_pitch=src.stride(0) * size, width_bytes=dst.shape[1] * size,
                                       height=dst.shape[0])
                return (lambda call, stream: copy.enqueue(stream.cuda_stream)), False
            return (lambda call, stream: dst.copy_(src, non_blocking=True)), True
        if step.kind == "record":
            event = self.events[step.args[0]]
            return (lambda call, stream: event.record(stream)), False
        if step.kind == "after":
            event = self.events[step.args[0]]
            return (lambda call, stream: stream.wait_event(event)), False
        fn = step.args[0]
        return (lambda call, stream: fn(call)), True

    def enable_trace(self, on: bool) -> None:
        """Record timing events at the start and end of every lane (compute: the whole call) of each run."""
        lanes = [COMPUTE] + self.program.lanes
        self.trace = {lane: [torch.cuda.Event(enable_timing=True) for _ in range(2)] for lane in lanes} if on else None

    def trace_ms(self) -> dict[str, float]:
        """{lane: ms from its first to its last operation} of the last traced run (synchronises)."""
        self.trace[COMPUTE][1].synchronize()
        return {lane: start.elapsed_time(end) for lane, (start, end) in self.trace.items()}

    def run(self, call, compute: torch.cuda.Stream, *, abort: bool = True) -> None:
        """Enqueue one call; `compute` must be the current stream. Side lanes fork from it at their first
        item and join back into it at the end. A local item that raises (the caller's `work`, while being
        enqueued) is skipped with the local items after it and the rest is enqueued (the protocol completes);
        any other aborts the pool (module docstring), unless abort=False (an op recording its own graph: nothing
        recorded has run, and the call runs step by step next). The error is raised once the lanes are joined."""
        trace = self.trace
        if trace:
            trace[COMPUTE][0].record(compute)
        started: list[str] = []
        forked = False
        error, fatal = None, False
        for lane, enqueue, needs_stream, local in self.items:
            if error is not None and local:
                continue
            try:
                if lane == COMPUTE:
                    enqueue(call, compute)
                    continue
                stream = self.streams[lane]
                if not forked:  # side lanes start after the compute steps issued before them (the prologue)
                    self.start.record(compute)
                    forked = True
                if lane not in started:
                    stream.wait_event(self.start)
                    started.append(lane)
                    if trace:
                        trace[lane][0].record(stream)
                if needs_stream:
                    with torch.cuda.stream(stream):
                        enqueue(call, stream)
                else:
                    enqueue(call, stream)
            except BaseException as exc:  # noqa: BLE001 - raised below, once the lanes are joined
                error = error or exc
                if not local:  # the watchdog releases the waits already enqueued: nothing is left waiting
                    fatal = True
                    if abort:
                        abandon(self.program.pool, self.program.op, error)
                    break
        self._join(compute, started, trace)
        if error is not None:
            if not fatal:
                completed(self.program.op, error)
            raise error

    def _join(self, compute, started: list[str], trace) -> None:
        for lane in started:
            stream = self.streams[lane]
            if trace:
                trace[lane][1].record(stream)
            self.lane_end[lane].record(stream)
            compute.wait_event(self.lane_end[lane])
        if trace:
            trace[COMPUTE][1].record(compute)


class HostDriver:
    """Runs a program on CPU ranks: side lanes on worker threads, "compute" on the calling thread; flags
    are the pool's shared host words, waited for with the pool's bounded host wait."""

    def __init__(self, program: Program):
        self.program = program
        self.pool = program.pool
        self.trace: dict[str, list] | None = None  # lane -> [start, end] host clock (s), when tracing
        steps = program.steps
        first_side = next((i for i, s in enumerate(steps) if s.lane != COMPUTE), len(steps))
        self.prologue = [s for s in steps[:first_side] if s.lane == COMPUTE]
        self.compute = [s for s in steps[first_side:] if s.lane == COMPUTE]
        self.lanes = {lane: [s for s in steps if s.lane == lane] for lane in program.lanes}

    def enable_trace(self, on: bool) -> None:
        self.trace = {} if on else None

    def trace_ms(self) -> dict[str, float]:
        return {lane: (end - start) * 1e3 for lane, (start, end) in self.trace.items()}

    def run(self, call, compute=None) -> None:
        state = CallState(self.pool, self.program)

        def run_lane(steps, lane=None):
            if self.trace is not None and lane is not None:
                self.trace[lane] = [time.perf_counter(), 0.0]
            for step in steps:
                if state.error is not None and is_local(step):
                    continue  # this call's own work after a failure: its result is raised, not used
                try:
                    self._execute(step, call, state)
                except LaneStopped:
                    return
                except BaseException as exc:  # noqa: BLE001 - raised on the calling thread at the end
                    if not state.fail(exc, local=is_local(step)):
                        return
            if self.trace is not None and lane is not None:
                self.trace[lane][1] = time.perf_counter()

        if self.trace is not None:
            self.trace[COMPUTE] = [time.perf_counter(), 0.0]
        threads = [threading.Thread(target=run_lane, args=(steps, lane), name=f"{self.program.op}-{lane}",
                                    daemon=True) for lane, steps in self.lanes.items()]
        try:
            run_lane(self.prologue)  # side lanes start after the compute steps issued before them
            if not state.fatal:
                for thread in threads:
                    thread.start()
                run_lane(self.compute)
        except BaseException as exc:  # noqa: BLE001 - between steps: a lane that did not start, an interrupt
            state.fail(exc, local=False)
        finally:
            join_lanes(threads, state)
        if self.trace is not None:
            self.trace[COMPUTE][1] = time.perf_counter()
        if state.error is not None:
            state.raise_error()

    def _execute(self, step: _Step, call, state: "CallState") -> None:
        pool, kind = self.pool, step.kind
        if kind == "take":
            flag, peer, value = step.args
            words = pool.signals(flag.region)
            pool.host_wait(lambda: words[flag.index] != CLEAR, peer=peer,
                           waiting_for=f"flag {flag.region}[{flag.index}]",
                           on_timeout=lambda: _timeout(pool, flag, value, int(words[flag.index]), peer,
                                                       self.program.op))
            seen = int(words[flag.index])
            if seen != value:
                pool.report_mismatch(pool.control_code(flag.region, flag.index), value, seen, peer)
                pool.raise_if_failed()
            words[flag.index] = CLEAR
        elif kind == "give":
            flag, rank, value = step.args
            pool.signals(flag.region, rank)[flag.index] = value
        elif kind in ("clear", "set"):
            step.args[0].fill_(SET if kind == "set" else CLEAR)
        elif kind == "await_device":
            self._await_device(*step.args)
        elif kind == "copy":
            dst, src = step.args
            dst.copy_(src(call) if callable(src) else src)
        elif kind == "record":
            state.events[step.args[0]].set()
        elif kind == "after":
            state.events[step.args[0]].wait()  # set by its lane, or by a failure that stops every lane
            if state.fatal:
                raise LaneStopped
        else:
            step.args[0](call)

    def _await_device(self, words: torch.Tensor, value: int, code: int) -> None:
        pool, op = self.pool, self.program.op
        pool.host_wait(lambda: bool((words != CLEAR).all()), waiting_for=f"{op}: device flags",
                       on_timeout=lambda: _device_timeout(pool, op, value))
        wrong = words[words != value]
        if wrong.numel():
            pool.report_mismatch(code, value, int(wrong[0]), None)
            pool.raise_if_failed()


def _timeout(pool, flag: Flag, expected: int, observed: int, peer, op):
    from tp_overlap.symm_mem.errors import SignalTimeout
    pool.record_timeout(flag.region, flag.index, expected, observed)
    return SignalTimeout(region=flag.region, index=flag.index, expected=expected, observed=observed,
                         timeout_s=pool.timeout_s, peer=peer, op=op)


def _device_timeout(pool, op, value):
    from tp_overlap.symm_mem.errors import SignalTimeout
    pool.abort(1)
    return SignalTimeout(region=f"{op} device flags", index=-1, expected=value, observed=0, timeout_s=pool.timeout_s,
                         op=op)

