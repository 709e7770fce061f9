"""Launchers of the persistent Triton GEMM (kernels/gemm.py): block choice, allocator, grid.

`triton_mm(a, b, out, num_programs=...)` is the local-epilogue GEMM (the "GEMM alone" of the benchmarks
and the compute of the fused ops with `num_sms - sm_margin` programs).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass

import torch

__all__ = ["GemmBlocks", "b_operand", "choose_blocks", "descriptor_ok", "ensure_allocator", "triton_mm", "num_sms",
           "sm_carveout"]

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


@dataclass(frozen=True)
class GemmBlocks:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False


@functools.lru_cache(maxsize=1024)  # pure, and called on every launch of the ops
def choose_blocks(m: int, n: int, k: int, *, device_type: str = "cuda", warp_specialize: bool = True,
                  sm_count: int = 132) -> GemmBlocks:
    """Pure heuristic from launch.gemm_bench on an H200 (device time, results/gemm_h200_tp2.json):
    128x256x64 tiles with 8 warps, 3 stages and warp specialisation, unless 128x128 tiles (4 warps, 4
    stages) fill the last wave of `sm_count` programs clearly better (e.g. M = 1024 with N = 5120 or 14336,
    where 256-wide tiles leave a third of the SMs idle in the last wave). Callers whose K loop waits on
    flags pass warp_specialize=False (a specialised load partition would not wait)."""
    if device_type != "cuda":
        return GemmBlocks(16, 16, 16, 4, 1, 1)
    wide = _wave_efficiency(_cdiv(m, 128) * _cdiv(n, 256), sm_count)
    narrow = _wave_efficiency(_cdiv(m, 128) * _cdiv(n, 128), sm_count)
    if narrow > wide + WAVE_MARGIN:
        return GemmBlocks(128, 128, 64, 8, 4, 4)
    return GemmBlocks(128, 256, 64, 8, 8, 3, warp_specialize)


WAVE_MARGIN = 0.05  # ties go to the wider tile (more reuse per loaded A row)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _wave_efficiency(tiles: int, sm_count: int) -> float:
    """Busy fraction of the programs over all waves of a persistent grid of `sm_count` programs."""
    return tiles / (_cdiv(tiles, sm_count) * sm_count)


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
    (b row-major, or the transpose view of a row-major [N, K])."""
    from ._gemm_launch import launch_gemm

    m, k = a.shape
    n = b.shape[1]
    if out.shape != (m, n) or b.shape[0] != k:
        raise ValueError(f"triton_mm: shapes a{tuple(a.shape)} b{tuple(b.shape)} out{tuple(out.shape)} disagree")
    programs = num_programs or num_sms(a.device)
    blocks = blocks or choose_blocks(m, n, k, device_type=a.device.type, sm_count=programs)
    launch_gemm(a=a, w=b, out=out, num_programs=programs, blocks=blocks, tile_row_offset=tile_row_offset)
    return out
