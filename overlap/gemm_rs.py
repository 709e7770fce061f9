"""GEMM + ReduceScatter: `out_shard = reduce_scatter(a @ w)`.

Shapes: a [M, K_local], w [K_local, N] (row-major, or `weight.t()` of a row-major [N, K_local]),
out_shard [M/W, N]; M <= max_m, M % W == 0. Pool region `<name>.partials` [W, max_m/W, N]: slot s of rank o
receives source s's partial product of o's rows; its device flags [W, flags_per_source] say which GEMM row
blocks of which source have landed (the scatter epilogue's). Flags and handshakes: protocol.py.

Schedules (config.method; the same stream operations eager or replayed):
  fused:           wait free[o] (every owner reduced this rank's slot of the last call), one persistent
                   Triton GEMM on num_sms - sm_margin programs storing each tile into its owner's slot and
                   releasing the row block's device flag; on a side stream a reduction kernel on num_comm_sms
                   programs waits for each row block's W flags and sums them into out; then the flags are reset
                   and free[me] raised on every source.
  epilogue_reduce: the same GEMM scattering the other owners' rows first and reducing its own rows in its
                   epilogue (no reduction kernel); needs (M/W) % 128 == 0 and a GPU.
  decomposed:      one cuBLAS GEMM per owner chunk (ring order, own chunk last) on num_sms - sm_margin SMs,
                   each pushed to its owner by the copy engine (wait free[o], copy, raise pushed[me] on o); a
                   side stream waits pushed[s] of every source and runs the reduction kernel (no waits inside).
  pair:            W = 2: cuBLAS GEMM of the peer's rows, copy-engine push while the own rows' GEMM runs, then
                   wait pushed[peer] and add.
`bulk(a, w, work)` (a column layer's backward with bulk_wgrad): the whole GEMM on cuBLAS, the pushes of
`decomposed`, the caller's `work` (the weight-grad GEMM) meanwhile, then the reduction on the compute stream.
`reduce_scatter(partials)` is the decomposed schedule with no GEMM: the measured comm path.
fp8=True (decomposed, pair): the input is quantised once, the FP8 GEMM runs per owner chunk, and the
partials stay bf16: they are sums already rounded once, and e4m3 partials would add a second, coarser
rounding to every reduction.
Every wait of the push path is a memory operation: the copy engine starts while a GEMM holds every SM.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from . import protocol
from ._gemm_launch import Scatter, launch_gemm, launch_reduce
from ._op import OpBase
from ._validate import OpInputError, check_method_runs, check_tensor, check_weight
from .config import GemmRsConfig
from .schedule import COMPUTE, CallContext, Program
from .triton_gemm import choose_blocks, num_sms, sm_carveout

__all__ = ["GemmRs", "gemm_rs", "FLAG_BLOCK_M"]

FLAG_BLOCK_M = 128  # row-block granularity of the device flags (the scatter GEMM's BLOCK_M)
COMM, REDUCE = "comm", "reduce"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GemmRs(OpBase):
    """Op context built once per (group, pool, max_m, k_local, n, dtype, config); call it many times.

    The output is valid on the caller's current stream when the call returns (CUDA), or at once (CPU). Any
    call may be captured in a CUDA graph and replayed. A device-side wait that expired is raised by the next
    call or by `check_errors()` (which synchronises; call it at step boundaries). `bulk=True` allocates
    bulk()'s [max_m, n] staging at construction (otherwise at its first call): needed when that first call
    runs under torch.compile(mode="reduce-overhead").
    """

    kind = "gemm_rs"

    def __init__(self, *, group: dist.ProcessGroup, pool, max_m: int, k_local: int, n: int, dtype: torch.dtype,
                 config: GemmRsConfig, name: str = "gemm_rs", fp8: bool = False, bulk: bool = False):
        super().__init__(group=group, pool=pool, name=name, config=config, max_m=max_m,
                         static={"max_m": max_m, "k_local": k_local, "n": n, "dtype": str(dtype), "fp8": fp8})
        self.k_local, self.n, self.dtype, self.fp8 = k_local, n, dtype, bool(fp8)
        if fp8 and (dtype != torch.bfloat16 or config.method not in ("decomposed", "pair")):
            raise OpInputError(f"{name}: fp8=True runs the FP8 GEMM per owner chunk and reduce-scatters bf16 "
                               f"partials: it needs dtype bfloat16 and method decomposed or pair (this is "
                               f"{dtype}, {config.method}: the scatter epilogues are bf16 kernels)")
        if fp8:
            from .fp8 import Fp8WeightCache
            self._weights = Fp8WeightCache()   # of w.t(): w8 [N, K] for w [K_local, N]
        check_method_runs(name, config, self.device)
        if config.method == "pair" and self.world_size != 2:
            raise OpInputError(f"{name}: method pair is the W = 2 schedule; this group has {self.world_size} "
                               f"ranks (use decomposed or fused)")
        self._agree()  # before any reservation: a disagreement must not shift the pool's layout
        max_rows = max_m // self.world_size
        self.flags_per_source = _cdiv(max_rows, FLAG_BLOCK_M) + 1
        self.flags = protocol.RsFlags(f"{name}.partials", self.world_size, self.flags_per_source)
        self.partials = pool.reserve(self.flags.region, (self.world_size * max_rows * n,), dtype,
                                     num_signals=self.flags.num_signals,
                                     num_device_flags=self.flags.num_device_flags, exclusive=True)
        self.row_flags = pool.device_flags(self.flags.region)
        protocol.initialise(pool, self.flags)
        needs_staging = config.method in ("decomposed", "pair")
        self._staging = torch.empty(max_m if needs_staging else 0, n, dtype=dtype, device=self.device)
        # bulk=True: bulk()'s staging now, not at its first call, which may run inside a warm-up whose
        # allocations must not outlive it (torch.compile's CUDA-graph trees check exactly that)
        self._bulk_staging = torch.empty(max_m, n, dtype=dtype, device=self.device) if bulk else None
        self._tile_counters = torch.zeros(_cdiv(max_m, FLAG_BLOCK_M) + 1, dtype=torch.int32, device=self.device)

    # ----- public --------------------------------------------------------------------------------------
    def __call__(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """out_shard [M/W, N] for a [M, K_local], w [K_local, N]."""
        self._check_inputs(a, w)
        m = a.shape[0]
        if self.config.method == "epilogue_reduce" and (m // self.world_size) % FLAG_BLOCK_M:
            raise OpInputError(f"{self.name}: method epilogue_reduce needs M/W % {FLAG_BLOCK_M} == 0 (its own row "
                               f"blocks may not straddle owners); M = {m}, W = {self.world_size}. Use a by_m "
                               f"bucket with another method for this M")
        out = torch.empty(m // self.world_size, self.n, dtype=self.dtype, device=self.device)
        self._execute((m, self.config.method), self._context(a, w, out=out), m=m)
        return out

    def _context(self, a, w, **values) -> CallContext:
        ctx = CallContext({"a": a, "w": w, **values})
        if self.fp8:  # quantised once for all the chunk GEMMs (a kernel on the current stream)
            from .fp8 import quantize_activation
            ctx.values["a_fp8"], ctx.values["w_fp8"] = quantize_activation(a), self._weights.get(w.t())
        return ctx

    def bulk(self, a: torch.Tensor, w: torch.Tensor, work):
        """(out_shard, work()) with the reduce-scatter's pushes overlapped with `work` (no SM for the pushes)."""
        self._check_inputs(a, w)
        m = a.shape[0]
        if self._bulk_staging is None:
            self._bulk_staging = torch.empty(self.max_m, self.n, dtype=self.dtype, device=self.device)
        out = torch.empty(m // self.world_size, self.n, dtype=self.dtype, device=self.device)
        ctx = self._context(a, w, out=out, work=work, result=None)
        self._execute((m, "bulk"), ctx, m=m)
        return out, ctx.values["result"]

    def reduce_scatter(self, partials: torch.Tensor) -> torch.Tensor:
        """out [M/W, N] = sum over ranks of their partials [M, N]'s rows of this rank: the comm of this op
        alone (copy-engine pushes and the reduction kernel), for the k-factor and the benchmarks."""
        self._check_live()
        check_tensor("partials", partials, dtype=self.dtype, device=self.device, shape=(None, self.n))
        m = partials.shape[0]
        self._check_m(m)
        out = torch.empty(m // self.world_size, self.n, dtype=self.dtype, device=self.device)
        self._execute((m, "comm_only"), CallContext({"partials": partials, "out": out}), m=m)
        return out

    def owners(self) -> list[int]:
        """Ring order from rank + 1; the own chunk last (its reduction input needs no transfer)."""
        return [(self.rank + step) % self.world_size for step in range(1, self.world_size + 1)]

    def _check_inputs(self, a, w) -> None:
        self._check_live()
        check_tensor("a", a, dtype=self.dtype, device=self.device, shape=(None, self.k_local))
        check_weight("w", w, dtype=self.dtype, device=self.device, shape=(self.k_local, self.n))
        self._check_m(a.shape[0])

    def _slots(self, rank: int, rows: int) -> torch.Tensor:
        """[W, rows, N] view of `rank`'s slots (the contiguous prefix of its region)."""
        flat = self.pool.peer(self.flags.region, rank)
        return flat[:self.world_size * rows * self.n].view(self.world_size, rows, self.n)

    # ----- programs ------------------------------------------------------------------------------------
    def _build(self, key) -> Program:
        m, schedule = key
        program = Program(self.pool, op=self.name)
        rows = m // self.world_size
        build = {"fused": self._fused, "epilogue_reduce": self._epilogue_reduce, "decomposed": self._decomposed,
                 "pair": self._pair, "bulk": self._bulk, "comm_only": self._comm_only}[schedule]
        build(program, m, rows)
        return program

    def _peers(self) -> list[int]:
        return self.owners()[:-1]

    def _take_free(self, program: Program, lane: str) -> None:
        for owner in self._peers():
            program.take(lane, self.flags.free(owner), peer=owner)

    def _give_free(self, program: Program, lane: str) -> None:
        for source in self._peers():
            program.give(lane, self.flags.free(self.rank), source)

    def _scatter(self, rows: int) -> Scatter:
        return Scatter(dst_ptrs=self.pool.ptr_table(self.flags.region),
                       flag_ptrs=self.pool.ptr_table(self.flags.region, device_flags=True),
                       tile_counters=self._tile_counters, rows_per_rank=rows, src_rank=self.rank,
                       flags_per_source=self.flags_per_source, error_words=self.pool.error_words(),
                       error_code_base=self.pool.device_error_code(self.flags.region, 0), timeout_s=self.timeout_s)

    def _gemm_blocks(self, m: int, programs: int):
        return dataclasses.replace(choose_blocks(m, self.n, self.k_local, device_type=self.device.type,
                                                 warp_specialize=False, sm_count=programs), block_m=FLAG_BLOCK_M)

    def _used_row_flags(self, rows: int) -> torch.Tensor:
        """The device flags a call of `rows` rows per rank sets on this owner, [W, used] (for the host driver)."""
        used = ((self.rank + 1) * rows - 1) // FLAG_BLOCK_M - (self.rank * rows) // FLAG_BLOCK_M + 1
        return self.row_flags.view(self.world_size, self.flags_per_source)[:, :used]

    def _fused(self, program: Program, m: int, rows: int) -> None:
        programs = num_sms(self.device) - self.config.sm_margin
        blocks, scatter = self._gemm_blocks(m, programs), self._scatter(rows)
        self._take_free(program, COMPUTE)
        offset = ((self.rank + 1) % self.world_size) * rows // FLAG_BLOCK_M  # owners interleave across ranks
        program.run(COMPUTE, lambda ctx: launch_gemm(a=ctx.a, w=ctx.w, out=self._slots(self.rank, rows)[0],
                                                     num_programs=programs, blocks=blocks, epilogue=1,
                                                     tile_row_offset=offset, scatter=scatter))
        if self.device.type == "cpu":
            program.await_device(REDUCE, self._used_row_flags(rows))
        program.run(REDUCE, lambda ctx: self._reduce(ctx.out, rows, wait=True))
        program.clear(REDUCE, self.row_flags)
        self._give_free(program, REDUCE)

    def _epilogue_reduce(self, program: Program, m: int, rows: int) -> None:
        programs = num_sms(self.device) - self.config.sm_margin
        blocks, scatter = self._gemm_blocks(m, programs), self._scatter(rows)
        self._take_free(program, COMPUTE)
        program.run(COMPUTE, lambda ctx: launch_gemm(a=ctx.a, w=ctx.w, out=ctx.out, num_programs=programs,
                                                     blocks=blocks, epilogue=2, scatter=scatter))
        program.clear(COMPUTE, self.row_flags)
        self._give_free(program, COMPUTE)

    def _reduce(self, out: torch.Tensor, rows: int, *, wait: bool) -> None:
        launch_reduce(partials=self._slots(self.rank, rows), out=out, flags=self.row_flags,
                      error_words=self.pool.error_words(),
                      error_code_base=self.pool.device_error_code(self.flags.region, 0), rows_per_rank=rows,
                      world_size=self.world_size, flags_per_source=self.flags_per_source, gemm_block_m=FLAG_BLOCK_M,
                      owner_rank=self.rank, num_programs=max(1, self.config.num_comm_sms), wait=wait,
                      timeout_s=self.timeout_s)

    def _push(self, program: Program, owner: int, rows: int, source) -> None:
        """Copy-engine push of this rank's partial of `owner`'s rows into owner's slot, then pushed[me]."""
        program.take(COMM, self.flags.free(owner), peer=owner)
        program.copy(COMM, self._slots(owner, rows)[self.rank], source)
        program.give(COMM, self.flags.pushed(self.rank), owner)

    def _take_pushed(self, program: Program, lane: str) -> None:
        for source in self._peers():
            program.take(lane, self.flags.pushed(source), peer=source)

    def _decomposed(self, program: Program, m: int, rows: int) -> None:
        margin = self.config.sm_margin
        for owner in self.owners():
            lo = owner * rows
            if owner == self.rank:
                program.run(COMPUTE, self._mm_into(lo, rows, lambda ctx, o=owner: self._slots(o, rows)[self.rank],
                                                   margin))
                program.record(COMPUTE, "own")
                continue
            staged = self._staging[lo:lo + rows]
            program.run(COMPUTE, self._mm_into(lo, rows, lambda ctx, s=staged: s, margin))
            program.record(COMPUTE, f"staged{owner}")
            program.after(COMM, f"staged{owner}")
            self._push(program, owner, rows, staged)
        self._take_pushed(program, REDUCE)
        program.after(REDUCE, "own")
        program.run(REDUCE, lambda ctx: self._reduce(ctx.out, rows, wait=False))
        self._give_free(program, REDUCE)

    def _pair(self, program: Program, m: int, rows: int) -> None:
        peer, margin = 1 - self.rank, self.config.sm_margin
        staged = self._staging[:rows]
        program.run(COMPUTE, self._mm_into(peer * rows, rows, lambda ctx: staged, margin))
        program.record(COMPUTE, "staged")
        program.after(COMM, "staged")
        self._push(program, peer, rows, staged)
        program.run(COMPUTE, self._mm_into(self.rank * rows, rows, lambda ctx: ctx.out, margin))
        program.take(COMPUTE, self.flags.pushed(peer), peer=peer)
        slot = self._slots(self.rank, rows)[peer]
        program.run(COMPUTE, lambda ctx: ctx.out.add_(slot))
        self._give_free(program, COMPUTE)

    def _bulk(self, program: Program, m: int, rows: int) -> None:
        staged = self._bulk_staging[:m]
        program.run(COMPUTE, self._mm_into(0, m, lambda ctx: staged, 0))
        program.record(COMPUTE, "staged")
        program.after(COMM, "staged")
        for owner in self._peers():
            self._push(program, owner, rows, self._bulk_staging[owner * rows:(owner + 1) * rows])
        program.run(COMPUTE, lambda ctx: ctx.values.__setitem__("result", ctx.work()))
        self._take_pushed(program, COMPUTE)
        own, slots = self._bulk_staging[self.rank * rows:(self.rank + 1) * rows], self._slots(self.rank, rows)
        peers = self._peers()
        program.run(COMPUTE, lambda ctx: _sum_into(ctx.out, own, [slots[s] for s in peers]))
        self._give_free(program, COMPUTE)

    def _comm_only(self, program: Program, m: int, rows: int) -> None:
        own = self._slots(self.rank, rows)[self.rank]
        program.copy(COMPUTE, own, lambda ctx: ctx.partials[self.rank * rows:(self.rank + 1) * rows])
        program.record(COMPUTE, "own")
        for owner in self._peers():
            self._push(program, owner, rows, lambda ctx, o=owner: ctx.partials[o * rows:(o + 1) * rows])
        self._take_pushed(program, REDUCE)
        program.after(REDUCE, "own")
        program.run(REDUCE, lambda ctx: self._reduce(ctx.out, rows, wait=False))
        self._give_free(program, REDUCE)

    def _release(self) -> None:
        self.partials = self.row_flags = self._staging = self._bulk_staging = None

    def _mm_into(self, lo: int, rows: int, dst, margin: int):
        """A GEMM step: dst(ctx) = a[lo:lo + rows] @ w (cuBLAS on num_sms - margin SMs; fp8: the FP8 GEMM on
        the rows quantised at the call's start, bf16 out)."""
        if self.fp8:
            from .fp8 import fp8_gemm

            def mm_fp8(ctx) -> None:
                (a8, a_scales), (w8, w_scales) = ctx.a_fp8, ctx.w_fp8
                fp8_gemm(a8=a8[lo:lo + rows], a_scales=a_scales[lo:lo + rows], w8=w8, w_scales=w_scales, out=dst(ctx))
            return mm_fp8

        def mm(ctx) -> None:
            with sm_carveout(margin):
                torch.mm(ctx.a[lo:lo + rows], ctx.w, out=dst(ctx))
        return mm


def _sum_into(out: torch.Tensor, own: torch.Tensor, others: list[torch.Tensor]) -> None:
    if len(others) == 1:
        torch.add(own, others[0], out=out)
        return
    total = own.float()
    for other in others:
        total += other
    out.copy_(total)


def gemm_rs(a: torch.Tensor, w: torch.Tensor, *, op: GemmRs) -> torch.Tensor:
    """Functional form: `op(a, w)`."""
    return op(a, w)
