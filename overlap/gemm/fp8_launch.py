"""Launchers of the FP8 kernels (kernels/quant_fp8.py; the GEMM through overlap/gemm/launch.py): grids and
arguments, nothing else. Shapes, dtypes and layouts are validated by overlap/gemm/fp8.py before these run."""

from __future__ import annotations

import torch

from .blocks import GemmBlocks
from .launch import ChunkWait, launch_gemm
from .triton_gemm import num_sms

__all__ = ["ChunkWait", "launch_quantize_activation", "launch_quantize_weight", "launch_fp8_gemm",
           "ACTIVATION_BLOCK_M"]

ACTIVATION_BLOCK_M = 32   # rows per program of the activation quantiser (x one 128-wide group)


def launch_quantize_activation(*, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    from tp_overlap.kernels.quant_fp8 import SCALE_GROUP, quantize_activation_kernel

    m, k = x.shape
    grid = (-(-m // ACTIVATION_BLOCK_M), -(-k // SCALE_GROUP))
    quantize_activation_kernel[grid](x, q, scales, m, k, x.stride(0), q.stride(0), scales.stride(0),
                                     scales.stride(1), BLOCK_M=ACTIVATION_BLOCK_M, num_warps=4)


def launch_quantize_weight(*, w: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    from tp_overlap.kernels.quant_fp8 import SCALE_GROUP, quantize_weight_kernel

    n, k = w.shape
    grid = (-(-n // SCALE_GROUP), -(-k // SCALE_GROUP))
    quantize_weight_kernel[grid](w, q, scales, n, k, w.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
                                 num_warps=8)


def launch_fp8_gemm(*, a8: torch.Tensor, a_scales: torch.Tensor, w8: torch.Tensor, w_scales: torch.Tensor,
                    out: torch.Tensor, blocks: GemmBlocks, num_programs: int | None, tile_row_offset: int,
                    chunk_wait: ChunkWait | None) -> None:
    """The FP8 GEMM: the persistent GEMM (launch_gemm) with the scaled K loop, w8 [N, K] read as B^T."""
    programs = num_programs or num_sms(a8.device) * blocks.programs_per_sm
    launch_gemm(a=a8, w=w8.t(), out=out, num_programs=programs, blocks=blocks, tile_row_offset=tile_row_offset,
                chunk_wait=chunk_wait, scales=(a_scales, w_scales))
