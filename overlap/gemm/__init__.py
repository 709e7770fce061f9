"""GEMM selection and launch: the block table and its choice (`blocks`), the launchers of the persistent
Triton GEMM and its scatter / reduce epilogues (`launch`, `triton_gemm`), split-K (`splitk`), the FP8
path (`fp8`, `fp8_launch`, the Gluon kernel's `fp8_gluon_launch`), and the launchers' per-stream scratch
(`workspaces`). The ops and the launchers import from here."""

from .blocks import (LAYOUTS, PLAIN_BLOCK_M, BlockTable, BlockTableEntry, BlockTableError, GemmBlocks, block_table_path,
                     choose_blocks, heuristic_blocks, load_block_table, parse_block_table)
from .fp8 import (FP8_DTYPE, Fp8WeightCache, choose_fp8_blocks, dequantize_activation, dequantize_weight, fp8_gemm,
                  padded_scale_groups, quantize_activation, quantize_weight, scale_groups, scaled_mm_reference)
from .fp8_launch import launch_quantize_activation
from .launch import ChunkWait, Scatter, launch_gemm, launch_reduce
from .splitk import split_k_workspace
from .triton_gemm import gpu_name, num_sms, sm_carveout, triton_mm
from .workspaces import release_workspaces

__all__ = ["LAYOUTS", "PLAIN_BLOCK_M", "BlockTable", "BlockTableEntry", "BlockTableError", "GemmBlocks",
           "block_table_path", "choose_blocks", "heuristic_blocks", "load_block_table", "parse_block_table",
           "FP8_DTYPE", "Fp8WeightCache", "choose_fp8_blocks", "dequantize_activation", "dequantize_weight", "fp8_gemm",
           "padded_scale_groups", "quantize_activation", "quantize_weight", "scale_groups", "scaled_mm_reference",
           "launch_quantize_activation", "ChunkWait", "Scatter", "launch_gemm", "launch_reduce", "gpu_name", "num_sms",
           "sm_carveout", "triton_mm", "release_workspaces", "split_k_workspace"]
