"""AllGather + GEMM: `out = all_gather(a_shard) @ w` with the gather on the copy engine, overlapped.

Shapes: a_shard [M/W, K], w [K, N_local], out [M, N_local]; M <= max_m, M % W == 0.

Schedule of one call (step e = 1, 2, ...; buffer b = e % 2 of the pool region `<name>.a` [2, max_m, K]):
  publish stream (high priority): a_shard -> rows of this rank in a[b] (a same-device copy, which the
                  driver may run as a kernel on SMs; skipped when the caller wrote `input_slot`),
                  then flag ready[rank] = e on every peer (a stream memop);
  comm stream (high priority): for peer p = rank+1, rank+2, ... : wait ready[p] >= e (a bounded spin
                  kernel on one SM), copy p's rows of p's a[b] into the same rows of this rank's a[b]
                  (copy engine), in `chunks_per_rank` pieces, each followed by its readiness signal (event
                  or flag); then, after the publish stream, the "every chunk" event;
  consumer on the compute stream: `decomposed` = cuBLAS mms in the order of `consumer_gemms`: with
                  lead_fraction 0 one per chunk, local chunk first, each waiting only for its own event;
                  with lead_fraction f > 0 a "lead" mm over f of the local rows, then one mm (two when
                  the local rows sit in the middle) over every other row once all pulls have landed:
                  fewer, larger GEMMs, which cuBLAS runs faster than one per rank; the GEMMs over
                  this rank's rows only (local chunks, the lead) read a_shard itself and wait for
                  nothing (eager: the leading ones are enqueued right after the first ready-wait
                  kernel, so that few host calls precede the first GEMM; replayed: after the publish
                  copy); the others wait for the "every chunk" event (publish copy included);
                  a call with `lead` work (a row layer's weight-grad GEMM over its own rows) runs that
                  work where the lead GEMM would run, then one mm over all M rows;
                  `fused` = one persistent Triton GEMM whose tile loop waits for the flag of the chunk
                  it reads next (tiles ordered by arrival);
  the comm stream is joined back into the compute stream before the call returns.
Double buffering makes an end-of-step barrier unnecessary: peers read this rank's a[b] only during step
e, and every peer has finished reading a[b] of step e-2 before it signals ready for step e-1, which this
rank waited for during step e-1.

`cuda_graphs=True` makes every call capturable in a CUDA graph and replayable any number of times: the
epoch lives in device memory (bumped at the start of each call, read by the flag kernels), there is one
buffer (a graph's copies have fixed addresses), and instead of the double buffer each reader signals
consumed[reader] = e on the owner after pulling, which the owner waits for (>= e-1) before it overwrites
its rows in the next call. ready[owner] is then a toggle (1 = published, reset to 0 by the reader before
it signals consumed), so that it stays a stream memory operation. The epoch-valued consumed signal and
the owner's consumed waits are kernels: they need an SM, and may wait behind a GEMM that holds them all.
Flags of region `<name>.a`: ready[owner] at [0, W), consumed[reader] at [W, 2W).

On CPU (host pool) the same schedule runs with a thread as the comm stream and torch.mm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from symm_mem import DeviceEpoch, SignalTimeout, SymmetricPool

from ._ag_plan import Chunk, ConsumerGemm, plan_chunks, plan_consumer_gemms
from ._guard import CallGuard
from ._validate import (OpInputError, check_at_most, check_divisible, check_not_capturing, check_tensor,
                        check_weight)
from .config import OpConfig
from .triton_gemm import sm_carveout

__all__ = ["AgGemm", "Chunk", "ConsumerGemm", "ag_gemm"]


def flag_words(world_size: int) -> int:
    """Flag words of one AgGemm region: ready[owner] and consumed[reader]."""
    return 2 * world_size


class AgGemm:
    """Op context built once per (group, pool, max_m, k, n_local, dtype, config); call it many times.

    Outputs are valid on the caller's current stream when the call returns (CUDA), or at once (CPU).
    The gathered `a` returned with `return_gathered=True` is a view into the pool that stays valid until
    the `num_buffers`-th next call of this op (2 calls; 1 with `cuda_graphs=True`); clone it to keep it longer.
    """

    def __init__(self, *, group: dist.ProcessGroup, pool: SymmetricPool, max_m: int, k: int, n_local: int,
                 dtype: torch.dtype, config: OpConfig, name: str = "ag_gemm", cuda_graphs: bool = False):
        if config.op != "ag_gemm":
            raise OpInputError(f"config.op is {config.op!r}; AgGemm needs an ag_gemm config")
        for arg, value in (("max_m", max_m), ("k", k), ("n_local", n_local)):
            if not isinstance(value, int) or value <= 0:
                raise OpInputError(f"{arg} must be a positive int, got {value!r}")
        self.group, self.pool, self.config = group, pool, config
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if (self.rank, self.world_size) != (pool.rank, pool.world_size):
            raise OpInputError("pool was built on another group than group=")
        check_divisible("max_m", max_m, self.world_size, "the group size")
        self.max_m, self.k, self.n_local, self.dtype = max_m, k, n_local, dtype
        self.device = pool.device
        self.name = name
        self.timeout_s = pool.timeout_s
        if cuda_graphs and self.device.type != "cuda":
            raise OpInputError(f"{name}: cuda_graphs=True needs a CUDA pool (this one is on {self.device})")
        self.cuda_graphs = bool(cuda_graphs)
        self.num_buffers = 1 if cuda_graphs else 2
        self.gathered = pool.reserve(f"{name}.a", (self.num_buffers, max_m, k), dtype,
                                     num_signals=flag_words(self.world_size), exclusive=True)
        self._epoch = 0
        self._epoch_counter = None
        if self.device.type == "cuda":
            from .triton_gemm import num_sms
            config.validate(num_sms=num_sms(self.device))
            self._comm_stream = torch.cuda.Stream(self.device, priority=config.comm_stream_priority)
            self._publish_stream = torch.cuda.Stream(self.device, priority=config.comm_stream_priority)
            num_chunks = self.world_size * config.chunks_per_rank
            self._events = [torch.cuda.Event() for _ in range(num_chunks + 1)]  # + 1: all arrived
            self._fork_event = torch.cuda.Event()
            self._published = torch.cuda.Event()  # replayed: the consumer's GEMMs start after the publish
            # 1 = this call's chunk is in place; zeroed at the start of every call (stream-ordered after the
            # previous call's consumer), so the value needs no epoch and a captured graph can replay it
            self._chunk_flags = torch.zeros(num_chunks, dtype=torch.int32, device=self.device)
            if self.cuda_graphs:
                self._epoch_counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._fused = None
        self._trace = None
        self._guard = CallGuard(name, self.device)
        if config.method == "fused" and self.device.type == "cuda":
            from ._ag_gemm_fused import FusedAgConsumer
            self._fused = FusedAgConsumer(self)

    # ----- public --------------------------------------------------------------------------------------
    def input_slot(self, m: int) -> torch.Tensor:
        """[m/W, K] view where the next call expects this rank's shard; writing it there saves a copy.

        Not with `cuda_graphs=True`: the single buffer may only be written after the peers have pulled
        the previous call's rows, which the call itself waits for.
        """
        if self.cuda_graphs:
            raise OpInputError(f"{self.name}: input_slot is not available with cuda_graphs=True")
        self._check_m(m)
        rows = m // self.world_size
        return self.gathered[(self._epoch + 1) % self.num_buffers, self.rank * rows:(self.rank + 1) * rows]

    def __call__(self, a_shard: torch.Tensor, w: torch.Tensor, *, return_gathered: bool = False,
                 lead=None):
        """out [M, N_local] (and the gathered a [M, K] if asked) for a_shard [M/W, K], w [K, N_local].

        w is row-major, or the transpose view `weight.t()` of a row-major [N_local, K] (read in place).
        lead: a callable, run once, that enqueues work on the current stream reading only this rank's
        data (a row layer's backward: the weight-grad GEMM of its own rows). It runs while the peers' rows
        are pulled, in place of the lead GEMM, and the `decomposed` consumer is then one GEMM over all M
        rows once every row is in place (lead_fraction does not apply; `fused` runs it before its GEMM).
        Its results are valid on the current stream on return.
        """
        self._validate(a_shard, w)
        m = a_shard.shape[0] * self.world_size
        with self._guard:
            self._epoch += 1
            a = self.gathered[self._epoch % self.num_buffers, :m]
            out = torch.empty(m, self.n_local, dtype=self.dtype, device=self.device)
            if self.device.type == "cuda":
                self._run_cuda(a_shard, w, a, out, lead)
            else:
                self._run_host(a_shard, w, a, out, lead)
        return (out, a) if return_gathered else out

    def all_gather(self, a_shard: torch.Tensor) -> torch.Tensor:
        """The same schedule with no consumer: returns the gathered a [M, K] (a pool view, see above).
        The "comm solo" of the k-factor and the benchmarks."""
        check_tensor("a_shard", a_shard, dtype=self.dtype, device=self.device, shape=(None, self.k))
        self._check_m(a_shard.shape[0] * self.world_size)
        self._check_capture()
        with self._guard:
            self._epoch += 1
            a = self.gathered[self._epoch % self.num_buffers, :a_shard.shape[0] * self.world_size]
            if self.device.type == "cuda":
                self._run_cuda(a_shard, None, a, None)
            else:
                self._run_host(a_shard, None, a, None)
        return a

    def check_errors(self) -> None:
        """Raise SignalTimeout if a bounded wait of the last calls expired (synchronises the device)."""
        self.pool.check_errors()
        code = self._fused.error_code() if self._fused is not None else 0
        if code:
            self.pool.raise_if_peer_lost(f"{self.name}: chunk flag {code - 1}")
            self.pool.abort(1)  # tell every peer, so that no rank waits for a step that will not come
            per = self.config.chunks_per_rank
            raise SignalTimeout(region=f"{self.name} chunk flags", index=code - 1, epoch=self._epoch,
                                observed=-1, timeout_s=self.timeout_s, peer=(code - 1) // per, op=self.name)

    def enable_trace(self, on: bool = True) -> None:
        """Mark each call's start, its comm side's start and end, and its end (for k-factors; see
        `last_trace_ms`): CUDA events on the compute and comm streams, or host clock readings (CPU) on the
        caller's thread and the comm thread."""
        if not on:
            self._trace = None
        elif self.device.type == "cuda":
            self._trace = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        else:
            self._trace = [0.0] * 4

    def last_trace_ms(self) -> dict[str, float]:
        """Spans of the last traced call, ms: `compute_ms` the whole call on the compute stream (CPU: the
        caller's thread, waits for rows included), `comm_ms` the comm stream's (thread's) part (synchronises)."""
        start, comm_start, comm_end, end = self._trace
        if self.device.type != "cuda":
            return {"compute_ms": (end - start) * 1e3, "comm_ms": (comm_end - comm_start) * 1e3}
        end.synchronize()
        return {"compute_ms": start.elapsed_time(end), "comm_ms": comm_start.elapsed_time(comm_end)}

    @property
    def epoch(self) -> int:
        """Calls issued so far (the epoch the last call wrote into its flags)."""
        return self._epoch

    def close(self) -> None:
        """Drop references to pool memory (the pool itself is owned by the caller)."""
        self.gathered = None
        self._fused = None

    # ----- validation ------------------------------------------------------------------------------------
    def _check_m(self, m: int) -> None:
        check_divisible("M", m, self.world_size, "the group size")
        check_at_most("M", m, self.max_m, "max_m of this op")

    def _check_capture(self) -> None:
        check_not_capturing(self.name, self.device, self.cuda_graphs)

    def _validate(self, a_shard, w) -> None:
        if self.gathered is None or self.pool.closed:
            raise OpInputError(f"{self.name} is closed (or its pool is)")
        self._check_capture()
        check_tensor("a_shard", a_shard, dtype=self.dtype, device=self.device, shape=(None, self.k))
        check_weight("w", w, dtype=self.dtype, device=self.device, shape=(self.k, self.n_local))
        check_at_most("a_shard rows x group size", a_shard.shape[0] * self.world_size, self.max_m,
                      "max_m of this op")

    # ----- schedule --------------------------------------------------------------------------------------
    def chunks(self, m: int) -> list[Chunk]:
        """Chunks in arrival order: the local rank's first, then ring order rank+1, rank+2, ..."""
        return plan_chunks(rank=self.rank, world_size=self.world_size, m=m,
                           chunks_per_rank=self.config.chunks_per_rank)

    def consumer_gemms(self, m: int, *, whole: bool = False) -> list[ConsumerGemm]:
        """The decomposed consumer's GEMMs in issue order (`plan_consumer_gemms`); whole=True: a call with
        `lead` work, one GEMM over every row once every chunk has arrived."""
        return plan_consumer_gemms(rank=self.rank, world_size=self.world_size, m=m,
                                   chunks_per_rank=self.config.chunks_per_rank,
                                   lead_fraction=self.config.lead_fraction, whole=whole)

    def _step_epoch(self, offset: int = 0):
        """This call's epoch (+ offset) as the flag operations take it: host int, or device counter."""
        if self.cuda_graphs:
            return DeviceEpoch(self._epoch_counter, offset)
        return self._epoch + offset

    def _consume(self, plan, a_shard, a, w, out, wait) -> None:
        """The decomposed consumer: `wait(i)` blocks (host) or orders (stream) on chunk i's arrival."""
        local_lo = self.rank * a_shard.shape[0]
        for lo, count, chunk in plan:
            if chunk < 0:  # this rank's rows: read a_shard, which the publish copy may still be reading
                src = a_shard[lo - local_lo:lo - local_lo + count]
            else:
                wait(chunk)
                src = a[lo:lo + count]
            torch.mm(src, w, out=out[lo:lo + count])

    def _peers(self) -> list[int]:
        return [p for p in range(self.world_size) if p != self.rank]

    def _publish(self, a_shard, a) -> None:
        rows = a_shard.shape[0]
        if self.cuda_graphs:  # one buffer: every peer must have pulled our previous rows
            for peer in self._peers():
                self.pool.wait(f"{self.name}.a", self.world_size + peer, self._step_epoch(-1), peer=peer,
                               op=self.name)
        slot = a[self.rank * rows:(self.rank + 1) * rows]
        if slot.data_ptr() != a_shard.data_ptr():
            slot.copy_(a_shard)
        for peer in self._peers():
            self.pool.signal(f"{self.name}.a", self.rank, self._ready_value(), rank=peer)

    def _ready_value(self) -> int:
        """What ready[owner] holds once owner's rows of this call are published.

        Eager: the epoch. Replayed: 1, which the reader resets to 0 after its pull and before it signals
        consumed (which the owner waits for before it publishes again): a constant is written by a stream
        memory operation, so the signal needs no SM while the consumer's first GEMM holds them all.
        """
        return 1 if self.cuda_graphs else self._epoch

    def _signal_arrived(self, stream, chunks, indices) -> None:
        """Chunks `indices` are in place, in `stream` order: a chunk flag (fused) or an event each."""
        for i in indices:
            if self._fused is not None:
                self._fused.signal_chunk(chunks[i].flag_index)
            else:
                self._events[i].record(stream)

    def _pull(self, chunk: Chunk, a, *, host: bool) -> None:
        owner, lo, count, _ = chunk
        src = self.pool.peer(f"{self.name}.a", owner)[self._epoch % self.num_buffers, lo:lo + count]
        a[lo:lo + count].copy_(src, non_blocking=not host)

    def _run_host(self, a_shard, w, a, out, lead=None) -> None:
        from ._ag_gemm_host import run_host
        run_host(self, a_shard, w, a, out, lead)

    def _run_cuda(self, a_shard, w, a, out, lead=None) -> None:
        compute = torch.cuda.current_stream(self.device)
        trace = self._trace
        if trace:
            trace[0].record(compute)
        if self.cuda_graphs:
            self._epoch_counter.add_(1)
        if self._fused is not None:  # only the fused consumer reads chunk flags
            self._chunk_flags.zero_()
        chunks = self.chunks(a.shape[0])
        comm, publish = self._comm_stream, self._publish_stream
        forked = self._fork_event
        forked.record(compute)
        publish.wait_event(forked)
        with torch.cuda.stream(publish):
            # its own stream, so that the comm stream's ready-wait kernel is launched at once, before the
            # consumer's first GEMM can take every SM; that GEMM reads a_shard, not the copy. Enqueued
            # before that wait kernel: with the order reversed (f219883, reverted) the ready memop did not
            # land until the waits had timed out -- apparently a fenced memop waits for device work
            # submitted before it, here a spin that only it could end (results/NOTES.md)
            self._publish(a_shard, a)
            if self._fused is not None:  # the decomposed consumer reads local rows from a_shard
                self._signal_arrived(publish, chunks, [i for i, c in enumerate(chunks) if c.owner == self.rank])
            if self.cuda_graphs:
                self._published.record(publish)
        comm.wait_event(forked)
        plan = self.consumer_gemms(a.shape[0], whole=lead is not None) \
            if w is not None and self._fused is None else []
        # Early work reads this rank's rows only: the caller's `lead`, else the leading local GEMMs. Eager:
        # enqueued right after the first ready-wait kernel, so that fewer host calls precede it (and after
        # the publish copy, which the host enqueued first). Replayed, the host order costs nothing, and it
        # waits for the publish event instead (below)
        local_first = 0
        while lead is None and local_first < len(plan) and plan[local_first].wait < 0:
            local_first += 1
        early_gemms, plan = plan[:local_first], plan[local_first:]
        early_pending = self._fused is None and (lead is not None or bool(early_gemms))  # fused: below

        def consume(gemms) -> None:
            with sm_carveout(self.config.sm_margin):  # the cuBLAS consumer honours sm_margin too
                self._consume(gemms, a_shard, a, w, out, lambda i: compute.wait_event(self._events[i]))

        def early() -> None:
            if lead is not None:
                with sm_carveout(self.config.sm_margin):
                    lead()
            consume(early_gemms)

        with torch.cuda.stream(comm):
            if trace:
                trace[1].record(comm)
            waited = set()
            for i, chunk in enumerate(chunks):
                owner = chunk[0]
                if owner == self.rank:
                    continue
                if owner not in waited:
                    self.pool.wait(f"{self.name}.a", owner, self._ready_value(), peer=owner, op=self.name)
                    waited.add(owner)
                    if early_pending and not self.cuda_graphs:  # the wait kernel already holds its SM
                        with torch.cuda.stream(compute):
                            early()
                        early_pending = False
                self._pull(chunk, a, host=False)
                self._signal_arrived(comm, chunks, [i])
            comm.wait_stream(publish)
            self._events[len(chunks)].record(comm)  # every chunk, local ones included, is in place
            if self.cuda_graphs:  # reset the ready flags, then tell each owner its rows have been read
                from kernels.flags import write_flag
                for owner in self._peers():
                    write_flag(self.pool.signals(f"{self.name}.a"), owner, 0)
                for owner in self._peers():
                    self.pool.signal(f"{self.name}.a", self.world_size + self.rank, self._step_epoch(),
                                     rank=owner)
            if trace:
                trace[2].record(comm)
        if self._fused is not None and w is not None:
            if lead is not None:
                with sm_carveout(self.config.sm_margin):
                    lead()
            self._fused.run(a, w, out)
        elif plan or early_pending:
            if self.cuda_graphs:
                # The publish copy runs on SMs (a same-device copy). Replayed, nothing orders it against
                # the first GEMM, and when the GEMM wins it holds every SM and the copy -- with the ready
                # flag the peer waits for behind it -- lands after the whole lead GEMM: 300-500 us ready
                # waits and 70-230 us stalls in profiled replays (results/NOTES.md, fifth session)
                compute.wait_event(self._published)
            if early_pending:
                early()
            consume(plan)
        compute.wait_stream(comm)
        if trace:
            trace[3].record(compute)


def ag_gemm(a_shard: torch.Tensor, w: torch.Tensor, *, op: AgGemm, return_gathered: bool = False):
    """Functional form: `op(a_shard, w)` (the op context holds the pool region, streams and events)."""
    return op(a_shard, w, return_gathered=return_gathered)
