"""The scatter GEMMs of a GemmRs plan (`fused`, `epilogue_reduce`, `compute_alone` of both): their blocks,
their `Scatter` record and, on a GPU, the Gluon kernels (kernels/gemm_gluon_scatter.py for `fused`,
gemm_gluon_reduce.py for `epilogue_reduce`) where the operands allow TMA, else the @triton.jit GEMM's
EPILOGUE_SCATTER / EPILOGUE_SCATTER_REDUCE. A mixin of GemmRs (it reads the op's pool tables, counters and
configuration)."""

from __future__ import annotations

import dataclasses

from tp_overlap.kernels.constants import EPILOGUE_SCATTER, EPILOGUE_SCATTER_REDUCE, ROW_BLOCK_M

from ..gemm import Scatter, choose_blocks, launch_gemm
from ..gemm.fused_blocks import fused_gluon_blocks
from ..gemm.gluon_launch import (gluon_operand_problems, launch_gluon_gemm, launch_gluon_scatter,
                                 launch_gluon_scatter_reduce, reduce_descriptors, scatter_descriptors)
from ..gemm.launch import b_operand, tma_row_problems

__all__ = ["RsScatterGemms", "scatter_gluon_blocks", "reduce_gluon_blocks"]


def scatter_gluon_blocks(m: int, n: int, k: int, *, b_transposed: bool, gpu: str | None, programs: int):
    """The Gluon blocks of the `fused` scatter GEMM (and of its `compute_alone`): 128-row tiles (a row-block
    flag each) and a split tail where it pays (`fused_gluon_blocks(split_tail=True)`: an sm_margin leaves the
    last wave of the table's tiles partial; on an H100 at M = 1024, 128x128 tiles on 116 programs ran at
    0.79-0.87 of cuBLASLt under the same carve-out whole, 0.79-0.97 with the tail split), or tiles two B boxes
    wide where they fill whole waves that much sooner (`boxes`: kernels/gemm_gluon_scatter_boxes.py)."""
    return fused_gluon_blocks(m, n, k, b_transposed=b_transposed, gpu=gpu, sm_count=programs, block_m=ROW_BLOCK_M,
                              split_tail=True, boxes=True)


def reduce_gluon_blocks(m: int, n: int, k: int, *, b_transposed: bool, gpu: str | None, programs: int):
    """The Gluon blocks of the `epilogue_reduce` GEMM (and of its `compute_alone`): as the scatter GEMM's, every
    tile whole (its own rows wait for the other sources: no split tail)."""
    return fused_gluon_blocks(m, n, k, b_transposed=b_transposed, gpu=gpu, sm_count=programs, block_m=ROW_BLOCK_M)


class RsScatterGemms:
    """GemmRs's scatter GEMMs (see the module docstring)."""

    def _scatter(self, m: int) -> Scatter:
        return Scatter(dst_ptrs=self._tables[0], flag_ptrs=self._tables[1], tile_counters=self._tile_counters,
                       rows_per_rank=m // self.world_size, src_rank=self.rank, flags_per_source=self.flags_per_source,
                       error_words=self.pool.error_words(),
                       error_code_base=self.pool.device_error_code(self.flags.region, 0), timeout_s=self.timeout_s)

    def _gemm_blocks(self, key, programs: int):
        """The @triton.jit GEMM's blocks: the plain entry, 128-row tiles (one row-block flag each)."""
        blocks = choose_blocks(key.m, self.n, key.k, b_transposed=key.b_transposed, gpu=self.gpu,
                               device_type=self.device.type, warp_specialize=False, sm_count=programs)
        return dataclasses.replace(blocks, block_m=ROW_BLOCK_M)

    def _local_gemm(self, key, programs: int, method: str):
        """`compute_alone`'s step: the method's GEMM kernel, blocks and programs with a local store into out."""
        plain = self._gemm_blocks(key, programs)

        def run_plain(call) -> None:
            launch_gemm(a=call.a, w=call.w, out=call.out, num_programs=programs, blocks=plain)
        if not self._cuda or method not in ("fused", "epilogue_reduce"):
            return run_plain
        if method == "fused":
            blocks, buffers = self._gluon_blocks(key, programs), self._alone_buffers()
        else:
            blocks, buffers = reduce_gluon_blocks(key.m, self.n, key.k, b_transposed=key.b_transposed, gpu=self.gpu,
                                                  programs=programs), None

        def run(call) -> None:
            b, _, b_transposed = b_operand(call.w)
            if gluon_operand_problems(call.a, b, call.out):
                run_plain(call)
            else:
                launch_gluon_gemm(a=call.a, b=b, b_transposed=b_transposed, out=call.out, blocks=blocks,
                                  num_programs=programs, split_buffers=buffers)
        return run

    def _gluon_blocks(self, key, programs: int):
        return scatter_gluon_blocks(key.m, self.n, key.k, b_transposed=key.b_transposed, gpu=self.gpu,
                                    programs=programs)

    def _scatter_gemm(self, key, programs: int, offset: int):
        """The fused plan's GEMM step: call -> a @ w stored into the owners' slots, row blocks published. On a GPU
        the Gluon kernel (`fused_gluon_blocks`, 128-row tiles) when TMA can write every slab (checked once) and
        read the call's operands (checked per call); else the @triton.jit GEMM."""
        m, rows = key.m, key.m // self.world_size
        scatter, plain = self._scatter(m), self._gemm_blocks(key, programs)
        own = self._slots(self.rank, rows)[0]

        def run_plain(call) -> None:
            launch_gemm(a=call.a, w=call.w, out=own, num_programs=programs, blocks=plain, epilogue=EPILOGUE_SCATTER,
                        tile_row_offset=offset, scatter=scatter)
        if not self._cuda:
            return run_plain
        blocks = self._gluon_blocks(key, programs)
        descriptors = scatter_descriptors([self._slots(owner, rows)[self.rank] for owner in range(self.world_size)],
                                          blocks)
        if descriptors is None:
            return run_plain

        def run(call) -> None:
            if tma_row_problems((("a", call.a), ("w", b_operand(call.w)[0]))):
                run_plain(call)
            else:
                launch_gluon_scatter(a=call.a, w=call.w, descriptors=descriptors, scatter=scatter, blocks=blocks,
                                     num_programs=programs, tile_row_offset=offset, split_buffers=self._split_buffers)
        return run

    def _reduce_gemm(self, key, programs: int):
        """The epilogue_reduce plan's GEMM step: call -> the other owners' rows of a @ w scattered and published,
        the own rows summed over every source into call.out. On a GPU the Gluon kernel (`reduce_gluon_blocks`)
        when TMA can write every slab and read the own slots (checked once) and read the call's operands and
        write its out (checked per call); else the @triton.jit GEMM's EPILOGUE_SCATTER_REDUCE."""
        rows = key.m // self.world_size
        scatter, plain = self._scatter(key.m), self._gemm_blocks(key, programs)

        def run_plain(call) -> None:
            launch_gemm(a=call.a, w=call.w, out=call.out, num_programs=programs, blocks=plain,
                        epilogue=EPILOGUE_SCATTER_REDUCE, scatter=scatter)
        if not self._cuda or not key.k:
            return run_plain
        blocks = reduce_gluon_blocks(key.m, self.n, key.k, b_transposed=key.b_transposed, gpu=self.gpu,
                                     programs=programs)
        descriptors = scatter_descriptors([self._slots(owner, rows)[self.rank] for owner in range(self.world_size)],
                                          blocks)
        own = reduce_descriptors(self._slots(self.rank, rows), blocks)
        if descriptors is None or own is None:
            return run_plain

        def run(call) -> None:
            if gluon_operand_problems(call.a, b_operand(call.w)[0], call.out):  # dtypes, TMA rows
                run_plain(call)
            else:
                launch_gluon_scatter_reduce(a=call.a, w=call.w, out=call.out, descriptors=descriptors,
                                            own_descriptor=own, scatter=scatter, blocks=blocks, num_programs=programs)
        return run
