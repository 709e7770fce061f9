"""The scatter GEMMs of a GemmRs plan (`fused`, `epilogue_reduce`, `compute_alone` of both): their blocks, their
`Scatter` record and the persistent @triton.jit GEMM with EPILOGUE_SCATTER. A mixin of GemmRs (it reads the
op's pool tables, counters and configuration)."""

from __future__ import annotations

import dataclasses

from tp_overlap.kernels.constants import EPILOGUE_SCATTER, ROW_BLOCK_M

from ..gemm import Scatter, choose_blocks, launch_gemm

__all__ = ["RsScatterGemms"]


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

    def _local_gemm(self, key, programs: int):
        """`compute_alone`'s step: the scatter GEMM's kernel, blocks and programs with a local store into out."""
        plain = self._gemm_blocks(key, programs)
        return lambda call: launch_gemm(a=call.a, w=call.w, out=call.out, num_programs=programs, blocks=plain)

    def _scatter_gemm(self, key, programs: int, offset: int):
        """The fused plan's GEMM step: call -> a @ w stored into the owners' slots, row blocks published (the
        @triton.jit GEMM's EPILOGUE_SCATTER)."""
        rows = key.m // self.world_size
        scatter, plain, own = self._scatter(key.m), self._gemm_blocks(key, programs), self._slots(self.rank, rows)[0]
        return lambda call: launch_gemm(a=call.a, w=call.w, out=own, num_programs=programs, blocks=plain,
                                        epilogue=EPILOGUE_SCATTER, tile_row_offset=offset, scatter=scatter)
