"""The `fused` consumer of AgGemm: one persistent Triton GEMM that waits for each chunk's flag.

Chunk flags live in local device memory, one int32 per (owner, chunk) in owner-major order, zeroed at the
start of each call and set to 1 by the comm stream after each pull. They are written with `stream_write_value32`
(a stream memory operation: no SM needed), because the GEMM may occupy every SM it was given while it
waits; one SM is always left free (sm_margin >= 1) for the comm stream's bounded ready-wait kernel.
"""

from __future__ import annotations

import torch

from .triton_gemm import b_operand, choose_blocks, descriptor_ok, ensure_allocator, num_sms

MIN_FREE_SMS = 1


class FusedAgConsumer:
    def __init__(self, op):
        self.op = op
        self.num_programs = num_sms(op.device) - max(op.config.sm_margin, MIN_FREE_SMS)
        self.errors = torch.zeros(2, dtype=torch.int32, device=op.device)

    def signal_chunk(self, flag_index: int) -> None:
        """Enqueue on the current (comm) stream: chunk flag = 1, after the pulls before it."""
        from kernels.flags import write_flag
        write_flag(self.op._chunk_flags, flag_index, 1)

    def run(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """Enqueue the GEMM on the current (compute) stream: out = a @ w, tile rows in arrival order."""
        from kernels.gemm import EPILOGUE_LOCAL, ag_tile_row_offset, persistent_gemm_kernel

        ensure_allocator()
        op = self.op
        m, k = a.shape
        n = w.shape[1]
        b, ldb, b_transposed = b_operand(w)
        rows = m // op.world_size
        blocks = choose_blocks(m, n, k, warp_specialize=False, sm_count=self.num_programs)
        persistent_gemm_kernel[(self.num_programs,)](
            a, b, out, m, n, k, a.stride(0), ldb, out.stride(0),
            ag_tile_row_offset(op.rank, rows, blocks.block_m),
            None, None, None, rows, 0, 1, 0,
            BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, GROUP_M=blocks.group_m,
            EPILOGUE=EPILOGUE_LOCAL, USE_DESCRIPTORS=descriptor_ok(a, b, out), B_TRANSPOSED=b_transposed,
            WARP_SPECIALIZE=False, chunk_flags_ptr=op._chunk_flags, chunks_per_rank=op.config.chunks_per_rank,
            chunk_epoch=1, error_ptr=self.errors, timeout_ns=int(op.timeout_s * 1e9), WAIT_CHUNKS=True,
            num_warps=blocks.num_warps, num_stages=blocks.num_stages)

    def error_code(self) -> int:
        """0, or 1 + the owner-major index of the chunk whose flag never came (synchronises)."""
        code = int(self.errors[0].item())
        if code:
            self.errors.zero_()
        return code
