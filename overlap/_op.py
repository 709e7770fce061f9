"""What every op context shares: construction checks, the per-call entry, programs cached per M, close.

An op is collective: every rank builds it with the same arguments (checked once, `SymmetricPool.agree`) and
calls it the same number of times with the same M (checked per call, `protocol.check_call`, before anything
is enqueued), so a disagreement raises OpInputError on every rank instead of returning wrong rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from symm_mem import ArgumentMismatch, PoolClosedError

from . import envs, protocol
from ._guard import CallGuard
from ._validate import OpInputError, check_at_most, check_divisible, check_same_group
from .schedule import CudaDriver, HostDriver

__all__ = ["OpBase"]


class OpBase:
    """Subclasses define `kind`, build `self.flags` (an AgFlags / RsFlags) and `_build(key) -> Program`."""

    kind = "op"

    def __init__(self, *, group: dist.ProcessGroup, pool, name: str, config, max_m: int, static: dict):
        if group is None:
            raise OpInputError(f"{name}: group= is required (pass the TP process group explicitly)")
        if pool is None or pool.closed:
            raise OpInputError(f"{name}: pool= must be an open SymmetricPool on group=")
        if getattr(config, "op", None) != self.kind:
            raise OpInputError(f"{name}: config is a {type(config).__name__}; {type(self).__name__} needs a "
                               f"{self.kind} config")
        self.group, self.pool, self.config, self.name = group, pool, config, name
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        check_same_group(name, group, pool)
        for arg, value in static.items():
            if arg in ("max_m", "k", "n", "n_local", "k_local") and (isinstance(value, bool)
                                                                     or not isinstance(value, int) or value <= 0):
                raise OpInputError(f"{name}: {arg} must be a positive int, got {value!r}")
        check_divisible(f"{name}: max_m", max_m, self.world_size, "the group size")
        self.max_m, self.device = max_m, pool.device
        self.timeout_s = pool.timeout_s
        self._static = {"op": self.kind, "name": name, "world_size": self.world_size, **static,
                        "config": repr(config)}
        self._calls = 0
        self._drivers: dict = {}
        self._closed = False
        self._guard = CallGuard(name, self.device)
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._trace = False
        self._last_key = None
        self._side_graphs: dict = {}

    def _agree(self) -> None:
        """After the region is reserved and its flags initialised: every rank built the same op."""
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
        check_divisible(f"{self.name}: M", m, self.world_size, "the group size")
        check_at_most(f"{self.name}: M", m, self.max_m, "max_m of this op")
        if m <= 0:
            raise OpInputError(f"{self.name}: M must be > 0, got {m}")

    def _begin(self, m: int) -> None:
        """Entry of every call: live, no failure recorded, every rank at this call with this M."""
        self._check_live()
        self.pool.raise_if_failed()
        self._calls += 1
        protocol.check_call(self.pool, self.flags, self._calls, m, op=self.name)

    def _driver(self, key):
        driver = self._drivers.get(key)
        if driver is None:
            program = self._build(key)
            driver = CudaDriver(program, self._side_streams(program.lanes)) if self.device.type == "cuda" \
                else HostDriver(program)
            driver.enable_trace(self._trace)
            self._drivers[key] = driver
        self._last_key = key
        return driver

    def _replayed(self, key, driver, ctx) -> bool:
        """CUDA eager calls: run the prologue and side lanes as a recorded graph where that is safe."""
        if self.device.type != "cuda" or self._trace or not envs.eager_graphs() \
                or torch.cuda.is_current_stream_capturing():
            return False
        side = self._side_graphs.get(key)
        if side is None:
            from ._side_graph import SideGraphs, graphable
            side = self._side_graphs[key] = SideGraphs(driver.program, self._streams,
                                                      priority=self.config.comm_stream_priority) \
                if graphable(driver.program) else False
        if not side:
            return False
        graph_key = self._graph_key(ctx)
        return graph_key is not None and side.run(ctx, graph_key)

    def _graph_key(self, ctx):
        """Data pointers of the call tensors that the prologue and side lanes read (None: never replay)."""
        return None

    def _side_streams(self, lanes) -> dict:
        for lane in lanes:
            if lane not in self._streams:
                self._streams[lane] = torch.cuda.Stream(self.device, priority=self.config.comm_stream_priority)
        return self._streams

    def _execute(self, key, ctx, *, m: int | None = None) -> None:
        """Run the program of `key` for one call; with `m`, first the call's entry checks (`_begin`). The guard
        refuses a second thread before anything is posted or enqueued."""
        self.pool.begin_call()
        try:
            with self._guard:
                if m is not None:
                    self._begin(m)
                driver = self._driver(key)
                if not self._replayed(key, driver, ctx):
                    driver.run(ctx)
        finally:
            self.pool.end_call()
        if self.device.type == "cpu":  # a peer that gave up during this call: raise on this call
            self.pool.raise_if_failed()

    # ----- tracing (k-factors) --------------------------------------------------------------------------
    def enable_trace(self, on: bool = True) -> None:
        """Time each later call's lanes: CUDA events on the compute and side streams, or host clocks on the
        CPU threads (see `last_trace_ms`)."""
        self._trace = on
        for driver in self._drivers.values():
            driver.enable_trace(on)

    def last_trace_ms(self) -> dict[str, float]:
        """Spans of the last traced call, ms (synchronises): `compute_ms` the whole call on the compute stream
        (waits included), `<lane>_ms` each side lane (`comm_ms` the pulls or pushes, `reduce_ms`)."""
        driver = self._drivers.get(self._last_key)
        if driver is None or driver.trace is None:
            raise OpInputError(f"{self.name}: no traced call yet (enable_trace() first)")
        return {f"{lane}_ms": ms for lane, ms in driver.trace_ms().items()}

    # ----- lifecycle ------------------------------------------------------------------------------------
    @property
    def calls(self) -> int:
        """Calls issued so far."""
        return self._calls

    def check_errors(self) -> None:
        """Synchronise and raise if any wait of this rank expired or any rank gave up (all ops of the pool)."""
        self._check_live()
        self.pool.check_errors()

    def close(self) -> None:
        """Drop this op's programs and pool views (the pool is the caller's). Refused while a call is in flight."""
        if self._closed:
            return
        if self._guard.busy():
            raise OpInputError(f"{self.name}.close() while a call is in flight on another thread")
        self._closed = True
        self._drivers.clear()
        self._side_graphs.clear()
        self._release()

    def _release(self) -> None:
        pass
