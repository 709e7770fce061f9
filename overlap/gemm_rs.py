"""GEMM + ReduceScatter: `out_shard = reduce_scatter(a @ w)`, the reduction on `sm_margin` SMs.

Shapes: a [M, K_local], w [K_local, N], out_shard [M/W, N]; M <= max_m, M % W == 0.

Pool region `<name>.partials` holds, per rank and per buffer b = epoch % 2, W source slots of
[M/W, N]: slot s of rank o receives source s's partial product for o's rows. Flags `<name>.partials`
(int32, [W, flags_per_source], epoch-valued) say which GEMM row blocks of which source have landed.

  fused:      one persistent Triton GEMM on num_sms - sm_margin programs, tiles rotated by rank; each
              tile is stored straight into its owner's slot (NVLink stores) and counted one tile later
              (after the program's next main loop); the row block's flag is released by its last count. A reduction kernel on `num_comm_sms`
              programs (its own high-priority stream) waits for each row block's W flags and sums.
  decomposed: one cuBLAS mm per owner chunk (owners in ring order, own chunk last) limited to
              num_sms - sm_margin SMs, each chunk pushed to its owner with the copy engine and flagged;
              the same reduction kernel (W = 2 with num_comm_sms = 0: after the GEMMs, one add of our
              rows and the peer's on the compute stream).
  epilogue_reduce: one persistent Triton GEMM on num_sms - sm_margin programs that scatters the other
              owners' rows first (as `fused`) and then computes its own rows last, adding the other
              sources' partials to its accumulator in the epilogue: no reduction kernel, no second pass
              over the partials, no reserved SMs. Needs M/W % 128 == 0; other M run as `fused`.
`bulk(a, w, work)` is the schedule a column layer's backward uses with `bulk_wgrad`: the whole GEMM on
cuBLAS, the copy-engine push of `decomposed`, the caller's independent `work` (the weight-grad GEMM), then
the reduction kernel on every SM (W = 2: one add of our rows and the peer's slot, after a bounded wait for
its flag). Same slots, flags and epochs.
Double buffering replaces an end barrier: a source writes slot b of step e only after its own step e-1
reduction finished, which waited for the owner's step e-1 partials, which the owner produced after its
step e-2 reduction (the last reader of slot b) had finished (for epilogue_reduce the reduction is the
end of the source's own step-(e-1) GEMM).

`cuda_graphs=True` makes every call capturable in a CUDA graph and replayable any number of times: the
epoch lives in device memory (bumped at the start of each call; the GEMM's flag stores, the reduction's
waits and the flag kernels read it), there is one buffer (a graph's pointers are fixed), and instead of the
double buffer each owner signals reduced[owner] = e on every source when its reduction is done; a source
waits for reduced >= e-1 of every peer before its GEMM writes into their slots again. Those W words follow
the partials flags: index W * flags_per_source + owner. The W = 2 copy-engine schedules (`bulk`, the
`decomposed` pair) flag a pushed slot in W more words after those, index W * flags_per_source + W + source,
written by a stream memory operation (no SM: the push ends while a GEMM holds them all): the epoch, or
replayed the toggle 1 that the owner resets to 0 after its wait (as AllGather's ready flag).

On CPU (host pool) the same protocol runs with torch.mm, stores into peers' shared memory and host waits.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from symm_mem import DeviceEpoch, SignalTimeout, SymmetricPool

from ._gemm_rs_ce import CopyEngineSchedules
from ._guard import CallGuard
from ._validate import (OpInputError, check_at_most, check_divisible, check_not_capturing, check_tensor,
                        check_weight)
from .config import OpConfig
from .triton_gemm import sm_carveout

__all__ = ["GemmRs", "gemm_rs"]

FLAG_BLOCK_M = 128  # row-block granularity of the flags (the fused GEMM's BLOCK_M)


def flag_words(max_m: int, world_size: int) -> int:
    """Flag words of one GemmRs region: row-block flags per source, `reduced` per owner, and the W = 2
    schedules' pushed-slot flag per source (layout in the module docstring)."""
    return world_size * (_cdiv(max_m // world_size, FLAG_BLOCK_M) + 1) + 2 * world_size


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GemmRs(CopyEngineSchedules):
    """Op context built once per (group, pool, max_m, k_local, n, dtype, config); call it many times.

    The output is valid on the caller's current stream when the call returns (CUDA), or at once (CPU).
    A device-side wait that expired is reported by `check_errors()` (it synchronises; call it at step
    boundaries, not inside the hot loop).
    """

    def __init__(self, *, group: dist.ProcessGroup, pool: SymmetricPool, max_m: int, k_local: int, n: int,
                 dtype: torch.dtype, config: OpConfig, name: str = "gemm_rs", timeout_s: float | None = None,
                 cuda_graphs: bool = False):
        if config.op != "gemm_rs":
            raise OpInputError(f"config.op is {config.op!r}; GemmRs needs a gemm_rs config")
        for arg, value in (("max_m", max_m), ("k_local", k_local), ("n", n)):
            if not isinstance(value, int) or value <= 0:
                raise OpInputError(f"{arg} must be a positive int, got {value!r}")
        self.group, self.pool, self.config, self.name = group, pool, config, name
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if (self.rank, self.world_size) != (pool.rank, pool.world_size):
            raise OpInputError("pool was built on another group than group=")
        check_divisible("max_m", max_m, self.world_size, "the group size")
        self.max_m, self.k_local, self.n, self.dtype, self.device = max_m, k_local, n, dtype, pool.device
        self.timeout_s = pool.timeout_s if timeout_s is None else timeout_s
        if cuda_graphs and self.device.type != "cuda":
            raise OpInputError(f"{name}: cuda_graphs=True needs a CUDA pool (this one is on {self.device})")
        self.cuda_graphs = bool(cuda_graphs)
        self.num_buffers = 1 if cuda_graphs else 2
        max_rows = max_m // self.world_size
        self.flags_per_source = _cdiv(max_rows, FLAG_BLOCK_M) + 1
        self._reduced_flag0 = self.world_size * self.flags_per_source
        self._pair_flag0 = self._reduced_flag0 + self.world_size  # W = 2 copy-engine schedules, per source
        self._slot_elems = self.world_size * max_rows * n
        self.partials = pool.reserve(f"{name}.partials", (self.num_buffers, self._slot_elems), dtype,
                                     num_signals=flag_words(max_m, self.world_size), exclusive=True)
        self._epoch = 0
        self._epoch_counter = None
        self._guard = CallGuard(name, self.device)
        if self.device.type == "cuda":
            self._setup_cuda()

    def _setup_cuda(self) -> None:
        from .triton_gemm import num_sms
        self.num_sms = num_sms(self.device)
        self.config.validate(num_sms=self.num_sms)
        self._reduce_stream = torch.cuda.Stream(self.device, priority=self.config.comm_stream_priority)
        self._comm_stream = torch.cuda.Stream(self.device, priority=self.config.comm_stream_priority)
        self._errors = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._tile_counters = torch.zeros(_cdiv(self.max_m, FLAG_BLOCK_M) + 1, dtype=torch.int32,
                                          device=self.device)
        base = self.pool.ptr_table(f"{self.name}.partials")
        self._dst_ptrs = [base + b * self._slot_elems * self.dtype.itemsize for b in range(self.num_buffers)]
        if self.cuda_graphs:
            self._epoch_counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._flag_ptrs = self.pool.ptr_table(f"{self.name}.partials", signals=True)
        # decomposed: cuBLAS output of the peers' chunks before the copy-engine push
        self._staging = torch.empty(self.max_m if self.config.method == "decomposed" else 0, self.n,
                                    dtype=self.dtype, device=self.device)
        self._trace = None

    # ----- public --------------------------------------------------------------------------------------
    def __call__(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """out_shard [M/W, N] for a [M, K_local], w [K_local, N].

        w is row-major, or the transpose view `weight.t()` of a row-major [N, K_local] (read in place).
        """
        self._validate(a, w)
        m = a.shape[0]
        with self._guard:
            self._epoch += 1
            out = torch.empty(m // self.world_size, self.n, dtype=self.dtype, device=self.device)
            if self.device.type == "cpu":
                self._run_host(a, w, out)
            elif self.config.method == "epilogue_reduce" and (m // self.world_size) % FLAG_BLOCK_M == 0:
                self._run_epilogue_reduce(a, w, out)
            elif self.config.method in ("fused", "epilogue_reduce"):
                self._run_fused(a, w, out)
            elif self.world_size == 2 and not self.config.num_comm_sms:
                self._run_decomposed_pair(a, w, out)
            else:
                self._run_decomposed(a, w, out)
        return out

    def check_errors(self) -> None:
        """Raise SignalTimeout (on this rank) if a reduction wait expired; synchronises the device."""
        if self.device.type != "cuda":
            return
        self.pool.check_errors()
        code = int(self._errors[0].item())
        if code:
            self._errors.zero_()
            self.pool.raise_if_peer_lost(f"{self.name}: partials of source rank {code - 1}")
            self.pool.abort(1)  # tell every peer, so that no rank waits for a step that will not come
            raise SignalTimeout(region=f"{self.name}.partials", index=code - 1, epoch=self._epoch,
                                observed=-1, timeout_s=self.timeout_s, peer=code - 1, op=self.name)

    def enable_trace(self, on: bool = True) -> None:
        """Record CUDA events on the compute and reduction streams at each call (see `last_trace_ms`)."""
        if self.device.type == "cuda":
            self._trace = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if on else None

    def last_trace_ms(self) -> dict[str, float]:
        """Spans of the last traced call (synchronises): `compute_ms` from the call's start to the end of its
        GEMM work on the compute stream, `reduce_ms` the reduction stream (waits included), `total_ms`."""
        start, gemm_end, reduce_start, end = self._trace
        end.synchronize()
        reduce_ms = reduce_start.elapsed_time(end)
        return {"compute_ms": start.elapsed_time(gemm_end), "reduce_ms": reduce_ms, "comm_ms": reduce_ms,
                "total_ms": start.elapsed_time(end)}

    def _mark(self, index: int, stream) -> None:
        if self._trace:
            self._trace[index].record(stream)

    @property
    def epoch(self) -> int:
        """Calls issued so far (the epoch the last call wrote into its flags)."""
        return self._epoch

    def close(self) -> None:
        """Drop pool views and op buffers (the pool itself is owned by the caller)."""
        self.partials = None
        for attr in ("_staging", "_dst_ptrs", "_flag_ptrs", "_tile_counters"):
            if hasattr(self, attr):
                setattr(self, attr, None)

    # ----- validation ------------------------------------------------------------------------------------
    def _validate(self, a, w) -> None:
        if self.partials is None or self.pool.closed:
            raise OpInputError(f"{self.name} is closed (or its pool is)")
        check_not_capturing(self.name, self.device, self.cuda_graphs)
        check_tensor("a", a, dtype=self.dtype, device=self.device, shape=(None, self.k_local))
        check_weight("w", w, dtype=self.dtype, device=self.device, shape=(self.k_local, self.n))
        check_divisible("M", a.shape[0], self.world_size, "the group size")
        check_at_most("M", a.shape[0], self.max_m, "max_m of this op")

    def _slots(self, rank: int, rows: int) -> torch.Tensor:
        """[W, rows, N] view of `rank`'s buffer of this step (contiguous prefix of the slot area)."""
        flat = self.pool.peer(f"{self.name}.partials", rank)[self._epoch % self.num_buffers]
        return flat[:self.world_size * rows * self.n].view(self.world_size, rows, self.n)

    def owners(self) -> list[int]:
        """Ring order from rank + 1; the own chunk last (its reduction input needs no transfer)."""
        return [(self.rank + step) % self.world_size for step in range(1, self.world_size + 1)]

    # ----- CPU -----------------------------------------------------------------------------------------
    def _run_host(self, a, w, out) -> None:
        rows = a.shape[0] // self.world_size
        region = f"{self.name}.partials"
        for owner in self.owners():
            partial = torch.mm(a[owner * rows:(owner + 1) * rows], w)
            self._slots(owner, rows)[self.rank].copy_(partial)
            self.pool.signal(region, self.rank * self.flags_per_source, self._epoch, rank=owner)
        for src in range(self.world_size):
            self.pool.wait(region, src * self.flags_per_source, self._epoch, timeout_s=self.timeout_s,
                           peer=src, op=self.name)
        out.copy_(self._slots(self.rank, rows).float().sum(dim=0))

    # ----- CUDA ----------------------------------------------------------------------------------------
    def _step_epoch(self, offset: int = 0):
        """This call's epoch (+ offset) as the flag operations take it: host int, or device counter."""
        if self.cuda_graphs:
            return DeviceEpoch(self._epoch_counter, offset)
        return self._epoch + offset

    def _begin_cuda(self, compute) -> None:
        """Start of a CUDA call on `compute`: bump the device epoch and, with one buffer, wait until every
        owner has reduced what this rank wrote into its slot last call."""
        self._mark(0, compute)
        if not self.cuda_graphs:
            return
        self._epoch_counter.add_(1)
        for owner in range(self.world_size):
            if owner != self.rank:
                self.pool.wait(f"{self.name}.partials", self._reduced_flag0 + owner, self._step_epoch(-1),
                               timeout_s=self.timeout_s, peer=owner, op=self.name)

    def _reduce(self, rows: int, out: torch.Tensor, programs: int | None = None) -> None:
        from kernels.flags import epoch_args
        from kernels.gemm import reduce_partials_kernel
        programs = programs or max(1, self.config.num_comm_sms or self.config.sm_margin or 8)
        epoch, counter, device_epoch = epoch_args(self._step_epoch())
        reduce_partials_kernel[(programs,)](
            self._slots(self.rank, rows), out, self.pool.signals(f"{self.name}.partials"), self._errors,
            rows, self.n, out.stride(0), self.world_size, epoch, self.flags_per_source,
            FLAG_BLOCK_M, self.rank, int(self.timeout_s * 1e9),
            WAIT=True, USE_TIMER=True, BLOCK_M=32, BLOCK_N=256, num_warps=4,
            epoch_ptr=counter, DEVICE_EPOCH=device_epoch)
        self._signal_reduced()

    def _signal_reduced(self) -> None:
        if self.cuda_graphs:  # our slots are free again: tell every source
            for src in range(self.world_size):
                if src != self.rank:
                    self.pool.signal(f"{self.name}.partials", self._reduced_flag0 + self.rank,
                                     self._step_epoch(), rank=src)

    def _launch_gemm(self, a, w, out, epilogue: int) -> None:
        """The persistent Triton GEMM with a scatter (EPILOGUE_SCATTER) or scatter-then-reduce
        (EPILOGUE_SCATTER_REDUCE) epilogue, on the current stream, into this step's buffers."""
        from kernels.flags import epoch_args
        from kernels.gemm import EPILOGUE_SCATTER, persistent_gemm_kernel
        from .triton_gemm import b_operand, choose_blocks, descriptor_ok, ensure_allocator

        ensure_allocator()
        m = a.shape[0]
        rows = m // self.world_size
        programs = self.num_sms - self.config.sm_margin
        blocks = dataclasses.replace(choose_blocks(m, self.n, self.k_local, sm_count=programs),
                                     block_m=FLAG_BLOCK_M)
        b, ldb, b_transposed = b_operand(w)
        epoch, counter, device_epoch = epoch_args(self._step_epoch())
        scatter = epilogue == EPILOGUE_SCATTER
        persistent_gemm_kernel[(programs,)](
            a, b, out, m, self.n, self.k_local, a.stride(0), ldb, out.stride(0),
            ((self.rank + 1) % self.world_size) * rows // FLAG_BLOCK_M if scatter else 0,
            self._dst_ptrs[self._epoch % self.num_buffers], self._flag_ptrs, self._tile_counters,
            rows, self.rank, epoch, self.flags_per_source,
            BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, GROUP_M=blocks.group_m,
            EPILOGUE=epilogue, USE_DESCRIPTORS=descriptor_ok(a, b), B_TRANSPOSED=b_transposed,
            # warp specialisation stays off with the scatter epilogues: their barrier + release atomics
            # inside a specialised partition have not been run on a GPU
            WARP_SPECIALIZE=False, num_warps=blocks.num_warps, num_stages=blocks.num_stages,
            error_ptr=self._errors, timeout_ns=int(self.timeout_s * 1e9), epoch_ptr=counter,
            DEVICE_EPOCH=device_epoch)

    def _run_epilogue_reduce(self, a, w, out) -> None:
        from kernels.gemm import EPILOGUE_SCATTER_REDUCE

        compute = torch.cuda.current_stream(self.device)
        self._begin_cuda(compute)
        self._launch_gemm(a, w, out, EPILOGUE_SCATTER_REDUCE)
        for index in (1, 2, 3):  # one stream: the reduction is inside the GEMM
            self._mark(index, compute)
        self._signal_reduced()

    def _run_fused(self, a, w, out) -> None:
        from kernels.gemm import EPILOGUE_SCATTER

        compute = torch.cuda.current_stream(self.device)
        self._begin_cuda(compute)
        self._reduce_stream.wait_stream(compute)
        self._launch_gemm(a, w, out, EPILOGUE_SCATTER)
        self._mark(1, compute)
        with torch.cuda.stream(self._reduce_stream):
            self._mark(2, self._reduce_stream)
            self._reduce(a.shape[0] // self.world_size, out)
        compute.wait_stream(self._reduce_stream)
        self._mark(3, compute)

    def _run_decomposed(self, a, w, out) -> None:
        from kernels.flags import launch_signal_range

        rows = a.shape[0] // self.world_size
        compute = torch.cuda.current_stream(self.device)
        self._begin_cuda(compute)
        self._reduce_stream.wait_stream(compute)
        with sm_carveout(self.config.sm_margin):
            for owner in self.owners():
                chunk = a[owner * rows:(owner + 1) * rows]
                if owner == self.rank:
                    torch.mm(chunk, w, out=self._slots(owner, rows)[self.rank])
                    launch_signal_range(self.pool.peer_signals(f"{self.name}.partials", owner),
                                        self.rank * self.flags_per_source, self.flags_per_source,
                                        self._step_epoch())
                    continue
                staged = torch.mm(chunk, w, out=self._staging[owner * rows:(owner + 1) * rows])
                self._push_rows(staged, owner, compute, pair=False)
        self._mark(1, compute)
        with torch.cuda.stream(self._reduce_stream):
            self._mark(2, self._reduce_stream)
            self._reduce(rows, out)
        compute.wait_stream(self._reduce_stream)
        compute.wait_stream(self._comm_stream)
        self._mark(3, compute)


def gemm_rs(a: torch.Tensor, w: torch.Tensor, *, op: GemmRs) -> torch.Tensor:
    """Functional form: `op(a, w)`."""
    return op(a, w)
