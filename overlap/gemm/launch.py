"""The launchers of the GEMM kernels: one per kernel, keyword arguments only.

`launch_gemm` is the only caller of `tp_overlap.kernels.gemm.persistent_gemm_kernel` and `launch_reduce` the only
caller of `tp_overlap.kernels.rs_epilogue.reduce_partials_kernel`; the ops describe what they want (a local GEMM, a
fused AllGather consumer waiting on chunk flags, a scatter to owners) with the small records below. The
helpers every launcher of this package shares live here too: the descriptor allocator, the B operand's
layout, the TMA alignment check and the stream-K buffers.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch

from tp_overlap.kernels.constants import EPILOGUE_LOCAL

from .blocks import GemmBlocks, stream_k_tiles
from .workspaces import stream_buffers

__all__ = ["ChunkWait", "Scatter", "launch_gemm", "launch_reduce"]

# A stream-K finisher waits this long for a contributor before computing its K range itself (only a
# contributor that is not resident -- SMs held by another kernel -- is ever that late).
STREAM_K_TIMEOUT_NS = 20_000_000

_allocator_state = threading.local()


def _descriptor_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Tensor descriptors need global scratch from an allocator. Triton keeps it per thread (a context
    variable), and autograd runs backward on its own thread, so set it once per thread."""
    if getattr(_allocator_state, "set", False):
        return
    import triton

    triton.set_allocator(_descriptor_scratch)
    _allocator_state.set = True


def b_operand(w: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """(row-major tensor, its row stride, B_TRANSPOSED) for a [K, N] operand that is row-major or the
    transpose view of a row-major [N, K] (the kernel then loads [N, K] tiles: no copy of the weight)."""
    if w.is_contiguous():
        return w, w.stride(0), False
    wt = w.t()
    if not wt.is_contiguous():
        raise ValueError(f"b_operand: strides {w.stride()} are neither row-major nor a transposed row-major")
    return wt, wt.stride(0), True


def descriptor_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and row strides."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def tma_row_problems(named: tuple[tuple[str, torch.Tensor], ...]) -> list[str]:
    """Why TMA cannot read each named 2-D tensor (empty when it can): contiguous rows, a 16-byte aligned base
    and row stride. Messages name the tensor and start with "gluon:" (the Gluon kernels' launchers)."""
    problems = []
    for name, t in named:
        if t.stride(-1) != 1:
            problems.append(f"gluon: {name} needs contiguous rows (strides {t.stride()})")
        elif t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            problems.append(f"gluon: {name} needs a 16-byte aligned base and row stride (base at "
                            f"{t.data_ptr() % 16} mod 16, row stride {t.stride(0)} x {t.element_size()} bytes)")
    return problems


@functools.cache
def tma_shared_layout(block: tuple[int, int], dtype: torch.dtype):
    """The shared-memory layout of a TMA box of `dtype` (the Gluon kernels' host descriptors): NVMMA's default
    swizzle, except the FP8 scale boxes (fp32, one row or four columns: no swizzle)."""
    from triton.experimental.gluon import language as gl

    if dtype == torch.float32 and min(block) <= 4:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    gl_dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def tma_descriptor(t: torch.Tensor, block: tuple[int, int]):
    """A host TMA descriptor of the 2-D tensor `t` in boxes of `block` (its `tma_row_problems` empty)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = tma_shared_layout(tuple(block), t.dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), layout)


class ChunkWait(NamedTuple):
    """The fused AllGather consumer: wait for each gathered chunk's device flag before reading its rows."""
    flags: torch.Tensor          # int32 [W * chunks_per_rank], owner-major, SET when the chunk is in place
    rows_per_rank: int
    chunks_per_rank: int
    error_words: torch.Tensor    # the pool's control page (error code, value, abort)
    error_code_base: int         # code of chunk 0 (the pool decodes it to region and index)
    timeout_s: float


class Scatter(NamedTuple):
    """The GEMM+RS epilogues: store each tile into its owner's slot and release the row block's flag."""
    dst_ptrs: torch.Tensor       # int64 [W]: every owner's partials buffer [W, rows_per_rank, N]
    flag_ptrs: torch.Tensor      # int64 [W]: every owner's device flags [W, flags_per_source]
    tile_counters: torch.Tensor  # int32, local, zero between launches
    rows_per_rank: int
    src_rank: int
    flags_per_source: int
    error_words: torch.Tensor
    error_code_base: int         # code of the own flags' word 0 (EPILOGUE 2's waits)
    timeout_s: float             # the row-block flags carry the call's M (overlap/protocol.py)


def launch_gemm(*, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, num_programs: int, blocks: GemmBlocks,
                epilogue: int = EPILOGUE_LOCAL, tile_row_offset: int = 0, chunk_wait: ChunkWait | None = None,
                scatter: Scatter | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """out = a [M, K] @ w [K, N] on the current stream with `num_programs` persistent programs.

    w is row-major or the transpose view of a row-major [N, K]. epilogue EPILOGUE_LOCAL (0) stores into `out`;
    EPILOGUE_SCATTER (1) and EPILOGUE_SCATTER_REDUCE (2) need `scatter` (out is then only used for its dtype,
    or, for 2, is the owner's [M/W, N] output shard). `scales` (a_scales, w_scales) makes it the FP8 GEMM
    (kernels/gemm_fp8.py: e4m3 a and w = w8.t(), layouts of overlap/gemm/fp8.py).
    """
    from tp_overlap.kernels.gemm import GemmConfig, persistent_gemm_kernel

    if blocks.gluon:
        raise ValueError(f"launch_gemm: blocks {blocks.name!r} name a Gluon kernel (triton_mm or fp8_gemm runs them)")
    if a.is_cuda:
        ensure_allocator()
    m, k = a.shape
    n = w.shape[1]
    b, ldb, b_transposed = b_operand(w)
    if (epilogue != EPILOGUE_LOCAL) != (scatter is not None):
        raise ValueError(f"launch_gemm: epilogue {epilogue} {'needs' if epilogue else 'takes no'} scatter=")
    local = epilogue == EPILOGUE_LOCAL
    # the local GEMM alone may split its last partial wave by K steps (stream-K) and flatten its loops
    alone = local and chunk_wait is None
    tiles = -(-m // blocks.block_m) * -(-n // blocks.block_n)
    split = alone and scales is None and stream_k_tiles(tiles, num_programs, blocks.stream_k) > 0
    rows_per_rank = chunk_wait.rows_per_rank if chunk_wait else scatter.rows_per_rank if scatter else m
    config = GemmConfig(blocks.block_m, blocks.block_n, blocks.block_k, blocks.group_m, EPILOGUE=epilogue,
                        USE_DESCRIPTORS=descriptor_ok(a, b, out) if local else descriptor_ok(a, b),
                        B_TRANSPOSED=b_transposed, WARP_SPECIALIZE=blocks.warp_specialize and alone,
                        FLATTEN=blocks.flatten and alone, EPILOGUE_SUBTILE=blocks.epilogue_subtile if local else 1,
                        STREAM_K_WAVES=blocks.stream_k if split else 0)
    persistent_gemm_kernel[(num_programs,)](
        a, b, out, m, n, k, (a.stride(0), ldb, out.stride(0)), tile_row_offset, rows_per_rank,
        scatter.src_rank if scatter else 0, _scatter_args(scatter), _chunk_wait_args(chunk_wait),
        _stream_k_args(a.device, num_programs, blocks) if split else None, _scales_args(scales),
        CONFIG=config, num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _scatter_args(scatter: Scatter | None):
    if scatter is None:
        return None
    return (scatter.dst_ptrs, scatter.flag_ptrs, scatter.tile_counters, scatter.flags_per_source,
            scatter.error_words, scatter.error_code_base, int(scatter.timeout_s * 1e9))


def _chunk_wait_args(wait: ChunkWait | None):
    if wait is None:
        return None
    return wait.flags, wait.chunks_per_rank, wait.error_words, wait.error_code_base, int(wait.timeout_s * 1e9)


def _stream_k_args(device: torch.device, programs: int, blocks: GemmBlocks):
    # a workspace slot and a flag per program (kernels/gemm_mainloop.py); every launch leaves the flags at zero
    workspace, flags = stream_buffers(device, ("stream_k",), programs * blocks.block_m * blocks.block_n, programs)
    return workspace, flags, STREAM_K_TIMEOUT_NS


def _scales_args(scales):
    if scales is None:
        return None
    a_scales, w_scales = scales
    return a_scales, w_scales, a_scales.stride(0), a_scales.stride(1), w_scales.stride(0), w_scales.stride(1)


def launch_reduce(*, partials: torch.Tensor, out: torch.Tensor, flags: torch.Tensor, error_words: torch.Tensor,
                  error_code_base: int, rows_per_rank: int, world_size: int, flags_per_source: int, gemm_block_m: int,
                  owner_rank: int, num_programs: int, wait: bool, timeout_s: float) -> None:
    """out [rows, N] = sum over sources of partials [W, rows, N] (fp32 accumulation), on the current stream.

    wait=True: each tile first waits (bounded, in the kernel) until the row-block device flags of every
    source (the scatter epilogue's) hold the call's M (rows_per_rank * world_size); wait=False: the caller
    ordered the partials before the launch. On CPU the host driver has already waited, and torch sums the
    same way (the kernel has interpreter tests).
    """
    if not out.is_cuda:  # CPU ranks: the same sum (fp32, in source order) without the Triton interpreter
        total = partials[0].float()
        for source in range(1, world_size):
            total += partials[source]
        out.copy_(total)
        return
    from tp_overlap.kernels.rs_epilogue import reduce_partials_kernel

    waits = (flags, flags_per_source, error_words, error_code_base, int(timeout_s * 1e9)) if wait else None
    reduce_partials_kernel[(max(1, num_programs),)](
        partials, out, rows_per_rank, out.shape[1], out.stride(0), world_size, owner_rank, waits,
        BLOCK_M=32, BLOCK_N=256, GEMM_BLOCK_M=gemm_block_m, num_warps=4)
