"""Private launchers of the FP8 kernels (kernels/quant_fp8.py, kernels/gemm_fp8.py): grids, allocator and
argument order, nothing else. Shapes, dtypes and layouts are validated by overlap/gemm/fp8.py before these run."""

from __future__ import annotations

import torch

from .blocks import GemmBlocks
from .launch import ChunkWait, descriptor_ok, ensure_allocator
from .triton_gemm import num_sms

__all__ = ["ChunkWait", "launch_quantize_activation", "launch_quantize_weight", "launch_fp8_gemm",
           "ACTIVATION_BLOCK_M"]

ACTIVATION_BLOCK_M = 32   # rows per program of the activation quantiser (x one 128-wide group)


def launch_quantize_activation(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    from kernels.quant_fp8 import GROUP, quantize_activation_kernel

    m, k = x.shape
    grid = (-(-m // ACTIVATION_BLOCK_M), -(-k // GROUP))
    quantize_activation_kernel[grid](x, q, scales, m, k, x.stride(0), q.stride(0), scales.stride(0),
                                     scales.stride(1), BLOCK_M=ACTIVATION_BLOCK_M, num_warps=4)


def launch_quantize_weight(w: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    from kernels.quant_fp8 import GROUP, quantize_weight_kernel

    n, k = w.shape
    grid = (-(-n // GROUP), -(-k // GROUP))
    quantize_weight_kernel[grid](w, q, scales, n, k, w.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
                                 num_warps=8)


def launch_fp8_gemm(a8: torch.Tensor, a_scales: torch.Tensor, w8: torch.Tensor, w_scales: torch.Tensor,
                    out: torch.Tensor, *, blocks: GemmBlocks, num_programs: int | None, tile_row_offset: int,
                    chunk_wait: ChunkWait | None) -> None:
    from kernels.gemm_fp8 import fp8_gemm_kernel

    if a8.is_cuda:
        ensure_allocator()
    m, k = a8.shape
    n = w8.shape[0]
    programs = num_programs or num_sms(a8.device) * blocks.programs_per_sm
    wait = {}
    if chunk_wait is not None:
        wait = dict(rows_per_rank=chunk_wait.rows_per_rank, chunk_flags_ptr=chunk_wait.flags,
                    chunks_per_rank=chunk_wait.chunks_per_rank, error_ptr=chunk_wait.error_words,
                    error_code_base=chunk_wait.error_code_base, timeout_ns=int(chunk_wait.timeout_s * 1e9),
                    WAIT_CHUNKS=True)
    fp8_gemm_kernel[(programs,)](
        a8, w8, out, a_scales, w_scales, m, n, k, a8.stride(0), w8.stride(0), out.stride(0),
        a_scales.stride(0), a_scales.stride(1), w_scales.stride(0), w_scales.stride(1), tile_row_offset,
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, GROUP_M=blocks.group_m,
        USE_DESCRIPTORS=descriptor_ok(a8, w8, out), WARP_SPECIALIZE=blocks.warp_specialize, FLATTEN=blocks.flatten,
        EPILOGUE_SUBTILE=blocks.epilogue_subtile, num_warps=blocks.num_warps, num_stages=blocks.num_stages, **wait)
