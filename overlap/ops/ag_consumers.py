"""The consumer side of an AgGemm plan: the steps that read the gathered rows. `decomposed`: cuBLAS GEMMs in
the order of `plan_consumer_gemms`, each after the arrival of the rows it reads; `fused`: one persistent
GEMM whose tiles wait for their chunk's device flag (on a GPU the Gluon kernel, its waiter warp polling);
the weight-grad GEMMs of a row layer's backward. A mixin of AgGemm (it reads the op's pool views, flags and
configuration)."""

from __future__ import annotations

import dataclasses

import torch

from tp_overlap.kernels.constants import ag_tile_row_offset

from ..gemm import ChunkWait, choose_blocks, fp8_gemm, launch_gemm, sm_carveout
from ..gemm.fused_blocks import fused_gluon_blocks
from ..gemm.fp8 import choose_fp8_blocks, fp8_default_blocks
from ..gemm.fp8_gluon_launch import (gluon_operand_problems as fp8_operand_problems, launch_fp8_gluon_gemm,
                                     splits_tail)
from ..gemm.gluon_launch import gluon_operand_problems, launch_gluon_gemm
from ..gemm.launch import b_operand
from .ag_chunks import ConsumerGemm, plan_consumer_gemms
from .program import COMPUTE, Program

__all__ = ["AgConsumers", "consumer_gluon_blocks", "consumer_fp8_blocks"]


def consumer_gluon_blocks(m: int, n: int, k: int, *, b_transposed: bool, gpu: str | None, programs: int):
    """The Gluon blocks of the bf16 `fused` consumer (and of its `compute_alone`): the table's entry, its split
    tail (`sk1`) kept (the op owns the buffers: `fused_gluon_blocks(split_tail=True)`)."""
    return fused_gluon_blocks(m, n, k, b_transposed=b_transposed, gpu=gpu, sm_count=programs, split_tail=True)


def consumer_fp8_blocks(m: int, n: int, k: int, *, device_type: str, gpu: str | None):
    """The blocks of the FP8 `fused` consumer (and of its `compute_alone`) where TMA reads the operands: the FP8
    table's choice (`fp8_default_blocks` with chunk waits), a Gluon one with a split tail (the op owns the
    buffers; `split_plan` keeps whole tiles where cutting does not pay) unless 256 wide (whole tiles only)."""
    blocks = fp8_default_blocks(m, n, k, chunk_wait=True, device_type=device_type, gpu=gpu)
    return dataclasses.replace(blocks, stream_k=1) if blocks.gluon and splits_tail(blocks.block_n) else blocks


class AgConsumers:
    """Consumer steps of AgGemm's plans (see the module docstring)."""

    def _decomposed_consumer(self, program: Program, m: int, chunks, config, *, one_gemm: bool, lead: bool,
                             waits: bool = True) -> None:
        if lead:
            program.run(COMPUTE, lambda call: _with_carveout(config.sm_margin, call.lead), local=True)
        gemms = plan_consumer_gemms(rank=self.rank, world_size=self.world_size, m=m,
                                    chunks_per_rank=config.chunks_per_rank, lead_fraction=config.lead_fraction,
                                    one_gemm=one_gemm)
        for gemm in gemms:
            if not waits:
                pass
            elif gemm.wait == len(chunks):  # rows from the pool: every pull and the local slot
                program.after(COMPUTE, "gathered")
            elif gemm.wait >= 0:
                program.after(COMPUTE, f"chunk{gemm.wait}")
            program.run(COMPUTE, self._mm(gemm, m, config.sm_margin), local=True)  # writes out only

    def _mm(self, gemm: ConsumerGemm, m: int, margin: int):
        lo, count = gemm.first_row, gemm.num_rows
        local = gemm.wait < 0  # this rank's rows: straight from a_shard, no wait
        first = lo - self.rank * (m // self.world_size)
        gathered = self.gathered[lo:lo + count]
        if self.fp8:  # every row from the pool (the local ones were quantised into the slot)
            scales = self.scales[lo:lo + count]

            def mm_fp8(call) -> None:
                w8, w_scales = call.w_fp8
                fp8_gemm(a8=gathered, a_scales=scales, w8=w8, w_scales=w_scales, out=call.out[lo:lo + count])
            return mm_fp8

        def mm(call) -> None:
            a = call.a_shard[first:first + count] if local else gathered
            with sm_carveout(margin):
                torch.mm(a, call.w, out=call.out[lo:lo + count])
        return mm

    def _fused_consumer(self, program: Program, key, chunks, config, *, lead: bool) -> None:
        """Ranks sharing one GPU pull each other's rows by same-device copies, which run on SMs: a consumer
        holding every SM (a Gluon program takes a whole one) would poll for rows whose copy cannot start, so
        there it leaves at least one SM free."""
        m = key.m
        rows = m // self.world_size
        programs = self.num_sms - max(config.sm_margin, int(self.pool.shares_gpu))
        flags = self._present_flags if key.consumer == "compute" else self.chunk_flags  # compute_alone: all SET
        wait = ChunkWait(flags=flags, rows_per_rank=rows, chunks_per_rank=config.chunks_per_rank,
                         error_words=self.pool.error_words(),
                         error_code_base=self.pool.device_error_code(self.flags.region, 0), timeout_s=self.timeout_s)
        if not self._cuda:  # the interpreter polls a flag once: the host waits for every chunk first
            code = self.pool.device_error_code(self.flags.region, 0)
            for chunk in chunks:  # the planned ones: an owner's empty trailing chunk has no flag write
                program.await_device(COMPUTE, flags[chunk.flag_index:chunk.flag_index + 1], code=code)
        if lead:
            program.run(COMPUTE, lambda call: _with_carveout(config.sm_margin, call.lead), local=True)
        gathered = self.gathered[:m]
        if self.fp8:
            gemm = self._fused_fp8(key, gathered, programs, wait)
        else:
            gemm = self._fused_bf16(key, gathered, programs, wait)
        program.run(COMPUTE, gemm, local=True)  # reads the chunk flags, writes out only (the next call clears them)

    def _fused_fp8(self, key, gathered: torch.Tensor, programs: int, wait: ChunkWait):
        """The FP8 fused consumer: the Gluon FP8 GEMM (`consumer_fp8_blocks`, its waiter warp polling) where TMA
        reads the call's operands (checked per call: the weight and out are the call's), else the table's plain
        blocks (and on the interpreter)."""
        m, rows = key.m, key.m // self.world_size
        scales = self.scales[:m]
        blocks = consumer_fp8_blocks(m, key.n, self.k, device_type=self.device.type, gpu=self.gpu)
        plain = choose_fp8_blocks(m, key.n, self.k, warp_specialize=False, device_type=self.device.type, gpu=self.gpu)
        offset = ag_tile_row_offset(self.rank, rows, blocks.block_m)
        plain_offset = ag_tile_row_offset(self.rank, rows, plain.block_m)
        buffers = self._alone_buffers() if key.consumer == "compute" and blocks.gluon else self._split_buffers

        def gemm(call) -> None:
            w8, w_scales = call.w_fp8
            if blocks.gluon and not fp8_operand_problems(a8=gathered, a_scales=scales, w8=w8, w_scales=w_scales,
                                                         out=call.out):
                launch_fp8_gluon_gemm(a8=gathered, a_scales=scales, w8=w8, w_scales=w_scales, out=call.out,
                                      blocks=blocks, num_programs=programs, checked=True, tile_row_offset=offset,
                                      chunk_wait=wait, split_buffers=buffers)
            else:
                fp8_gemm(a8=gathered, a_scales=scales, w8=w8, w_scales=w_scales, out=call.out, num_programs=programs,
                         chunk_wait=wait, blocks=plain, tile_row_offset=plain_offset)
        return gemm

    def _fused_bf16(self, key, gathered: torch.Tensor, programs: int, wait: ChunkWait):
        """The bf16 / fp16 fused consumer: on a GPU, the Gluon GEMM whose waiter warp polls the chunks
        (`fused_gluon_blocks`); the plain @triton.jit GEMM for the interpreter, or for operands TMA cannot read
        (checked per call: w and out are the call's)."""
        m, rows = key.m, key.m // self.world_size
        plain = choose_blocks(m, key.n, self.k, b_transposed=key.b_transposed, gpu=self.gpu,
                              device_type=self.device.type, warp_specialize=False, sm_count=programs)
        plain_offset = ag_tile_row_offset(self.rank, rows, plain.block_m)
        if not self._cuda:
            return lambda call: launch_gemm(a=gathered, w=call.w, out=call.out, num_programs=programs, blocks=plain,
                                            tile_row_offset=plain_offset, chunk_wait=wait)
        blocks = consumer_gluon_blocks(m, key.n, self.k, b_transposed=key.b_transposed, gpu=self.gpu,
                                       programs=programs)
        offset = ag_tile_row_offset(self.rank, rows, blocks.block_m)
        # compute_alone may run beside a call (the k-factor's pair mode): its split tail has buffers of its own
        buffers = self._alone_buffers() if key.consumer == "compute" else self._split_buffers

        def gemm(call) -> None:
            b, _, b_transposed = b_operand(call.w)
            if gluon_operand_problems(gathered, b, call.out):
                launch_gemm(a=gathered, w=call.w, out=call.out, num_programs=programs, blocks=plain,
                            tile_row_offset=plain_offset, chunk_wait=wait)
            else:
                launch_gluon_gemm(a=gathered, b=b, b_transposed=b_transposed, out=call.out, blocks=blocks,
                                  num_programs=programs, tile_row_offset=offset, chunk_wait=wait, split_buffers=buffers)
        return gemm

    def _lead_wgrad(self, program: Program, m: int, rows: int, margin: int) -> None:
        """grad = x[own rows]^T @ a_shard, before the GEMM over the gathered rows (overlaps the pulls)."""
        lo = self.rank * rows

        def lead(call) -> None:
            with sm_carveout(margin):
                torch.mm(call.x[lo:lo + rows].t(), call.a_shard, out=call.grad)
        program.run(COMPUTE, lead, local=True)

    def _wgrad_rest(self, program: Program, m: int, rows: int, *, lead: bool) -> None:
        """grad (+)= x[other rows]^T @ gathered[other rows] (bf16; fp8: the dequantised gathered rows)."""
        lo = self.rank * rows
        others = [(first, end) for first, end in ((0, lo), (lo + rows, m)) if end > first]

        def rest(call) -> None:
            full, x, grad = self.gathered_bf16(m), call.x, call.grad
            if not lead:
                torch.mm(x.t(), full, out=grad)
                return
            for first, end in others:  # onto the lead's result in the GEMM epilogue (beta = 1, no extra pass)
                grad.addmm_(x[first:end].t(), full[first:end])
        program.run(COMPUTE, rest, local=True)


def _with_carveout(margin: int, work) -> None:
    with sm_carveout(margin):
        work()
