"""AllGather + GEMM: `out = all_gather(a_shard) @ w`, the gather on the copy engine, overlapped.

Shapes: a_shard [M/W, K], w [K, N_local] (row-major, or `weight.t()` of a row-major [N_local, K]),
out [M, N_local]; M <= max_m, M % W == 0. `n_local=None` lets each call bring its own width (one op shared
by layers of different widths: the regions do not depend on it; each width gets its own plans). Pool region
`<name>.a` [max_m, K]: this rank's rows of it are its published slot, the other rows receive the peers' rows.

The plan of one call (protocol.py has the flags; the same stream operations eager, replayed or captured):
  compute (prologue): wait until every peer pulled this rank's rows of the last call (consumed, a memory-
           operation wait), copy a_shard into the slot (skipped when the caller wrote `input_slot`), write
           M into ready on every peer;
  comm (side stream, high priority): for owner rank+1, rank+2, ...: wait until ready[owner] holds M, pull
           its rows with the copy engine in `chunks_per_rank` pieces (each followed by its arrival event or
           device flag), then raise consumed on the owner;
  consumer (compute): `decomposed` = cuBLAS GEMMs in the order of `plan_consumer_gemms`, each waiting only
           for the rows it reads (the local rows read a_shard and wait for nothing); `fused` = one persistent
           Triton GEMM whose tiles wait for their chunk's device flag (tiles in arrival order); with a weight
           grad (`wgrad_of=x`, a row layer's backward) also x^T @ gathered, its local rows first when
           `lead_wgrad` (they overlap the pulls); `all_gather` runs no consumer.
No wait of the comm path needs an SM, so the copy engine starts while the consumer's GEMM holds every SM.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tp_overlap.symm_mem.regions import RegionSpec

from ..gemm import Fp8WeightCache, dequantize_activation, launch_quantize_activation, num_sms, scale_groups
from ..gemm.fp8 import SCALE_ROW_ALIGN
from ..gemm.gluon_launch import gluon_placeholders, split_buffers
from . import protocol
from .ag_chunks import Chunk, ConsumerGemm, plan_chunks, plan_consumer_gemms
from .protocol import ring_order
from .ag_consumers import AgConsumers
from .base import OpBase
from .calls import AgCall, AgPlanKey
from .validate import OpInputError, check_method_runs, check_tensor
from ..config.schema import AgGemmConfig
from .program import COMPUTE, Program

__all__ = ["AgGemm", "Chunk", "ConsumerGemm"]

COMM = "comm"



class AgGemm(AgConsumers, OpBase):
    """Op context built once per (group, pool, max_m, k, n_local, dtype, config); call it many times.
    `n_local=None`: any width per call.

    `config` is an AgGemmConfig, or an OpPreset of them (`by_m` buckets: each call runs the config of its M).
    Outputs are valid on the caller's current stream when the call returns (CUDA), or at once (CPU). The
    gathered `a` (`return_gathered=True`, `all_gather`) is a view into the pool, valid until the next call of
    this op (or its close); clone it to keep it longer. Any call may be captured in a CUDA graph and replayed.
    A `fused` config on a GPU allocates its consumer's split-tail buffers when built
    (gluon_launch.split_buffers: ~17 MB on 132 SMs; compute_alone another at its first call).
    """

    kind = "ag_gemm"

    def __init__(self, *, group: dist.ProcessGroup, pool, max_m: int, k: int, n_local: int | None, dtype: torch.dtype,
                 config: AgGemmConfig, name: str = "ag_gemm", fp8: bool = False):
        super().__init__(group=group, pool=pool, name=name, config=config, max_m=max_m,
                         static={"max_m": max_m, "k": k, "n_local": n_local, "dtype": str(dtype), "fp8": fp8})
        self.k, self.n_local, self.dtype, self.fp8 = k, n_local, dtype, bool(fp8)
        if fp8 and dtype != torch.bfloat16:
            raise OpInputError(f"{name}: fp8=True quantises bf16 activations; dtype is {dtype}")
        self.num_sms = num_sms(self.device)
        for cfg in self.configs():
            check_method_runs(name, cfg, self.device)
        self._agree()  # before any reservation: a disagreement must not shift the pool's layout
        chunks = max(cfg.chunks_per_rank for cfg in self.configs())
        self.flags = protocol.AgFlags(f"{name}.a", self.world_size, chunks)
        specs = self.regions(name=name, world_size=self.world_size, max_m=max_m, k=k, dtype=dtype,
                             chunks_per_rank=chunks, fp8=fp8)
        self.gathered, *scales = (self._reserve(spec) for spec in specs)
        # group-major [groups, max_m padded to 4] (as quantize_activation makes them): the Gluon FP8 GEMM reads
        # a group's 128 scales per TMA load (row-major scales cost it a quarter of its speed on an H100)
        self._scale_columns = scales[0] if fp8 else None
        self.scales = self._scale_columns.t()[:max_m] if fp8 else None  # [max_m, groups], strides (1, padded)
        if fp8:
            self._weights = Fp8WeightCache()   # of w.t(): w8 [N, K] for w [K, N]
        self._gathered_ptr = self.gathered.data_ptr()
        self._row_bytes = self.gathered.stride(0) * self.gathered.element_size()
        self.chunk_flags = pool.device_flags(self.flags.region)
        # compute_alone's chunk flags, every one SET for good: its GEMM polls flags that are present, as a call's
        # does once every chunk arrived, with no stream operation before it and nothing of a call's touched
        self._present_flags = torch.full_like(self.chunk_flags, protocol.SET)
        protocol.initialise(pool, self.flags)
        if self.device.type == "cuda":  # the fused GEMM's unused arguments: now, not inside a torch.compile warm-up
            gluon_placeholders(self.device)
        # the Gluon consumer's split tail (bf16: the table's `sk1`; FP8: its own): the calls' buffers, likewise
        # (compute_alone's at its first use)
        fused_gluon = self.device.type == "cuda" and any(c.method == "fused" for c in self.configs())
        self._split_buffers = split_buffers(self.device, self.num_sms) if fused_gluon else None
        self._alone_split_buffers = None
        # bumped by every call that stamps its gathered input (a column layer's forward): a backward that
        # reads the region later compares its stamp with it (custom_ops, save_gathered="view")
        self.version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._claimed: int | None = None  # rows per rank of an input_slot handed out and not yet used

    @staticmethod
    def regions(*, name: str, world_size: int, max_m: int, k: int, dtype: torch.dtype, chunks_per_rank: int,
                fp8: bool) -> list[RegionSpec]:
        """The pool regions an AgGemm reserves: the gathered rows [max_m, K] with the flags of
        `protocol.AgFlags`, and with fp8 their scales fp32 group-major [cdiv(K, 128), max_m rounded up to a
        multiple of 4] (a chunk's scales are pulled with its rows by one 2D copy)."""
        flags = protocol.AgFlags(f"{name}.a", world_size, chunks_per_rank)
        specs = [RegionSpec(flags.region, (max_m, k), torch.float8_e4m3fn if fp8 else dtype,
                            flags.num_signals, flags.num_device_flags)]
        if fp8:
            specs.append(RegionSpec(f"{name}.s", (scale_groups(k), -(-max_m // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN),
                                    torch.float32))
        return specs

    # ----- public --------------------------------------------------------------------------------------
    def input_slot(self, m: int) -> torch.Tensor:
        """[m/W, K] view where the next call expects this rank's shard; writing it there saves a copy.

        Enqueues, on the current stream, the wait until every peer has pulled this rank's rows of the last
        call (the slot may only be rewritten then); the next call must pass M = m (with the slot or any other
        tensor as a_shard).
        """
        self._check_live()
        self._check_m(m)
        if self.fp8:
            raise OpInputError(f"{self.name}: input_slot is not available with fp8=True (the slot holds the "
                               f"quantised shard, which the call writes itself)")
        if self._claimed is not None:
            raise OpInputError(f"{self.name}: input_slot({m}) while the slot of a previous input_slot call is "
                               f"still unused; call the op first")
        rows = m // self.world_size
        self._launch(self._plan(("claim", m), m), AgCall(), ())
        self._claimed = rows
        return self.gathered[self.rank * rows:(self.rank + 1) * rows]

    def __call__(self, a_shard: torch.Tensor, w: torch.Tensor, *, return_gathered: bool = False, lead=None,
                 wgrad_of: torch.Tensor | None = None, lead_wgrad: bool = False, stamp: torch.Tensor | None = None):
        """out [M, N_local] for a_shard [M/W, K], w [K, N_local].

        return_gathered: also the gathered a [M, K] (a pool view; fp8: (e4m3 rows, scales)).
        wgrad_of: x [M, J] -> returns (out, grad [J, K] = x^T @ gathered a) (a row layer's backward: x its
            input, a_shard its output grad); lead_wgrad: its GEMM over this rank's rows runs first, while the
            peers' rows are pulled, and the consumer is one GEMM over all M rows.
        stamp: an int64 [1] tensor on the device: receives this call's number in `version` (column layers).
        lead: a callable run once on the current stream before the GEMM over the gathered rows, reading only
            this rank's data (calls with one are enqueued step by step, never replayed).
        """
        self._check_operands("a_shard", a_shard, self.k, w, self.k, self.n_local)
        if wgrad_of is not None:
            check_tensor("wgrad_of", wgrad_of, dtype=self.dtype, device=self.device,
                         shape=(a_shard.shape[0] * self.world_size, None))
        return self._run(a_shard, w, return_gathered=return_gathered, lead=lead, wgrad_of=wgrad_of,
                         lead_wgrad=lead_wgrad, stamp=stamp)

    def _run(self, a_shard, w, *, return_gathered=False, lead=None, wgrad_of=None, lead_wgrad=False, stamp=None):
        """`__call__` for tensors a caller has validated already (the layers)."""
        m = a_shard.shape[0] * self.world_size
        call, addresses = self._new_call(m, a_shard, w)
        call.lead, call.stamp, out = lead, stamp, call.out
        if wgrad_of is not None:
            grad = torch.empty(wgrad_of.shape[1], self.k, dtype=self.dtype, device=self.device)
            call.x, call.grad = wgrad_of, grad
            addresses += (wgrad_of.data_ptr(), wgrad_of.stride(), grad.data_ptr())
        if stamp is not None:
            addresses += (stamp.data_ptr(),)
        wgrad = None if wgrad_of is None else ("lead" if lead_wgrad else "after")
        self._call(m, "op", call, None if lead is not None else addresses,
                   wgrad=wgrad, lead=lead is not None, stamp=stamp is not None)
        if wgrad_of is not None:
            return out, call.grad
        if not return_gathered:
            return out
        return out, (self.gathered[:m], self.scales[:m]) if self.fp8 else self.gathered[:m]

    def gathered_bf16(self, m: int) -> torch.Tensor:
        """The gathered a [m, K] of the last call as bf16 (fp8=True: dequantised, a new tensor; else the pool
        view itself), on the current stream."""
        self._check_live()
        if not self.fp8:
            return self.gathered[:m]
        return dequantize_activation(self.gathered[:m], self.scales[:m]).to(torch.bfloat16)

    def all_gather(self, a_shard: torch.Tensor) -> torch.Tensor:
        """The same schedule with no consumer: returns the gathered a [M, K] (a pool view, see above; fp8: the
        pair (e4m3 rows, scales)). The "comm alone" of the k-factor and the benchmarks."""
        self._check_live()
        check_tensor("a_shard", a_shard, dtype=self.dtype, device=self.device, shape=(None, self.k))
        m = a_shard.shape[0] * self.world_size
        self._call(m, "none", AgCall(a_shard=a_shard), (a_shard.data_ptr(),))
        return (self.gathered[:m], self.scales[:m]) if self.fp8 else self.gathered[:m]

    def compute_alone(self, a_shard: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """out [M, N_local]: this op's plan for M = W x a_shard's rows without its comm lanes (no pulls, no
        control flag): the same consumer GEMMs (kernel, blocks, SM budget, chunk order; the fused kernel polls
        chunk flags of its own, all SET) over the rows that the last `all_gather(a_shard)` left in the pool;
        call that first. The "compute alone" of the k-factor."""
        self._check_operands("a_shard", a_shard, self.k, w, self.k, self.n_local)
        m = a_shard.shape[0] * self.world_size
        call, _ = self._new_call(m, a_shard, w)
        self._run_alone(AgPlanKey(m, "compute", None, False, False, False, False, w.shape[1], not w.is_contiguous()),
                        m, call)
        return call.out

    def _new_call(self, m: int, a_shard: torch.Tensor, w: torch.Tensor) -> tuple[AgCall, tuple]:
        """A call's tensors with a fresh out [M, N_local] (and w's FP8 form), and the addresses that key its
        CUDA-graph replay."""
        call = AgCall(a_shard=a_shard, w=w, out=torch.empty(m, w.shape[1], dtype=self.dtype, device=self.device))
        addresses = (a_shard.data_ptr(), w.data_ptr(), w.stride(0), call.out.data_ptr())
        if self.fp8:
            call.w_fp8 = w8 = self._weights.get(w.t())
            addresses += (w8[0].data_ptr(), w8[1].data_ptr())
        return call, addresses

    def chunks(self, m: int) -> list[Chunk]:
        """Chunks in arrival order: the local rank's first, then ring order rank+1, rank+2, ..."""
        return plan_chunks(rank=self.rank, world_size=self.world_size, m=m,
                           chunks_per_rank=self.config_for(m).chunks_per_rank)

    def consumer_gemms(self, m: int, *, one_gemm: bool = False) -> list[ConsumerGemm]:
        """The decomposed consumer's GEMMs in issue order (`plan_consumer_gemms`)."""
        config = self.config_for(m)
        return plan_consumer_gemms(rank=self.rank, world_size=self.world_size, m=m,
                                   chunks_per_rank=config.chunks_per_rank, lead_fraction=config.lead_fraction,
                                   one_gemm=one_gemm)

    # ----- one call ------------------------------------------------------------------------------------
    def _call(self, m: int, consumer: str, call: AgCall, addresses, *, wgrad=None, lead=False, stamp=False) -> None:
        rows = m // self.world_size
        claimed = self._claimed is not None
        if claimed and self._claimed != rows:
            raise OpInputError(f"{self.name}: input_slot was taken for {self._claimed * self.world_size} rows, "
                               f"this call has M = {m}")
        zero_copy = call.a_shard.data_ptr() == self._gathered_ptr + self.rank * rows * self._row_bytes
        n = 0 if call.w is None else call.w.shape[1]
        transposed = call.w is not None and not call.w.is_contiguous()
        key = AgPlanKey(m, consumer, wgrad, lead, zero_copy, claimed, stamp, n, transposed)
        self._launch(self._plans.get(key) or self._plan(key, m), call, addresses)
        self._claimed = None

    def _build(self, key, config) -> Program:
        program = Program(self.pool, op=self.name)
        if key[0] == "claim":
            for peer in ring_order(self.rank, self.world_size):
                program.take(COMPUTE, self.flags.consumed(peer), peer=peer)
            return program
        m, consumer, wgrad, lead, zero_copy, claimed, stamp = key[:7]
        rows = m // self.world_size
        chunks = plan_chunks(rank=self.rank, world_size=self.world_size, m=m, chunks_per_rank=config.chunks_per_rank)
        if consumer == "compute":
            return self._compute(program, key, chunks, config)
        if consumer == "op":
            consumer = config.method
        fused = consumer == "fused"
        if fused:
            program.clear(COMPUTE, self.chunk_flags)
        self._publish(program, m, rows, chunks, zero_copy=zero_copy, claimed=claimed, fused=fused)
        self._pulls(program, m, chunks, fused=fused)
        one_gemm = lead or wgrad == "lead"   # the lead work takes the time the pulls run in
        if wgrad == "lead":
            self._lead_wgrad(program, m, rows, config.sm_margin)
        if fused:
            self._fused_consumer(program, key, chunks, config, lead=lead)
        elif consumer == "decomposed":
            self._decomposed_consumer(program, m, chunks, config, one_gemm=one_gemm, lead=lead)
        if wgrad is not None:
            program.after(COMPUTE, "gathered")
            self._wgrad_rest(program, m, rows, lead=wgrad == "lead")
        if stamp:
            program.after(COMPUTE, "gathered")
            program.run(COMPUTE, self._bump_version, local=True)
        return program

    def _compute(self, program: Program, key: AgPlanKey, chunks, config) -> Program:
        m = key.m
        if config.method == "fused":  # on flags that are all SET (`_present_flags`): its waits pass at once
            self._fused_consumer(program, key, chunks, config, lead=False)
        else:
            self._decomposed_consumer(program, m, chunks, config, one_gemm=False, lead=False, waits=False)
        return program

    def _bump_version(self, call) -> None:
        self.version.add_(1)
        call.stamp.copy_(self.version)

    def _publish(self, program: Program, m: int, rows: int, chunks, *, zero_copy: bool, claimed: bool,
                 fused: bool) -> None:
        # On the compute stream, before any GEMM: the copy runs on SMs (a same-device copy), so behind a GEMM
        # that holds them all the peers' ready flags would wait for the whole GEMM.
        if not claimed:
            for peer in ring_order(self.rank, self.world_size):
                program.take(COMPUTE, self.flags.consumed(peer), peer=peer)
        slot = self.gathered[self.rank * rows:(self.rank + 1) * rows]
        if self.fp8:  # quantised straight into the slot: e4m3 rows and their scales
            slot_scales = self.scales[self.rank * rows:(self.rank + 1) * rows]
            program.run(COMPUTE, lambda call: launch_quantize_activation(x=call.a_shard, q=slot, scales=slot_scales))
        elif not zero_copy:
            program.copy(COMPUTE, slot, lambda call: call.a_shard)
        if fused:
            for chunk in chunks:
                if chunk.owner == self.rank:
                    program.set(COMPUTE, self.chunk_flags[chunk.flag_index:chunk.flag_index + 1])
        program.record(COMPUTE, "published")
        for peer in ring_order(self.rank, self.world_size):
            program.give(COMPUTE, self.flags.ready(self.rank), peer, value=m)

    def _pulls(self, program: Program, m: int, chunks, *, fused: bool) -> None:
        previous_owner = None
        for i, chunk in enumerate(chunks):
            if chunk.owner == self.rank:
                continue
            if chunk.owner != previous_owner:
                if previous_owner is not None:
                    program.give(COMM, self.flags.consumed(self.rank), previous_owner)
                program.take(COMM, self.flags.ready(chunk.owner), peer=chunk.owner, value=m)
                previous_owner = chunk.owner
            source = self.pool.peer(self.flags.region, chunk.owner)
            lo, count = chunk.first_row, chunk.num_rows
            program.copy(COMM, self.gathered[lo:lo + count], source[lo:lo + count])
            if self.fp8:
                scales = self.pool.peer(f"{self.name}.s", chunk.owner)
                program.copy(COMM, self._scale_columns[:, lo:lo + count], scales[:, lo:lo + count])
            if fused:
                program.set(COMM, self.chunk_flags[chunk.flag_index:chunk.flag_index + 1])
            else:
                program.record(COMM, f"chunk{i}")
        if previous_owner is not None:
            program.give(COMM, self.flags.consumed(self.rank), previous_owner)
        program.record(COMM, "gathered")

    def _release(self) -> None:
        self.gathered = self.scales = self._scale_columns = self._present_flags = None
        self.chunk_flags = None
