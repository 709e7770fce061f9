"""The launchers of the GEMM kernels: one per kernel, keyword arguments only.

`launch_gemm` is the only caller of `kernels.gemm.persistent_gemm_kernel` and `launch_reduce` the only
caller of `kernels.rs_epilogue.reduce_partials_kernel`; the ops describe what they want (a local GEMM, a
fused AllGather consumer waiting on chunk flags, a scatter to owners) with the small records below. The
helpers every launcher of this package shares live here too: the descriptor allocator, the B operand's
layout, the TMA alignment check and the stream-K buffers.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from .blocks import GemmBlocks, stream_k_tiles

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


_stream_k_state = {}


def _stream_k_buffers(device: torch.device, programs: int, tile_elements: int):
    """(fp32 workspace, int32 flags) of stream-K for the current stream: private per stream (two GEMMs
    running at once must not share them), grown on demand, the flags zero (every launch leaves them so)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    workspace, flags = _stream_k_state.get(key, (None, None))
    if workspace is None or workspace.numel() < programs * tile_elements or flags.numel() < programs:
        workspace = torch.empty(programs * tile_elements, dtype=torch.float32, device=device)
        flags = torch.zeros(programs, dtype=torch.int32, device=device)
        _stream_k_state[key] = (workspace, flags)
    return workspace, flags


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
    timeout_s: float
    flag_value: int = 1          # what the row-block flags carry: the call's M (overlap/protocol.py)


def launch_gemm(*, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, num_programs: int, blocks: GemmBlocks,
                epilogue: int = 0, tile_row_offset: int = 0, chunk_wait: ChunkWait | None = None,
                scatter: Scatter | None = None) -> None:
    """out = a [M, K] @ w [K, N] on the current stream with `num_programs` persistent programs.

    w is row-major or the transpose view of a row-major [N, K]. epilogue 0 stores into `out`; 1 and 2 need
    `scatter` (out is then only used for its dtype, or, for 2, is the owner's [M/W, N] output shard).
    """
    from kernels.gemm import persistent_gemm_kernel

    if a.is_cuda:
        ensure_allocator()
    m, k = a.shape
    n = w.shape[1]
    b, ldb, b_transposed = b_operand(w)
    if (epilogue != 0) != (scatter is not None):
        raise ValueError(f"launch_gemm: epilogue {epilogue} {'needs' if epilogue else 'takes no'} scatter=")
    extra = {}
    if chunk_wait is not None:
        extra = dict(chunk_flags_ptr=chunk_wait.flags, chunks_per_rank=chunk_wait.chunks_per_rank,
                     error_ptr=chunk_wait.error_words, error_code_base=chunk_wait.error_code_base,
                     timeout_ns=int(chunk_wait.timeout_s * 1e9), WAIT_CHUNKS=True)
        rows_per_rank = chunk_wait.rows_per_rank
    if scatter is not None:
        extra = dict(error_ptr=scatter.error_words, error_code_base=scatter.error_code_base,
                     timeout_ns=int(scatter.timeout_s * 1e9), flag_value=scatter.flag_value)
        rows_per_rank = scatter.rows_per_rank
    elif chunk_wait is None:
        rows_per_rank = m
        # the local GEMM alone may split its last partial wave by K steps (stream-K) and flatten its loops
        tiles = -(-m // blocks.block_m) * -(-n // blocks.block_n)
        split = stream_k_tiles(tiles, num_programs, blocks.stream_k) if epilogue == 0 else 0
        if split:
            workspace, flags = _stream_k_buffers(a.device, num_programs, blocks.block_m * blocks.block_n)
            extra = dict(timeout_ns=STREAM_K_TIMEOUT_NS, stream_k_tiles=split, stream_k_workspace=workspace,
                         stream_k_flags=flags, STREAM_K=True)
        extra.update(FLATTEN=blocks.flatten, EPILOGUE_SUBTILE=blocks.epilogue_subtile)
    persistent_gemm_kernel[(num_programs,)](
        a, b, out, m, n, k, a.stride(0), ldb, out.stride(0), tile_row_offset,
        scatter.dst_ptrs if scatter else None, scatter.flag_ptrs if scatter else None,
        scatter.tile_counters if scatter else None, rows_per_rank, scatter.src_rank if scatter else 0,
        scatter.flags_per_source if scatter else 0,
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, GROUP_M=blocks.group_m,
        EPILOGUE=epilogue, USE_DESCRIPTORS=descriptor_ok(a, b, out) if epilogue == 0 else descriptor_ok(a, b),
        B_TRANSPOSED=b_transposed,
        WARP_SPECIALIZE=blocks.warp_specialize and epilogue == 0 and chunk_wait is None,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages, **extra)


def launch_reduce(*, partials: torch.Tensor, out: torch.Tensor, flags: torch.Tensor, error_words: torch.Tensor,
                  error_code_base: int, rows_per_rank: int, world_size: int, flags_per_source: int, gemm_block_m: int,
                  owner_rank: int, num_programs: int, wait: bool, timeout_s: float, flag_value: int = 1) -> None:
    """out [rows, N] = sum over sources of partials [W, rows, N] (fp32 accumulation), on the current stream.

    wait=True: each tile first waits (bounded, in the kernel) until the row-block device flags of every
    source (the scatter epilogue's) hold `flag_value`; wait=False: the caller ordered the partials before the launch. On CPU
    the host driver has already waited, and torch sums the same way (the kernel has interpreter tests).
    """
    if not out.is_cuda:  # CPU ranks: the same sum (fp32, in source order) without the Triton interpreter
        total = partials[0].float()
        for source in range(1, world_size):
            total += partials[source]
        out.copy_(total)
        return
    from kernels.rs_epilogue import reduce_partials_kernel

    n = out.shape[1]
    reduce_partials_kernel[(max(1, num_programs),)](
        partials, out, flags, error_words, rows_per_rank, n, out.stride(0), world_size, flags_per_source,
        gemm_block_m, owner_rank, int(timeout_s * 1e9), error_code_base, flag_value,
        WAIT=wait, BLOCK_M=32, BLOCK_N=256 if out.is_cuda else 16, num_warps=4)
