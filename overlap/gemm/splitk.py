"""The launcher of the split-K GEMM (kernels/gemm_splitk.py): its workspace, its grid and its operands.

`triton_mm` calls `launch_split_k` for a configuration with `split_k > 1` (a name ending in `sp<S>`). The fp32
workspace and the tile counters (the kernel leaves them at zero) come from the launchers' per-stream cache,
one pair per (stream, shape, configuration) (workspaces.py).
"""

from __future__ import annotations

import torch

from .blocks import GemmBlocks
from .workspaces import stream_buffers


def split_k_workspace(device: torch.device, m: int, n: int, blocks: GemmBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace [tiles * S * BLOCK_M * BLOCK_N], int32 counters [tiles], zero) of the current stream."""
    tiles = -(-m // blocks.block_m) * -(-n // blocks.block_n)
    return stream_buffers(device, ("split_k", m, n, blocks.block_m, blocks.block_n, blocks.split_k),
                          tiles * blocks.split_k * blocks.block_m * blocks.block_n, tiles)


def launch_split_k(*, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: GemmBlocks,
                   num_programs: int | None = None, tile_row_offset: int = 0) -> None:
    """out = a [M, K] @ w [K, N] on the current stream, each tile's K split over `blocks.split_k` units.

    w is row-major or the transpose view of a row-major [N, K]. One program per unit unless
    `num_programs` (the caller leaves SMs free) caps the grid; the programs then loop over the units.
    """
    from tp_overlap.kernels.gemm_splitk import SplitKConfig, reduce_rows, split_k_gemm_kernel

    if blocks.split_k < 2:
        raise ValueError(f"launch_split_k: blocks {blocks.name!r} have split_k {blocks.split_k}; allowed: >= 2")
    m, k = a.shape
    n = w.shape[1]
    if a.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"launch_split_k: a strides {a.stride()} and out strides {out.stride()}; allowed: a last "
                         "stride of 1")
    b_transposed = not w.is_contiguous()
    b = w.t() if b_transposed else w
    if not b.is_contiguous():
        raise ValueError(f"launch_split_k: w strides {w.stride()} are neither row-major nor a transposed row-major")
    ldb = b.stride(0)
    workspace, counters = split_k_workspace(a.device, m, n, blocks)
    units = counters.numel() * blocks.split_k
    programs = min(units, num_programs) if num_programs else units
    # TMA: 16-byte aligned bases and row strides
    use_descriptors = all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (a, b))
    if use_descriptors:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_arg = TensorDescriptor(a, [m, k], [a.stride(0), 1], [blocks.block_m, blocks.block_k])
        b_block = [blocks.block_n, blocks.block_k] if b_transposed else [blocks.block_k, blocks.block_n]
        b_arg = TensorDescriptor(b, list(b.shape), [ldb, 1], b_block)
    else:
        a_arg, b_arg = a, b
    split_k_gemm_kernel[(max(1, programs),)](
        a_arg, b_arg, out, workspace, counters, m, n, k, a.stride(0), ldb, out.stride(0), tile_row_offset,
        CONFIG=SplitKConfig(blocks.block_m, blocks.block_n, blocks.block_k, blocks.group_m, blocks.split_k,
                            use_descriptors, b_transposed, reduce_rows(blocks.block_m, blocks.block_n, blocks.num_warps)),
        num_warps=blocks.num_warps, num_stages=blocks.num_stages)
