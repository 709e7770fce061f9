"""GEMM + ReduceScatter: `out_shard = reduce_scatter(a @ w)`.

Shapes: a [M, K_local], w [K_local, N] (row-major, or `weight.t()` of a row-major [N, K_local]),
out_shard [M/W, N]; M <= max_m, M % W == 0; `k_local=None`: any K_local per call (its own plans). Pool region
`<name>.partials` [W, max_m/W, N]: slot s of rank o receives source s's partial product of o's rows; its
device flags [W, flags_per_source] say which GEMM row blocks of which source have landed (the scatter
epilogue's, holding the call's M). Flags: protocol.py.

Plans (config.method; the same stream operations eager, replayed or captured):
  fused:           wait free[o] (every owner reduced this rank's slot of the last call), one persistent
                   GEMM (Gluon on a GPU: rs_scatter.py) on num_sms - sm_margin programs storing each tile into
                   its owner's slot and writing M into the row block's device flag; on a side stream a
                   reduction kernel on num_comm_sms programs waits until each row block's W flags hold M and
                   sums them into out; then the flags are reset and free[me] raised on every source.
  epilogue_reduce: the same GEMM scattering the other owners' rows first and reducing its own rows in its
                   epilogue (no reduction kernel); needs (M/W) % 128 == 0 and a GPU.
  decomposed:      one cuBLAS GEMM per owner chunk (ring order, own chunk last) on num_sms - sm_margin SMs,
                   each pushed to its owner by the copy engine (wait free[o], copy, write M into pushed[me] on
                   o); a side stream waits until pushed[s] of every source holds M and runs the reduction.
  pair:            W = 2: cuBLAS GEMM of the peer's rows, copy-engine push while the own rows' GEMM runs, then
                   wait pushed[peer] and add.
`bulk(a, w, wgrad_of=g)` (a column layer's backward with bulk_wgrad): the whole GEMM on cuBLAS, the pushes of
`decomposed`, g^T @ a meanwhile, the reduction on the compute stream. `reduce_scatter(partials)`: decomposed
without a GEMM (the measured comm path).
fp8=True (decomposed, pair): the input is quantised once, the FP8 GEMM runs per owner chunk, the partials stay
bf16 (sums already rounded once: e4m3 partials would add a second, coarser rounding to every reduction).
Every wait of the push path is a memory operation: the copy engine starts while a GEMM holds every SM.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tp_overlap.kernels.constants import ROW_BLOCK_M
from tp_overlap.symm_mem.regions import RegionSpec

from ..gemm import Fp8WeightCache, fp8_gemm, launch_reduce, num_sms, quantize_activation, sm_carveout
from . import protocol
from .protocol import ring_order
from .base import OpBase
from .calls import RsCall, RsPlanKey
from .validate import OpInputError, check_method_runs, check_tensor
from ..config.schema import GemmRsConfig
from .program import COMPUTE, Program
from .rs_scatter import RsScatterGemms
from ..gemm.gluon_launch import gluon_placeholders, split_buffers

__all__ = ["GemmRs"]

COMM, REDUCE = "comm", "reduce"
STAGED_METHODS = ("decomposed", "pair")


class GemmRs(RsScatterGemms, OpBase):
    """Op context built once per (group, pool, max_m, k_local, n, dtype, config); call it many times.

    `config` is a GemmRsConfig, or an OpPreset of them (`by_m` buckets: each call runs the config of its M).
    The output is valid on the caller's current stream when the call returns (CUDA), or at once (CPU). Any
    call may be captured in a CUDA graph and replayed. A device-side wait that expired is raised by the next
    call or by `check_errors()` (which synchronises; call it at step boundaries). `bulk=True` allocates
    bulk()'s [max_m, n] staging at construction (otherwise at its first call): needed when that first call
    runs under torch.compile(mode="reduce-overhead"). A `fused` config on a GPU also allocates its scatter
    GEMM's split-tail buffers (gluon_launch.split_buffers: ~17 MB on 132 SMs; compute_alone another at its
    first call).
    """

    kind = "gemm_rs"

    def __init__(self, *, group: dist.ProcessGroup, pool, max_m: int, k_local: int | None, n: int, dtype: torch.dtype,
                 config: GemmRsConfig, name: str = "gemm_rs", fp8: bool = False, bulk: bool = False):
        super().__init__(group=group, pool=pool, name=name, config=config, max_m=max_m,
                         static={"max_m": max_m, "k_local": k_local, "n": n, "dtype": str(dtype), "fp8": fp8})
        self.k_local, self.n, self.dtype, self.fp8 = k_local, n, dtype, bool(fp8)
        self.num_sms = num_sms(self.device)
        methods = {cfg.method for cfg in self.configs()}
        self._check_methods(name, methods, dtype)
        if fp8:
            self._weights = Fp8WeightCache()   # of w.t(): w8 [N, K] for w [K_local, N]
        self._agree()  # before any reservation: a disagreement must not shift the pool's layout
        self.flags = protocol.RsFlags(f"{name}.partials", self.world_size, max_m)
        self.flags_per_source = self.flags.flags_per_source
        (spec,) = self.regions(name=name, world_size=self.world_size, max_m=max_m, n=n, dtype=dtype)
        self.partials = self._reserve(spec)
        self.row_flags = pool.device_flags(self.flags.region)
        protocol.initialise(pool, self.flags)
        self._staging = torch.empty(max_m if methods & set(STAGED_METHODS) else 0, n, dtype=dtype, device=self.device)
        # now, not at a first call inside a warm-up that no allocation may outlive (CUDA-graph trees check)
        self._bulk_staging = torch.empty(max_m, n, dtype=dtype, device=self.device) if bulk else None
        self._tile_counters = torch.zeros(-(-max_m // ROW_BLOCK_M) + 1, dtype=torch.int32, device=self.device)
        if methods & {"fused", "epilogue_reduce"}:   # the scatter epilogues' address tables now, likewise
            self._tables = pool.ptr_table(self.flags.region), pool.ptr_table(self.flags.region, device_flags=True)
            gluon_placeholders(self.device)  # the Gluon GEMM's unused arguments, likewise
        # the Gluon scatter GEMM's split tail (the last wave an sm_margin leaves partial, cut by K): the calls'
        # workspace, likewise; compute_alone (which may run beside a call) makes its own at its first use
        fused_gluon = "fused" in methods and self.device.type == "cuda"
        self._split_buffers = split_buffers(self.device, self.num_sms) if fused_gluon else None
        self._alone_split_buffers = None

    @staticmethod
    def regions(*, name: str, world_size: int, max_m: int, n: int, dtype: torch.dtype) -> list[RegionSpec]:
        """The pool region a GemmRs reserves: W slots of [max_m/W, N] partials (one per source rank) with
        the flags of `protocol.RsFlags` (a device flag per row block of each source)."""
        flags = protocol.RsFlags(f"{name}.partials", world_size, max_m)
        return [RegionSpec(flags.region, (world_size * (max_m // world_size) * n,), dtype,
                           flags.num_signals, flags.num_device_flags)]

    def _check_methods(self, name: str, methods: set, dtype) -> None:
        if self.fp8 and (dtype != torch.bfloat16 or not methods <= set(STAGED_METHODS)):
            raise OpInputError(f"{name}: fp8=True runs the FP8 GEMM per owner chunk and reduce-scatters bf16 "
                               f"partials: it needs dtype bfloat16 and method decomposed or pair (this is "
                               f"{dtype}, {' | '.join(sorted(methods))}: the scatter epilogues are bf16 kernels)")
        for cfg in self.configs():
            check_method_runs(name, cfg, self.device)
        if "pair" in methods and self.world_size != 2:
            raise OpInputError(f"{name}: method pair is the W = 2 schedule; this group has {self.world_size} "
                               f"ranks (use decomposed or fused)")

    # ----- public --------------------------------------------------------------------------------------
    def __call__(self, a: torch.Tensor, w: torch.Tensor, *, wgrad_of: torch.Tensor | None = None, check=None):
        """out_shard [M/W, N] for a [M, K_local], w [K_local, N]; with wgrad_of g [M, J], (out_shard, g^T @ a
        [J, K_local]) (a column layer's backward: a its output grad, g its gathered input). check: (stamp,
        version, code), int64 [1] tensors and a `pool.failure_code`: first, a failure on every rank if they differ."""
        self._check_operands("a", a, self.k_local, w, self.k_local, self.n)
        self._check_wgrad_of(wgrad_of, a.shape[0])
        return self._call(a.shape[0], "op", a, w, wgrad_of, None, check)

    def bulk(self, a: torch.Tensor, w: torch.Tensor, work=None, *, wgrad_of: torch.Tensor | None = None,
             check=None):
        """(out_shard, result) with the reduce-scatter's pushes overlapped with other work (no SM for the
        pushes): `wgrad_of` g [M, J] -> result = g^T @ a; or `work`, a callable (result = work(); such calls
        are enqueued step by step, never replayed). check: as in `__call__`."""
        self._check_operands("a", a, self.k_local, w, self.k_local, self.n)
        self._check_wgrad_of(wgrad_of, a.shape[0])
        return self._bulk_call(a, w, work, wgrad_of, check)

    def _check_wgrad_of(self, wgrad_of, m: int) -> None:
        if wgrad_of is not None:
            check_tensor("wgrad_of", wgrad_of, dtype=self.dtype, device=self.device, shape=(m, None),
                         contiguous=False)

    def _bulk_call(self, a, w, work, wgrad_of, check):
        m = a.shape[0]
        if (work is None) == (wgrad_of is None):
            raise OpInputError(f"{self.name}.bulk: pass exactly one of work= and wgrad_of=")
        if self._bulk_staging is None:
            self._bulk_staging = torch.empty(self.max_m, self.n, dtype=self.dtype, device=self.device)
        return self._call(m, "bulk", a, w, wgrad_of, work, check)

    def compute_alone(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """partials [M, N] = a [M, K_local] @ w: this op's plan for M without its comm lanes (no flags, pushes,
        scatter or reduction): the same GEMMs (kernel, blocks, SM budget, owner order). The "compute alone"
        of the k-factor."""
        self._check_operands("a", a, self.k_local, w, self.k_local, self.n)
        return self._call(a.shape[0], "compute", a, w, None, None, None)

    def reduce_scatter(self, partials: torch.Tensor) -> torch.Tensor:
        """out [M/W, N] = sum over ranks of their partials [M, N]'s rows of this rank: the comm of this op
        alone (copy-engine pushes and the reduction kernel), for the k-factor and the benchmarks."""
        self._check_live()
        check_tensor("partials", partials, dtype=self.dtype, device=self.device, shape=(None, self.n))
        m = partials.shape[0]
        out = torch.empty(m // self.world_size, self.n, dtype=self.dtype, device=self.device)
        key = RsPlanKey(m, "comm_only", False, False, False, 0, False)
        self._launch(self._plan(key, m), RsCall(out=out, partials=partials), (partials.data_ptr(), out.data_ptr()))
        return out

    def owners(self) -> list[int]:
        """Ring order from rank + 1; the own chunk last (its reduction input needs no transfer)."""
        return ring_order(self.rank, self.world_size) + [self.rank]

    def _call(self, m: int, schedule: str, a, w, wgrad_of, work, check):
        out = torch.empty(m if schedule == "compute" else m // self.world_size, self.n, dtype=self.dtype,
                          device=self.device)
        call = RsCall(a=a, w=w, out=out, work=work, check=check)
        addresses = (a.data_ptr(), w.data_ptr(), w.stride(0), out.data_ptr())
        if check is not None:
            addresses += (check[0].data_ptr(), check[2])
        if wgrad_of is not None:
            grad = torch.empty(wgrad_of.shape[1], a.shape[1], dtype=self.dtype, device=self.device)
            call.g, call.result = wgrad_of, grad
            addresses += (wgrad_of.data_ptr(), wgrad_of.stride(), grad.data_ptr())
        if self.fp8:  # quantised once for all the chunk GEMMs (a kernel on the current stream)
            call.a_fp8, call.w_fp8 = quantize_activation(a), self._weights.get(w.t())
            addresses += tuple(t.data_ptr() for pair in (call.a_fp8, call.w_fp8) for t in pair)
        key = RsPlanKey(m, schedule, wgrad_of is not None, work is not None, check is not None, a.shape[1],
                        not w.is_contiguous())
        if schedule == "compute":
            self._run_alone(key, m, call)
            return out
        self._launch(self._plans.get(key) or self._plan(key, m), call, None if work is not None else addresses)
        if schedule in ("op", "compute") and wgrad_of is None:
            return out
        return out, call.result

    def _slots(self, rank: int, rows: int) -> torch.Tensor:
        """[W, rows, N] view of `rank`'s slots (the contiguous prefix of its region)."""
        flat = self.pool.peer(self.flags.region, rank)
        return flat[:self.world_size * rows * self.n].view(self.world_size, rows, self.n)

    # ----- plans ---------------------------------------------------------------------------------------
    def _build(self, key, config) -> Program:
        m, schedule, wgrad, check = key.m, key.schedule, key.wgrad, key.check
        if schedule == "op":
            schedule = config.method
            if schedule == "epilogue_reduce" and (m // self.world_size) % ROW_BLOCK_M:
                raise OpInputError(f"{self.name}: method epilogue_reduce needs M/W % {ROW_BLOCK_M} == 0 (its own "
                                   f"row blocks may not straddle owners); M = {m}, W = {self.world_size}. Use a "
                                   f"by_m bucket with another method for this M")
        program = Program(self.pool, op=self.name)
        if check:
            program.run(COMPUTE, self._check_stamp)
        build = {"fused": self._fused, "epilogue_reduce": self._epilogue_reduce, "decomposed": self._decomposed,
                 "pair": self._pair, "bulk": self._bulk, "comm_only": self._comm_only,
                 "compute": self._compute}[schedule]
        build(program, key, config)
        if wgrad and schedule != "bulk":
            program.run(COMPUTE, _wgrad, local=True)
        return program

    def _check_stamp(self, call) -> None:
        stamp, version, code = call.check
        self.pool.record_failure_if(stamp.ne(version), code)

    def _peers(self) -> list[int]:
        return self.owners()[:-1]

    def _take_free(self, program: Program, lane: str) -> None:
        for owner in self._peers():
            program.take(lane, self.flags.free(owner), peer=owner)

    def _give_free(self, program: Program, lane: str) -> None:
        for source in self._peers():
            program.give(lane, self.flags.free(self.rank), source)

    def _used_row_flags(self, rows: int) -> torch.Tensor:
        """The device flags a call of `rows` rows per rank sets on this owner, [W, used] (for the host driver)."""
        used = ((self.rank + 1) * rows - 1) // ROW_BLOCK_M - (self.rank * rows) // ROW_BLOCK_M + 1
        return self.row_flags.view(self.world_size, self.flags_per_source)[:, :used]

    def _fused(self, program: Program, key: RsPlanKey, config) -> None:
        m, rows = key.m, key.m // self.world_size
        programs = self.num_sms - config.sm_margin
        self._take_free(program, COMPUTE)
        offset = ((self.rank + 1) % self.world_size) * rows // ROW_BLOCK_M  # owners interleave across ranks
        program.run(COMPUTE, self._scatter_gemm(key, programs, offset))
        if not self._cuda:
            program.await_device(REDUCE, self._used_row_flags(rows), value=m,
                                 code=self.pool.device_error_code(self.flags.region, 0))
        program.run(REDUCE, lambda call: self._reduce(call.out, m, config, wait=True))
        program.clear(REDUCE, self.row_flags)
        self._give_free(program, REDUCE)

    def _epilogue_reduce(self, program: Program, key: RsPlanKey, config) -> None:
        programs = self.num_sms - config.sm_margin
        self._take_free(program, COMPUTE)
        program.run(COMPUTE, self._reduce_gemm(key, programs))
        program.clear(COMPUTE, self.row_flags)
        self._give_free(program, COMPUTE)

    def _reduce(self, out: torch.Tensor, m: int, config, *, wait: bool) -> None:
        rows = m // self.world_size
        launch_reduce(partials=self._slots(self.rank, rows), out=out, flags=self.row_flags,
                      error_words=self.pool.error_words(),
                      error_code_base=self.pool.device_error_code(self.flags.region, 0), rows_per_rank=rows,
                      world_size=self.world_size, flags_per_source=self.flags_per_source, gemm_block_m=ROW_BLOCK_M,
                      owner_rank=self.rank, num_programs=max(1, config.num_comm_sms), wait=wait,
                      timeout_s=self.timeout_s)

    def _push(self, program: Program, owner: int, m: int, source) -> None:
        """Copy-engine push of this rank's partial of `owner`'s rows into owner's slot, then pushed[me] = M."""
        program.take(COMM, self.flags.free(owner), peer=owner)
        program.copy(COMM, self._slots(owner, m // self.world_size)[self.rank], source)
        program.give(COMM, self.flags.pushed(self.rank), owner, value=m)

    def _take_pushed(self, program: Program, lane: str, m: int) -> None:
        for source in self._peers():
            program.take(lane, self.flags.pushed(source), peer=source, value=m)

    def _decomposed(self, program: Program, key: RsPlanKey, config) -> None:
        m, rows = key.m, key.m // self.world_size
        margin = config.sm_margin
        for owner in self.owners():
            lo = owner * rows
            if owner == self.rank:
                own = self._slots(owner, rows)[self.rank]
                program.run(COMPUTE, self._mm_into(lo, rows, lambda call: own, margin), local=True)
                program.record(COMPUTE, "own")
                continue
            staged = self._staging[lo:lo + rows]
            program.run(COMPUTE, self._mm_into(lo, rows, lambda call, s=staged: s, margin))
            program.record(COMPUTE, f"staged{owner}")
            program.after(COMM, f"staged{owner}")
            self._push(program, owner, m, staged)
        self._take_pushed(program, REDUCE, m)
        program.after(REDUCE, "own")
        program.run(REDUCE, lambda call: self._reduce(call.out, m, config, wait=False), local=True)
        self._give_free(program, REDUCE)

    def _pair(self, program: Program, key: RsPlanKey, config) -> None:
        m, rows = key.m, key.m // self.world_size
        peer, margin = 1 - self.rank, config.sm_margin
        staged = self._staging[:rows]
        program.run(COMPUTE, self._mm_into(peer * rows, rows, lambda call: staged, margin))
        program.record(COMPUTE, "staged")
        program.after(COMM, "staged")
        self._push(program, peer, m, staged)
        program.run(COMPUTE, self._mm_into(self.rank * rows, rows, lambda call: call.out, margin), local=True)
        program.take(COMPUTE, self.flags.pushed(peer), peer=peer, value=m)
        slot = self._slots(self.rank, rows)[peer]
        program.run(COMPUTE, lambda call: call.out.add_(slot), local=True)
        self._give_free(program, COMPUTE)

    def _bulk(self, program: Program, key: RsPlanKey, config) -> None:
        m, rows = key.m, key.m // self.world_size
        staged = self._bulk_staging[:m]
        program.run(COMPUTE, self._mm_into(0, m, lambda call: staged, 0))
        program.record(COMPUTE, "staged")
        program.after(COMM, "staged")
        for owner in self._peers():
            self._push(program, owner, m, self._bulk_staging[owner * rows:(owner + 1) * rows])
        program.run(COMPUTE, _bulk_work, local=True)  # the caller's work (or the weight grad): this rank's only
        self._take_pushed(program, COMPUTE, m)
        own, slots = self._bulk_staging[self.rank * rows:(self.rank + 1) * rows], self._slots(self.rank, rows)
        others = [slots[s] for s in self._peers()]
        program.run(COMPUTE, lambda call: _sum_into(call.out, own, others), local=True)
        self._give_free(program, COMPUTE)

    def _compute(self, program: Program, key: RsPlanKey, config) -> None:
        rows = key.m // self.world_size
        if config.method in STAGED_METHODS:
            owners = [1 - self.rank, self.rank] if config.method == "pair" else self.owners()
            for owner in owners:
                lo = owner * rows
                program.run(COMPUTE, self._mm_into(lo, rows, lambda call, lo=lo: call.out[lo:lo + rows],
                                                   config.sm_margin), local=True)
            return
        program.run(COMPUTE, self._local_gemm(key, self.num_sms - config.sm_margin, config.method), local=True)

    def _comm_only(self, program: Program, key: RsPlanKey, config) -> None:
        m, rows = key.m, key.m // self.world_size
        own = self._slots(self.rank, rows)[self.rank]
        program.copy(COMPUTE, own, lambda call: call.partials[self.rank * rows:(self.rank + 1) * rows])
        program.record(COMPUTE, "own")
        for owner in self._peers():
            self._push(program, owner, m, lambda call, o=owner: call.partials[o * rows:(o + 1) * rows])
        self._take_pushed(program, REDUCE, m)
        program.after(REDUCE, "own")
        program.run(REDUCE, lambda call: self._reduce(call.out, m, config, wait=False), local=True)
        self._give_free(program, REDUCE)

    def _release(self) -> None:
        self.partials = self.row_flags = self._staging = self._bulk_staging = self._tables = None

    def _mm_into(self, lo: int, rows: int, dst, margin: int):
        """A GEMM step: dst(call) = a[lo:lo + rows] @ w (cuBLAS on num_sms - margin SMs; fp8: the FP8 GEMM on
        the rows quantised at the call's start, bf16 out)."""
        if self.fp8:
            def mm_fp8(call) -> None:
                (a8, a_scales), (w8, w_scales) = call.a_fp8, call.w_fp8
                fp8_gemm(a8=a8[lo:lo + rows], a_scales=a_scales[lo:lo + rows], w8=w8, w_scales=w_scales, out=dst(call))
            return mm_fp8

        def mm(call) -> None:
            with sm_carveout(margin):
                torch.mm(call.a[lo:lo + rows], call.w, out=dst(call))
        return mm


def _wgrad(call) -> None:
    torch.mm(call.g.t(), call.a, out=call.result)


def _bulk_work(call) -> None:
    if call.work is None:
        return _wgrad(call)
    call.result = call.work()


def _sum_into(out: torch.Tensor, own: torch.Tensor, others: list[torch.Tensor]) -> None:
    if len(others) == 1:
        torch.add(own, others[0], out=out)
        return
    total = own.float()
    for other in others:
        total += other
    out.copy_(total)
