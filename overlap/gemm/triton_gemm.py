"""Launchers of the persistent Triton GEMM (kernels/gemm.py): allocator, grid, operands, stream-K buffers.

`triton_mm(a, b, out, num_programs=...)` is the local-epilogue GEMM (the "GEMM alone" of the benchmarks
and the compute of the fused ops with `num_sms - sm_margin` programs). Block choice: `choose_blocks`
(overlap/gemm/blocks.py, the measured table of configs/gemm_blocks/; re-exported here).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from .blocks import GemmBlocks, choose_blocks

__all__ = ["GemmBlocks", "b_operand", "choose_blocks", "descriptor_ok", "ensure_allocator", "triton_mm", "num_sms",
           "sm_carveout", "gpu_name", "STREAM_K_TIMEOUT_NS"]

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


@contextlib.contextmanager
def sm_carveout(sm_margin: int):
    """cuBLAS calls inside use num_sms - sm_margin SMs (a process-wide setting: restored on exit)."""
    if not sm_margin:
        yield
        return
    previous = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sm_margin)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs are enough to exercise the persistent loop
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    # get_device_properties costs ~10 us of host time per call, paid on every triton_mm launch otherwise
    return torch.cuda.get_device_properties(index).multi_processor_count


def gpu_name(device: torch.device) -> str | None:
    """The block-table name of a CUDA device ('h200' for an NVIDIA H200); None off CUDA."""
    if device.type != "cuda":
        return None
    return _cuda_gpu_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_gpu_name(index: int) -> str:
    from ..presets import gpu_slug
    return gpu_slug(torch.cuda.get_device_name(index))


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


def triton_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, num_programs: int | None = None,
              blocks: GemmBlocks | None = None, tile_row_offset: int = 0) -> torch.Tensor:
    """out[M, N] = a[M, K] @ b[K, N] on the current stream with `num_programs` persistent programs
    (b row-major, or the transpose view of a row-major [N, K]); valid on the current stream. Blocks from
    `choose_blocks` for the layout and GPU unless given. A stream-K configuration uses a workspace private
    to the current stream (allocated on its first use there: warm up before a CUDA-graph capture)."""
    from .launch import launch_gemm

    m, k = a.shape
    n = b.shape[1]
    if out.shape != (m, n) or b.shape[0] != k:
        raise ValueError(f"triton_mm: shapes a{tuple(a.shape)} b{tuple(b.shape)} out{tuple(out.shape)} disagree")
    b_transposed = b_operand(b)[2]
    blocks = blocks or choose_blocks(m, n, k, b_transposed=b_transposed, device_type=a.device.type,
                                     sm_count=num_programs or num_sms(a.device), gpu=gpu_name(a.device))
    programs = num_programs or num_sms(a.device) * blocks.programs_per_sm
    launch_gemm(a=a, w=b, out=out, num_programs=programs, blocks=blocks, tile_row_offset=tile_row_offset)
    return out
