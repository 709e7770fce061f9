"""k-factor: how much overlapped communication and computation slow each other down (docs/ARCHITECTURE.md, "k").

Every time is in ms: the median over reps of the MAX over the ranks of the group.

* comm solo    the op's communication path alone on a high-priority side stream (CPU: the calling thread),
               nothing else running on this rank:
                 AgGemm: `op.all_gather(a_shard)` -- publish + copy-engine pulls, the op's own schedule;
                 GemmRs: push of precomputed partials (a @ w) to their owners with the copy engine + flags,
                 then the reduction kernel on the op's reduction SMs (`num_comm_sms or sm_margin or 8`):
                 the scatter + reduction of the decomposed method with no GEMM (`RsCommOnly`, or the op's
                 `reduce_scatter(partials)` once it has one). For the fused method the scatter is really
                 done by the GEMM epilogue's NVLink stores, which cannot run without the GEMM: the CE push
                 stands in for it (for epilogue_reduce the reduction too runs inside the GEMM: the same
                 stand-in, which overstates its comm).
* comp solo    `op.compute_alone(...)`: the op's own plan for that M without its comm lanes (no flags, no
               copies, local epilogue), on a side stream (CPU: the calling thread): the same GEMMs, blocks,
               SM budget and chunk / owner order as the op's call. The one definition of "compute alone"
               (the benchmarks and the in-step k use it too).
* overlapped   mode "pair" (default, any op, CPU too): the same comm_fn and comp_fn started together, each
               on its own stream (CPU: comm on a thread, compute on the caller), with no data dependency:
               pure contention. Per-stream spans come from CUDA events on each stream (host clocks per
               thread on CPU); t_total = last end - first start. Mode "op" (CUDA, ops with a per-stream
               trace: AgGemm and GemmRs): the op's own call; spans from `op.last_trace_ms()` (for AgGemm the
               compute span is the whole call, waits for chunks included).

k_comm = t_comm_overlap / t_comm_solo, k_comp = t_comp_overlap / t_comp_solo,
E = max(t_comm_solo, t_comp_solo) / t_total, hidden_comm = (t_comp_solo + t_comm_solo - t_total) / t_comm_solo.
`t_op` is the op's own call timed in the same interleaved run (the number to tune on). Pair mode holds the
device with a spin kernel of max(0.5 ms, 3 x the host time to enqueue both sides) before each step, and
reports `start_late_ms`, the later side's start after the hold: above LATE_START_MS the host did not keep
up and that row measures launch latency rather than contention.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.ops.gemm_rs import GemmRs

from .timing import SLEEP_CYCLES_PER_US, bench_interleaved, mark as _mark, mark_ms as _ms

HOLD_CYCLES = 1_000_000      # CUDA: at least ~0.5 ms spin before the step so that the host enqueues both sides
HOLD_OVER_ENQUEUE = 3.0      # ... and 3x the measured host time to enqueue both (an eager AG call takes ~0.5 ms)
MAX_HOLD_CYCLES = 40_000_000  # ~20 ms: a slower host is reported by start_late_ms instead
LATE_START_MS = 0.05         # a side that starts later than this after `go` was not covered by the hold
CPU_SWITCH_INTERVAL_S = 1e-4  # CPU: the GIL hand-over bound while two threads run (default 5 ms)


@dataclass(frozen=True, kw_only=True)
class KFactor:
    """Times in ms (median of max over ranks); k, E and hidden_comm are derived from them."""
    t_comm_solo: float
    t_comp_solo: float
    t_comm_overlap: float
    t_comp_overlap: float
    t_total: float
    k_comm: float
    k_comp: float
    E: float
    hidden_comm: float
    t_op: float | None = None
    mode: str = "pair"
    reps: int = 0
    start_late_ms: float | None = None   # pair mode: median of the later side's start after `go`

    @classmethod
    def from_times(cls, *, t_comm_solo: float, t_comp_solo: float, t_comm_overlap: float,
                   t_comp_overlap: float, t_total: float, **extra) -> "KFactor":
        def ratio(a, b):
            return a / b if b > 0 else float("nan")
        return cls(t_comm_solo=t_comm_solo, t_comp_solo=t_comp_solo, t_comm_overlap=t_comm_overlap,
                   t_comp_overlap=t_comp_overlap, t_total=t_total,
                   k_comm=ratio(t_comm_overlap, t_comm_solo), k_comp=ratio(t_comp_overlap, t_comp_solo),
                   E=ratio(max(t_comm_solo, t_comp_solo), t_total),
                   hidden_comm=ratio(t_comp_solo + t_comm_solo - t_total, t_comm_solo), **extra)

    def as_row(self) -> dict:
        """Flat JSON row: *_ms times, k_comm, k_comp, E, hidden_comm, E_op (vs the op's own call)."""
        row = {f"{name}_ms": getattr(self, name) for name in
               ("t_comm_solo", "t_comp_solo", "t_comm_overlap", "t_comp_overlap", "t_total", "t_op")}
        row.update(k_comm=self.k_comm, k_comp=self.k_comp, E=self.E, hidden_comm=self.hidden_comm,
                   mode=self.mode, reps=self.reps, start_late_ms=self.start_late_ms,
                   E_op=max(self.t_comm_solo, self.t_comp_solo) / self.t_op if self.t_op else None)
        return row


class OpPair(NamedTuple):
    comm: Callable[[], object]   # the op's communication path alone (see module docstring)
    comp: Callable[[], object]   # the op's GEMM alone, same SM budget, local epilogue
    call: Callable[[], object]   # the op itself
    lanes: Callable[[], dict] | None  # sub-stream marks of the last comm call: name -> (start, end)


@contextmanager
def _cpu_switch_interval(device: torch.device):
    # Two Python threads share the GIL: with the default 5 ms hand-over a waiting thread can stall for
    # longer than the whole step; the launcher's CPU mode is only meaningful with a short interval.
    if device.type == "cuda":
        yield
        return
    old = sys.getswitchinterval()
    sys.setswitchinterval(CPU_SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class _PairRunner:
    """Runs comm_fn / comp_fn alone or together with the same launch structure, keeping every step's marks."""

    def __init__(self, comm_fn, comp_fn, device: torch.device, overlap_flag: threading.Event | None):
        self.fns = {"comm": comm_fn, "comp": comp_fn}
        self.cuda = device.type == "cuda"
        self.device = device
        self.flag = overlap_flag
        self.steps: dict[str, list] = {"comm": [], "comp": [], "both": []}
        self.hold_cycles = HOLD_CYCLES
        if self.cuda:
            self.streams = {"comm": torch.cuda.Stream(device, priority=-1), "comp": torch.cuda.Stream(device)}

    def comm_solo(self) -> None:
        self.steps["comm"].append(self._step(("comm",)))

    def comp_solo(self) -> None:
        self.steps["comp"].append(self._step(("comp",)))

    def overlap(self) -> None:
        self.steps["both"].append(self._step(("comm", "comp")))

    def _step(self, sides) -> dict:
        both = len(sides) == 2
        if both and self.flag is not None:
            self.flag.set()
        try:
            return self._step_cuda(sides) if self.cuda else self._step_host(sides, both)
        finally:
            if both and self.flag is not None:
                self.flag.clear()

    def _step_cuda(self, sides) -> dict:
        from torch.profiler import record_function
        current = torch.cuda.current_stream(self.device)
        torch.cuda._sleep(self.hold_cycles)   # both sides start together at `go`, not at their launch times
        marks = {"go": _mark(current)}
        for side in sides:
            stream = self.streams[side]
            stream.wait_stream(current)
            with torch.cuda.stream(stream), record_function(f"kfactor.{side}"):
                start = _mark(stream)
                self.fns[side]()
                marks[side] = (start, _mark(stream))
        for side in sides:
            current.wait_stream(self.streams[side])
        return marks

    def _step_host(self, sides, both: bool) -> dict:
        from torch.profiler import record_function
        marks: dict = {"go": _mark()}
        failure: list[BaseException] = []

        def run(side):
            try:
                with record_function(f"kfactor.{side}"):
                    start = _mark()
                    self.fns[side]()
                    marks[side] = (start, _mark())
            except BaseException as exc:  # re-raised on the calling thread
                failure.append(exc)

        if both:
            thread = threading.Thread(target=run, args=("comm",), name="kfactor-comm", daemon=True)
            thread.start()
            run("comp")
            thread.join()
        else:
            run(sides[0])
        if failure:
            raise failure[0]
        return marks

    @staticmethod
    def spans(marks: dict) -> tuple[float, ...]:
        """(comm, comp, total, late start) ms of one overlapped step; total = last end - first start, late
        start = the later side's start after `go` (near 0 when the hold covered the host enqueue)."""
        (c0, c1), (p0, p1) = marks["comm"], marks["comp"]
        go = marks["go"]
        offsets = [_ms(go, m) for m in (c0, c1, p0, p1)]
        return (_ms(c0, c1), _ms(p0, p1), max(offsets[1], offsets[3]) - min(offsets[0], offsets[2]),
                max(offsets[0], offsets[2]))

    def set_hold_from_enqueue_time(self, group) -> None:
        """CUDA: hold the device long enough for the host to enqueue both sides (max over ranks), or the
        side enqueued second starts late and the step measures launch latency, not contention. Timed on
        the second call (the first may compile kernels), capped at MAX_HOLD_CYCLES."""
        for _ in range(2):
            torch.cuda.synchronize(self.device)
            if group is not None and dist.get_world_size(group) > 1:
                dist.barrier(group=group)   # rank skew is not enqueue time
            start = time.perf_counter()
            for side in ("comm", "comp"):
                with torch.cuda.stream(self.streams[side]):
                    self.fns[side]()
            host_us = (time.perf_counter() - start) * 1e6
        torch.cuda.synchronize(self.device)
        host_us = _reduce_max([[host_us]], group, self.device)[0, 0].item()
        self.hold_cycles = min(MAX_HOLD_CYCLES,
                               max(HOLD_CYCLES, int(HOLD_OVER_ENQUEUE * host_us * SLEEP_CYCLES_PER_US)))


def _reduce_max(table: list[list[float]], group, device) -> torch.Tensor:
    t = torch.tensor(table, dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        on = t.to(device) if device.type == "cuda" else t
        dist.all_reduce(on, op=dist.ReduceOp.MAX, group=group)
        t = on.cpu()
    return t


def measure_pair(comm_fn: Callable[[], object], comp_fn: Callable[[], object], *, device: torch.device,
                 group: dist.ProcessGroup | None, reps: int = 20, warmup: int = 3,
                 op_fn: Callable[[], object] | None = None, overlap_flag: threading.Event | None = None,
                 flush_l2: bool = True) -> KFactor:
    """k-factor of running comm_fn next to comp_fn (mode "pair"; see the module docstring).

    Collective: every rank of `group` calls it with the same reps/warmup. The three variants (comm alone,
    comp alone, both) and `op_fn` (the op's own call, giving t_op) are interleaved by
    `tp_overlap.launch.measure.timing.bench_interleaved` (barrier, L2 flush, rotated order). comm_fn runs on a high-priority
    side stream, comp_fn on another (CUDA), or comm_fn on a thread and comp_fn on the caller (CPU);
    both must leave their work on the current stream they are called on. `overlap_flag` is set while
    an overlapped step runs (the test aid `inject_comm_delay` reads it).
    """
    runner = _PairRunner(comm_fn, comp_fn, device, overlap_flag)
    if runner.cuda:
        runner.set_hold_from_enqueue_time(group)
    variants = {"comm_solo": runner.comm_solo, "comp_solo": runner.comp_solo, "overlap": runner.overlap}
    if op_fn is not None:
        variants["op"] = op_fn
    with _cpu_switch_interval(device):
        stats = bench_interleaved(variants, group=group, device=device, warmup=warmup, reps=reps,
                                  flush_l2=flush_l2)  # synchronises the device before returning
    comm = [_ms(*m["comm"]) for m in runner.steps["comm"][warmup:]]
    comp = [_ms(*m["comp"]) for m in runner.steps["comp"][warmup:]]
    both = [runner.spans(m) for m in runner.steps["both"][warmup:]]
    table = _reduce_max([comm, comp] + [list(col) for col in zip(*both)], group, device)
    med = [statistics.median(row) for row in table.tolist()]
    return KFactor.from_times(t_comm_solo=med[0], t_comp_solo=med[1], t_comm_overlap=med[2],
                              t_comp_overlap=med[3], t_total=med[4], mode="pair", reps=reps,
                              t_op=stats["op"].median_ms if op_fn is not None else None,
                              start_late_ms=med[5])


# ----- adapters for our ops --------------------------------------------------------------------------
def op_pair(op, inputs) -> OpPair:
    """comm / comp / call closures of AgGemm (inputs = a_shard, w) or GemmRs (inputs = a, w).

    Collective for AgGemm (one all_gather builds the gathered input of the GEMM).
    """
    a, w = inputs
    # compute alone: the op's own plan without its comm lanes (the same GEMMs, blocks and SM budget)
    if isinstance(op, AgGemm):
        op.all_gather(a)  # compute_alone reads the rows the gather left in the pool
        return OpPair(lambda: op.all_gather(a), lambda: op.compute_alone(a, w), lambda: op(a, w), None)
    if isinstance(op, GemmRs):
        partials = torch.mm(a, w)
        # the op's own comm path without the GEMM: the decomposed schedule's pushes and reduction (for the
        # scatter methods the GEMM epilogue's stores cannot run without the GEMM: the push stands in for them)
        return OpPair(lambda: op.reduce_scatter(partials), lambda: op.compute_alone(a, w), lambda: op(a, w), None)
    raise TypeError(f"op_pair: unsupported op {type(op).__name__}; pass AgGemm or GemmRs, or use measure_pair")


def k_from_trace(spans: dict[str, float], *, t_comm_solo: float, t_comp_solo: float, **extra) -> "KFactor":
    """The k-factor of an op's own call from its lane spans (`op.last_trace_ms()`): the comm side is its
    longest side lane, the compute side the whole call on the compute stream (waits included)."""
    side = [ms for lane, ms in spans.items() if lane != "compute_ms"]
    return KFactor.from_times(t_comm_solo=t_comm_solo, t_comp_solo=t_comp_solo,
                              t_comm_overlap=max(side) if side else float("nan"),
                              t_comp_overlap=spans["compute_ms"], t_total=spans["compute_ms"], mode="op", **extra)


def trace_op(op, inputs, *, reps: int = 10) -> dict[str, float]:
    """Median (over reps) of the max over ranks of each span of `op.last_trace_ms()` (CUDA, collective)."""
    op.enable_trace(True)
    samples: list[dict] = []
    try:
        for _ in range(reps):
            if op.device.type == "cuda":
                torch.cuda.synchronize(op.device)
            dist.barrier(group=op.group)
            op(*inputs)
            samples.append(op.last_trace_ms())
    finally:
        op.enable_trace(False)
    keys = sorted(samples[0])
    table = _reduce_max([[s[k] for s in samples] for k in keys], op.group, op.device)
    return {k: statistics.median(row) for k, row in zip(keys, table.tolist())}


def measure(op, inputs, *, reps: int = 20, warmup: int = 3, mode: str = "pair",
            overlap_flag: threading.Event | None = None,
            wrap_comm: Callable[[Callable], Callable] | None = None, flush_l2: bool = True) -> KFactor:
    """KFactor of AgGemm / GemmRs on `inputs` (collective over op.group); definitions in the module doc.

    mode "pair": comm path next to the GEMM (contention only), t_op measured alongside; mode "op" (CUDA,
    ops with enable_trace): the spans of the op's own call. `wrap_comm` wraps the comm closure (test aid).
    """
    if mode not in ("pair", "op"):
        raise ValueError(f"mode must be 'pair' or 'op', got {mode!r}")
    pair = op_pair(op, inputs)
    comm = wrap_comm(pair.comm) if wrap_comm else pair.comm
    kf = measure_pair(comm, pair.comp, device=op.device, group=op.group, reps=reps, warmup=warmup,
                      op_fn=pair.call, overlap_flag=overlap_flag, flush_l2=flush_l2)
    op.check_errors()
    if mode == "pair":
        return kf
    spans = trace_op(op, inputs, reps=reps)
    op.check_errors()
    return k_from_trace(spans, t_comm_solo=kf.t_comm_solo, t_comp_solo=kf.t_comp_solo, t_op=kf.t_op, reps=reps)
