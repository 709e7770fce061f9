"""An op call as a program of stream operations, written once and run by a CUDA or a host driver.

A `Program` lists, in host issue order, steps on named lanes: "compute" (the caller's current stream, or
thread) and side lanes ("publish", "comm", "reduce"; CUDA streams of the op, or worker threads on CPU).

    take(lane, flag)        wait until this rank's control flag is SET, then CLEAR it (a toggle handshake)
    give(lane, flag, rank)  write SET into `rank`'s control flag (after the lane's earlier work)
    clear(lane, words)      write CLEAR into device flag words (kernels' flags, reset between calls)
    set(lane, words)        write SET into device flag words
    copy(lane, dst, src)    copy-engine copy between device views (a callable `src(ctx)` for call tensors)
    record(lane, name) / after(lane, name)   an ordering point between lanes
    run(lane, fn)           enqueue `fn(ctx)` (a GEMM, a kernel); `fn` sees the call's tensors in ctx
    await_device(lane, words)  host driver only: block until device flags are SET (a kernel waits itself)

Consecutive flag steps of one lane become one `cuStreamBatchMemOp` on CUDA (no SM, ~2 us). Side lanes start
after the compute steps issued before the first side step (the prologue), and the compute lane ends after
every side lane. A
program depends only on (op, M): it is built once and run many times, eager or inside a CUDA-graph capture
(the same stream operations either way); `GraphCache` may replay the side lanes of an eager call as a
CUDA graph recorded from the same steps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .protocol import CLEAR, SET, Flag

__all__ = ["Program", "CudaDriver", "HostDriver", "CallContext"]

COMPUTE = "compute"


@dataclass
class CallContext:
    """The tensors of one call, read by `run` steps and callable `copy` sources."""
    values: dict = field(default_factory=dict)

    def __getattr__(self, name):
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class _Step:
    kind: str
    lane: str
    args: tuple


class Program:
    def __init__(self, pool, *, op: str):
        self.pool, self.op = pool, op
        self.steps: list[_Step] = []
        self._compiled = None

    def _add(self, kind: str, lane: str, *args) -> "Program":
        self.steps.append(_Step(kind, lane, args))
        self._compiled = None
        return self

    def take(self, lane: str, flag: Flag, *, peer: int | None = None):
        return self._add("take", lane, flag, peer)

    def give(self, lane: str, flag: Flag, rank: int):
        return self._add("give", lane, flag, rank)

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

    def run(self, lane: str, fn: Callable):
        return self._add("run", lane, fn)

    def await_device(self, lane: str, words: torch.Tensor):
        return self._add("await_device", lane, words)

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
        flag, peer = step.args
        pool.expect(flag.region, flag.index, SET, peer=peer, op=op)
        address = pool.control_address(flag.region, flag.index)
        board = pool.control_address(flag.region, flag.index, board=True)
        return [memops.write(board, 1), memops.wait_eq(address, SET), memops.write(board, 0),
                memops.write(address, CLEAR)]
    if step.kind == "give":
        flag, rank = step.args
        return [memops.write(pool.control_address(flag.region, flag.index, rank=rank), SET)]
    words, value = step.args[0], (SET if step.kind == "set" else CLEAR)
    return [memops.write(words.data_ptr() + 4 * i, value) for i in range(words.numel())]


class CudaDriver:
    """Runs a program on CUDA streams: side lanes on the op's streams, "compute" on the current stream."""

    def __init__(self, program: Program, streams: dict[str, torch.cuda.Stream], *, external_events: bool = False):
        from symm_mem import memops
        self.program, self.streams = program, streams
        self.events = {name: torch.cuda.Event(external=external_events) for name in program.events()}
        self.start = torch.cuda.Event()
        self.lane_end = {lane: torch.cuda.Event() for lane in program.lanes}
        self.trace: dict[str, list] | None = None  # lane -> [start event, end event] (timing), when tracing
        self.items: list[tuple[str, Callable]] = []
        self.item_steps: list[int] = []  # index of the first program step behind each item
        pending: list = []
        pending_lane, pending_first = None, 0

        def flush():
            nonlocal pending, pending_lane
            for first in range(0, len(pending), 255):
                batch = memops.MemOpBatch(pending[first:first + 255])
                self.items.append((pending_lane, lambda ctx, stream, b=batch: b.enqueue(stream.cuda_stream)))
                self.item_steps.append(pending_first)
            pending, pending_lane = [], None

        for index, step in enumerate(program.steps):
            if step.kind in ("take", "give", "clear", "set"):
                if pending_lane not in (None, step.lane):
                    flush()
                if not pending:
                    pending_first = index
                pending_lane = step.lane
                pending.extend(_memops_of(program.pool, program.op, step, memops))
                continue
            if pending:
                flush()
            if step.kind == "await_device":
                continue  # kernels wait for their device flags themselves
            self.items.append((step.lane, self._enqueuer(step)))
            self.item_steps.append(index)
        if pending:
            flush()

    def _enqueuer(self, step: _Step) -> Callable:
        if step.kind == "copy":
            dst, src = step.args
            if callable(src):
                return lambda ctx, stream: dst.copy_(src(ctx), non_blocking=True)
            return lambda ctx, stream: dst.copy_(src, non_blocking=True)
        if step.kind == "record":
            event = self.events[step.args[0]]
            return lambda ctx, stream: event.record(stream)
        if step.kind == "after":
            event = self.events[step.args[0]]
            return lambda ctx, stream: stream.wait_event(event)
        fn = step.args[0]
        return lambda ctx, stream: fn(ctx)

    def enable_trace(self, on: bool) -> None:
        """Record timing events at the start and end of every lane (compute: the whole call) of each run."""
        lanes = [COMPUTE] + self.program.lanes
        self.trace = {lane: [torch.cuda.Event(enable_timing=True) for _ in range(2)] for lane in lanes} if on else None

    def trace_ms(self) -> dict[str, float]:
        """{lane: ms from its first to its last operation} of the last traced run (synchronises)."""
        self.trace[COMPUTE][1].synchronize()
        return {lane: start.elapsed_time(end) for lane, (start, end) in self.trace.items()}

    def count_items(self, steps) -> int:
        """How many of this driver's items come from the first len(steps) program steps."""
        return sum(1 for first in self.item_steps if first < len(steps))

    def run(self, ctx: CallContext, compute: torch.cuda.Stream | None = None, *, join: bool = True) -> None:
        compute = compute or torch.cuda.current_stream()
        trace = self.trace
        if trace:
            trace[COMPUTE][0].record(compute)
        started = self.run_items(ctx, compute, join=join)
        if trace:
            trace[COMPUTE][1].record(compute)
        del started

    def run_items(self, ctx: CallContext, compute, *, first: int = 0, last: int | None = None, lanes=None,
                  skip_lanes=(), join: bool = False) -> list[str]:
        """Enqueue items[first:last] (of `lanes`, not of `skip_lanes`); side lanes fork from `compute` at their
        first item and, with join=True, join back into it at the end. Returns the side lanes started."""
        trace = self.trace
        started: list[str] = []
        forked = False
        for lane, enqueue in self.items[first:last]:
            if (lanes is not None and lane not in lanes) or lane in skip_lanes:
                continue
            if lane == COMPUTE:
                enqueue(ctx, compute)
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
            with torch.cuda.stream(stream):
                enqueue(ctx, stream)
        if trace:
            for lane in started:
                trace[lane][1].record(self.streams[lane])
        if join:
            self.join(compute, started)
        return started

    def join(self, compute, lanes) -> None:
        for lane in lanes:
            self.lane_end[lane].record(self.streams[lane])
            compute.wait_event(self.lane_end[lane])


class HostDriver:
    """Runs a program on CPU ranks: side lanes on worker threads, "compute" on the calling thread; flags
    are the pool's shared host words, waited for with the pool's bounded host wait."""

    def __init__(self, program: Program):
        self.program = program
        self.pool = program.pool
        self.trace: dict[str, list] | None = None  # lane -> [start, end] host clock (s), when tracing

    def enable_trace(self, on: bool) -> None:
        self.trace = {} if on else None

    def trace_ms(self) -> dict[str, float]:
        return {lane: (end - start) * 1e3 for lane, (start, end) in self.trace.items()}

    def run(self, ctx: CallContext) -> None:
        events = {name: threading.Event() for name in self.program.events()}
        failure: list[BaseException] = []
        lanes = {lane: [s for s in self.program.steps if s.lane == lane] for lane in self.program.lanes}

        def run_lane(steps, lane=None):
            if self.trace is not None and lane is not None:
                self.trace[lane] = [time.perf_counter(), 0.0]
            try:
                for step in steps:
                    self._execute(step, ctx, events, failure)
                if self.trace is not None and lane is not None:
                    self.trace[lane][1] = time.perf_counter()
            except BaseException as exc:  # noqa: BLE001 - surfaced on the calling thread
                failure.append(exc)
                for event in events.values():
                    event.set()

        compute = [s for s in self.program.steps if s.lane == COMPUTE]
        first_side = next((i for i, s in enumerate(self.program.steps) if s.lane != COMPUTE), len(self.program.steps))
        prologue = [s for s in self.program.steps[:first_side] if s.lane == COMPUTE]
        if self.trace is not None:
            self.trace[COMPUTE] = [time.perf_counter(), 0.0]
        run_lane(prologue)  # side lanes start after the compute steps issued before them
        if failure:
            raise failure[0]
        threads = [threading.Thread(target=run_lane, args=(steps, lane), name=f"{self.program.op}-{lane}",
                                    daemon=True) for lane, steps in lanes.items()]
        for thread in threads:
            thread.start()
        try:
            run_lane(compute[len(prologue):])
        finally:
            for thread in threads:
                thread.join()
        if self.trace is not None:
            self.trace[COMPUTE][1] = time.perf_counter()
        if failure:
            raise failure[0]

    def _execute(self, step: _Step, ctx, events, failure) -> None:
        pool, kind = self.pool, step.kind
        if kind == "take":
            flag, peer = step.args
            words = pool.signals(flag.region)
            pool.host_wait(lambda: words[flag.index] == SET, peer=peer,
                           waiting_for=f"flag {flag.region}[{flag.index}]",
                           on_timeout=lambda: _timeout(pool, flag, int(words[flag.index]), peer, self.program.op))
            words[flag.index] = CLEAR
        elif kind == "give":
            flag, rank = step.args
            pool.signals(flag.region, rank)[flag.index] = SET
        elif kind in ("clear", "set"):
            step.args[0].fill_(SET if kind == "set" else CLEAR)
        elif kind == "await_device":
            words = step.args[0]
            pool.host_wait(lambda: bool((words == SET).all()), waiting_for=f"{self.program.op}: device flags",
                           on_timeout=lambda: _device_timeout(pool, self.program.op))
        elif kind == "copy":
            dst, src = step.args
            dst.copy_(src(ctx) if callable(src) else src)
        elif kind == "record":
            events[step.args[0]].set()
        elif kind == "after":
            events[step.args[0]].wait()
            if failure:
                raise failure[0]
        else:
            step.args[0](ctx)


def _timeout(pool, flag: Flag, observed: int, peer, op):
    from symm_mem import SignalTimeout
    pool.record_timeout(flag.region, flag.index, SET, observed)
    return SignalTimeout(region=flag.region, index=flag.index, expected=SET, observed=observed,
                         timeout_s=pool.timeout_s, peer=peer, op=op)


def _device_timeout(pool, op):
    from symm_mem import SignalTimeout
    pool.abort(1)
    return SignalTimeout(region=f"{op} device flags", index=-1, expected=SET, observed=0, timeout_s=pool.timeout_s,
                         op=op)
