"""What every op context shares: construction checks, plans built once per (M, variant), the call path, close.

An op is collective: every rank builds it with the same arguments (checked once, `SymmetricPool.agree`) and
calls it the same number of times with the same M. The M of a call is carried by the flags that say "this
call's data is there" (overlap/ops/protocol.py): ranks that disagree meet a flag at another nonzero value and
every rank raises `OpInputError` naming both Ms, at the call (CPU) or at the next call / `check_errors()`
(CUDA: the watchdog sees it within milliseconds). No rank waits for another's host on the way in.

A call is a plan. Everything that does not depend on the call's tensors is decided when (M, variant) is
first seen: the config of that M (`by_m`), the program of stream operations, the GEMM blocks. A call checks
its tensors, allocates its output and, on CUDA, enqueues the plan:

* as one replay of a CUDA graph recorded from the very same plan, keyed by the addresses of the call's
  tensors (inputs, weight, the freshly allocated output): a training loop hands the same addresses back
  step after step, so from the second call with a key on, the whole call costs one `replay()`;
* else (a key seen once, a capture by the caller, tracing, OVERLAP_EAGER_GRAPHS=0) by enqueueing its stream
  operations directly.

Either way the stream operations, and so the protocol, are the same.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
import torch.distributed as dist

from tp_overlap.symm_mem.errors import ArgumentMismatch, DeviceCheckError, PeerMismatchError, PoolClosedError

from ..config import envs
from ..gemm import gpu_name, num_sms
from ..gemm.gluon_launch import split_buffers
from .validate import OpInputError, check_at_most, check_divisible, check_same_group, check_tensor, check_weight
from ..config.schema import OpPreset
from .program import CudaDriver, HostDriver

__all__ = ["OpBase", "Plan", "MAX_GRAPHS"]

MAX_GRAPHS = 8        # recorded graphs kept per op (the oldest dropped first)
MAX_SEEN_KEYS = 1024  # graph keys remembered from a single call (bounded: addresses that never repeat)


# the hot path's CUDA calls, bound once (one C call each instead of their Python wrappers)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_replay = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None)


class Plan:
    """One (M, variant) of an op: its config, program and driver, built once."""
    __slots__ = ("key", "config", "program", "driver")

    def __init__(self, key, config, program, driver):
        self.key, self.config, self.program, self.driver = key, config, program, driver


class OpBase:
    """Subclasses define `kind`, build `self.flags` (an AgFlags / RsFlags) and `_build(key, config)`."""

    kind = "op"
    _alone_split_buffers = None  # compute_alone's split-tail buffers (`_alone_buffers`), made at first use

    def __init__(self, *, group: dist.ProcessGroup, pool, name: str, config, max_m: int, static: dict):
        if group is None:
            raise OpInputError(f"{name}: group= is required (pass the TP process group explicitly)")
        if pool is None or pool.closed:
            raise OpInputError(f"{name}: pool= must be an open SymmetricPool on group=")
        self.preset = config if isinstance(config, OpPreset) else OpPreset(default=config)
        for cfg in [self.preset.default] + [cfg for _, cfg in self.preset.by_m]:
            if getattr(cfg, "op", None) != self.kind:
                raise OpInputError(f"{name}: config is a {type(cfg).__name__}; {type(self).__name__} needs a "
                                   f"{self.kind} config")
        self.group, self.pool, self.name = group, pool, name
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        check_same_group(name, group, pool)
        for arg, value in static.items():
            if arg in ("k_local", "n_local") and value is None:   # any width per call
                continue
            if arg in ("max_m", "k", "n", "n_local", "k_local") and (isinstance(value, bool)
                                                                     or not isinstance(value, int) or value <= 0):
                raise OpInputError(f"{name}: {arg} must be a positive int, got {value!r}")
        check_divisible(f"{name}: max_m", max_m, self.world_size, "the group size")
        self.max_m, self.device = max_m, pool.device
        self.config = self.preset.for_m(max_m)  # the config of the largest call (what `op.config` reports)
        self._region_names: list[str] = []
        self.timeout_s = pool.timeout_s
        self._cuda = self.device.type == "cuda"
        self._static = {"op": self.kind, "name": name, "world_size": self.world_size, **static,
                        "config": repr(config)}
        self._calls = 0
        self._plans: dict = {}
        self._closed = False
        self._lock = threading.Lock()
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._trace = False
        self._last_key = None
        self._graphs: OrderedDict = OrderedDict()
        self._seen: set = set()
        self._use_graphs = self._cuda and envs.eager_graphs()
        self._capture_stream = None
        self._device_index = self.device.index if self._cuda else None
        self.gpu = gpu_name(self.device)   # the block tables' name of this GPU (None off CUDA)
        self._last_stream = None   # raw handle of the stream of the last eager call (CUDA)

    def configs(self) -> list:
        """The configs a call of this op can reach (M a multiple of W, at most max_m; `OpPreset.reachable`):
        construction checks and sizes for these only."""
        return self.preset.reachable(self.max_m, self.world_size)

    def config_for(self, m: int):
        """The config a call with M = m runs (the first `by_m` bucket with m_max >= m, else the default)."""
        return self.preset.for_m(m)

    def _reserve(self, spec):
        """Reserve one of this op's regions (`RegionSpec`), exclusively: released again by close()."""
        view = self.pool.reserve(*spec[:3], num_signals=spec.num_signals, num_device_flags=spec.num_device_flags,
                                 exclusive=True)
        self._region_names.append(spec[0])
        return view

    def _agree(self) -> None:
        """Before any reservation: every rank built the same op on the same pool layout so far."""
        try:
            self.pool.agree(self.name, self._static)
        except ArgumentMismatch as exc:
            raise OpInputError(str(exc)) from None

    # ----- per call -------------------------------------------------------------------------------------
    def _check_live(self) -> None:
        if self._closed:
            raise OpInputError(f"{self.name} is closed ({type(self).__name__}.close() was called)")
        if self.pool.closed:
            raise PoolClosedError(f"{self.name}: its SymmetricPool is closed (pool.close() was called); the op "
                                  f"cannot be used after its pool")

    def _check_m(self, m: int) -> None:
        if m <= 0:
            raise OpInputError(f"{self.name}: M must be > 0, got {m}")
        check_divisible(f"{self.name}: M", m, self.world_size, "the group size")
        check_at_most(f"{self.name}: M", m, self.max_m, "max_m of this op")

    def _check_operands(self, name: str, a, cols: int | None, w, k: int | None, n: int | None) -> None:
        """A call's activation `name` [rows, cols] (row-major) and weight w [k, n] (row-major or a transposed
        row-major view); None: any width (an op built with n_local / k_local None), k None: a's width. A few
        attribute reads when they are right, the full named check when not."""
        if not (isinstance(a, torch.Tensor) and a.dtype == self.dtype and a.device == self.device and a.dim() == 2
                and (cols is None or a.shape[1] == cols) and a.is_contiguous()):
            self._check_live()
            check_tensor(name, a, dtype=self.dtype, device=self.device, shape=(None, cols))
        k = a.shape[1] if k is None else k
        if not (isinstance(w, torch.Tensor) and w.dtype == self.dtype and w.device == self.device and w.dim() == 2
                and w.shape[0] == k and (n is None or w.shape[1] == n) and (w.stride(1) == 1 or w.stride(0) == 1)):
            check_weight("w", w, dtype=self.dtype, device=self.device, shape=(k, n))

    def _raise_if_failed(self) -> None:
        try:
            self.pool.raise_if_failed()
        except (PeerMismatchError, DeviceCheckError) as exc:  # the caller's arguments, not the runtime
            raise OpInputError(str(exc)) from None

    def _plan(self, key, m: int) -> Plan:
        plan = self._plans.get(key)
        if plan is None:
            self._check_live()
            self._check_m(m)
            config = self.config_for(m)
            program = self._build(key, config)
            if self._cuda:
                for lane in program.lanes:
                    if lane not in self._streams:
                        self._streams[lane] = torch.cuda.Stream(self.device, priority=config.comm_stream_priority)
                driver = CudaDriver(program, self._streams)
            else:
                driver = HostDriver(program)
            driver.enable_trace(self._trace)
            plan = self._plans[key] = Plan(key, config, program, driver)
        return plan

    def _launch(self, plan: Plan, call, addresses: tuple | None) -> None:
        """Enqueue one call of `plan` (the call path of every op). `addresses`: the data pointers (and any
        layout the plan does not fix) of every call tensor the plan reads or writes; None: never replay."""
        if self._closed or self.pool.closed:
            self._check_live()
        if not self._lock.acquire(False):
            raise OpInputError(f"{self.name} is already running on another thread; op calls are collective "
                               f"and must be issued in one order on every rank (use one thread per op)")
        try:
            self.pool.begin_call()  # raises a failure recorded by an earlier call (this rank's or a peer's)
            try:
                if self._cuda:
                    self._enqueue(plan, call, addresses)
                else:
                    plan.driver.run(call)
                self._calls += 1
                self._last_key = plan.key
            finally:
                self.pool.end_call()
        except (PeerMismatchError, DeviceCheckError) as exc:  # the caller's arguments, not the runtime
            raise OpInputError(str(exc)) from None
        finally:
            self._lock.release()
        if not self._cuda:  # a peer that gave up during this call: raise on this call
            self._raise_if_failed()

    def _alone_buffers(self):
        """compute_alone's split-tail buffers (gluon_launch.split_buffers), made at its first plan: apart from
        the calls' (it may run beside one), and only for those who measure it."""
        if self._alone_split_buffers is None:
            self._alone_split_buffers = split_buffers(self.device, num_sms(self.device))
        return self._alone_split_buffers

    def _run_alone(self, key, m: int, call) -> None:
        """Run the plan of `key` at once on the current stream (CPU: this thread), outside the op's call
        sequence: for plans of compute steps only (`compute_alone`), which touch no flag and nothing a call
        reads, so they take no call lock, follow no earlier call's stream and run beside a call of this op on
        another thread or stream (the k-factor's pair mode)."""
        self._check_live()
        plan = self._plans.get(key) or self._plan(key, m)
        if self._cuda:
            plan.driver.run(call, torch.cuda.current_stream())
        else:
            plan.driver.run(call)

    def _enqueue(self, plan: Plan, call, addresses) -> None:
        if _capturing():
            # a capture waits for no event recorded outside it (torch.cuda.graph synchronises first; a
            # capture on another stream than the last eager call must follow a synchronize), and nothing
            # recorded inside it is waited for outside it
            plan.driver.run(call, torch.cuda.current_stream())
            self._last_stream = None
            return
        stream = _raw_stream(self._device_index)
        if stream != self._last_stream and self._last_stream is not None:
            self._follow(self._last_stream)  # the previous call's buffers are reused by this one
        self._last_stream = stream
        if addresses is None or self._trace or not self._use_graphs:
            plan.driver.run(call, torch.cuda.current_stream())
            return
        key = (plan.key,) + addresses
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._first_calls(plan, call, key)
            if graph is None:
                return
        _replay(graph)

    def _follow(self, previous: int) -> None:
        """Make the current stream wait for everything enqueued so far on the stream of raw handle `previous`
        (the last call's): an event recorded there now is at least as late as that call's end."""
        event = torch.cuda.Event()
        event.record(torch.cuda.ExternalStream(previous, device=self.device))
        torch.cuda.current_stream().wait_event(event)

    def _first_calls(self, plan: Plan, call, key):
        """A key seen once runs step by step; the second time its graph is recorded (returned, to replay)."""
        if key not in self._seen:  # record only what repeats
            if len(self._seen) >= MAX_SEEN_KEYS:
                self._seen.clear()
            self._seen.add(key)
            plan.driver.run(call, torch.cuda.current_stream())
            return None
        try:
            graph = self._record(plan, call, torch.cuda.current_stream())
        except Exception:  # nothing recorded ran: the call runs step by step, which completes its protocol
            graph = None   # or aborts the pool if the step fails again (a capture may fail on its own)
        if graph is None:
            plan.driver.run(call, torch.cuda.current_stream())
            return None
        self._graphs[key] = graph
        if len(self._graphs) > MAX_GRAPHS:  # the oldest recorded first
            self._graphs.popitem(last=False)
        return graph

    def _record(self, plan: Plan, call, stream):
        """A CUDA graph of one call of `plan` on these tensors (not executed: the caller replays it)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode
        if _get_current_dispatch_mode() is not None:  # e.g. torch.compile's CUDA-graph trees warming up
            return None
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        side, graph = self._capture_stream, torch.cuda.CUDAGraph()
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                plan.driver.run(call, side, abort=False)
            finally:
                graph.capture_end()
        stream.wait_stream(side)
        return graph

    def set_eager_graphs(self, on: bool) -> None:
        """Replay this op's eager CUDA calls as recorded graphs (the default, unless OVERLAP_EAGER_GRAPHS=0)
        or enqueue every call step by step (graphs already recorded are dropped)."""
        self._use_graphs = self._cuda and bool(on)
        if not on:
            self._graphs.clear()
            self._seen.clear()

    # ----- tracing (k-factors) --------------------------------------------------------------------------
    def enable_trace(self, on: bool = True) -> None:
        """Time each later call's lanes: CUDA events on the compute and side streams, or host clocks on the
        CPU threads (see `last_trace_ms`). Traced calls are enqueued step by step (never replayed)."""
        self._trace = on
        for plan in self._plans.values():
            plan.driver.enable_trace(on)

    def last_trace_ms(self) -> dict[str, float]:
        """Spans of the last traced call, ms (synchronises): `compute_ms` the whole call on the compute stream
        (waits included), `<lane>_ms` each side lane (`comm_ms` the pulls or pushes, `reduce_ms`)."""
        plan = self._plans.get(self._last_key)
        if plan is None or plan.driver.trace is None:
            raise OpInputError(f"{self.name}: no traced call yet (enable_trace() first)")
        return {f"{lane}_ms": ms for lane, ms in plan.driver.trace_ms().items()}

    # ----- lifecycle ------------------------------------------------------------------------------------
    @property
    def calls(self) -> int:
        """Calls issued so far (eager calls and captures; replays of a caller's graph are not seen)."""
        return self._calls

    @property
    def num_graphs(self) -> int:
        """CUDA graphs this op holds for its eager calls (at most MAX_GRAPHS)."""
        return len(self._graphs)

    def check_errors(self) -> None:
        """Synchronise and raise if any wait of this rank expired, the ranks disagreed on a call's M, or any
        rank gave up (all ops of the pool)."""
        self._check_live()
        try:
            self.pool.check_errors()
        except (PeerMismatchError, DeviceCheckError) as exc:
            raise OpInputError(str(exc)) from None

    def close(self) -> None:
        """Drop this op's plans, graphs and pool views, and release its pool regions: an op built afterwards
        with the same name and arguments (on every rank) takes the same regions back; the pool's memory is not
        freed (an arena does not shrink) and the pool is the caller's. Refused while a call is in flight."""
        if self._closed:
            return
        if self._lock.locked():
            raise OpInputError(f"{self.name}.close() while a call is in flight on another thread")
        self._closed = True
        self._plans.clear()
        self._graphs.clear()
        self._seen.clear()
        self._release()
        for region in self._region_names:  # an op built later with this name and these arguments takes them
            self.pool.release(region)

    def _release(self) -> None:
        pass
