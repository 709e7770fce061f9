"""The local GEMM and the device facts its callers need: SM count, GPU name, cuBLAS's SM carve-out.

`triton_mm(a, b, out, num_programs=...)` is the Triton GEMM with a local epilogue: the "GEMM alone" of the
benchmarks and the block tuner. It runs the block table's choice (`choose_blocks`, overlap/gemm/blocks.py, the
measured tables of configs/gemm_blocks/) or the given blocks on the kernel they name: the persistent
`@triton.jit` GEMM (overlap/gemm/launch.py), split-K (splitk.py) or the Gluon GEMM (gluon_launch.py). The
fused ops launch the persistent GEMM themselves (`launch_gemm` with chunk waits or a scatter epilogue), on
the entry's plain blocks.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .blocks import GemmBlocks, choose_blocks, gpu_slug
from .gluon_launch import gluon_operand_problems, launch_gluon_gemm
from .launch import b_operand, launch_gemm
from .splitk import launch_split_k

__all__ = ["triton_mm", "num_sms", "sm_carveout", "gpu_name"]


@contextlib.contextmanager
def sm_carveout(sm_margin: int):
    """cuBLAS calls inside use num_sms - sm_margin SMs (process-wide settings: restored on exit). Only cuBLASLt
    honours the carve-out (its SM count target): torch's default cuBLAS path ignores it, so on a GPU the
    preferred BLAS library is cuBLASLt inside."""
    if not sm_margin:
        yield
        return
    previous = torch._C._get_sm_carveout_experimental()
    backend = torch._C._get_blas_preferred_backend() if _cuda_present() else None
    torch._C._set_sm_carveout_experimental(sm_margin)
    if backend is not None:
        torch._C._set_blas_preferred_backend(torch._C._BlasBackend.Cublaslt)
    try:
        yield
    finally:
        if backend is not None:
            torch._C._set_blas_preferred_backend(backend)
        torch._C._set_sm_carveout_experimental(previous)


@functools.lru_cache(maxsize=1)
def _cuda_present() -> bool:  # once: sm_carveout runs on the ops' hot path
    return torch.cuda.is_available()


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
    return gpu_slug(torch.cuda.get_device_name(index))


def triton_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, num_programs: int | None = None,
              blocks: GemmBlocks | None = None, tile_row_offset: int = 0) -> torch.Tensor:
    """out[M, N] = a[M, K] @ b[K, N] on the current stream with `num_programs` persistent programs
    (b row-major, or the transpose view of a row-major [N, K]); valid on the current stream. Blocks from
    `choose_blocks` for the layout and GPU unless given. A stream-K configuration uses a workspace private
    to the current stream (allocated on its first use there: warm up before a CUDA-graph capture); so does a
    split-K one (`split_k > 1`: overlap/gemm/splitk.py, at most `num_programs` programs when given). Gluon
    blocks (`gl`: kernels/gemm_gluon.py) read every operand through TMA: where one is not aligned for it, a
    table's choice falls back to the entry's plain blocks, and explicit `blocks` raise."""
    m, k = a.shape
    n = b.shape[1]
    if out.shape != (m, n) or b.shape[0] != k:
        raise ValueError(f"triton_mm: shapes a{tuple(a.shape)} b{tuple(b.shape)} out{tuple(out.shape)} disagree")
    b_rows, _, b_transposed = b_operand(b)
    sm_count = num_programs or num_sms(a.device)
    chosen = blocks is None
    if chosen:
        blocks = _table_blocks(a, m, n, k, b_transposed, sm_count)
    if blocks.gluon:
        problems = gluon_operand_problems(a, b_rows, out) if a.is_cuda else ["gluon: needs a CUDA device"]
        problems += [] if chosen else blocks.problems()   # a table's entries were checked when it was loaded
        if not problems:
            launch_gluon_gemm(a=a, b=b_rows, b_transposed=b_transposed, out=out, blocks=blocks,
                              num_programs=sm_count, tile_row_offset=tile_row_offset)
            return out
        if not chosen:
            raise ValueError(f"triton_mm: blocks {blocks.name!r}: {'; '.join(problems)}")
        blocks = _table_blocks(a, m, n, k, b_transposed, sm_count, warp_specialize=False)
    if blocks.split_k > 1:
        launch_split_k(a=a, w=b, out=out, blocks=blocks, num_programs=num_programs, tile_row_offset=tile_row_offset)
        return out
    programs = num_programs or num_sms(a.device) * blocks.programs_per_sm
    launch_gemm(a=a, w=b, out=out, num_programs=programs, blocks=blocks, tile_row_offset=tile_row_offset)
    return out


def _table_blocks(a: torch.Tensor, m: int, n: int, k: int, b_transposed: bool, sm_count: int,
                  warp_specialize: bool = True) -> GemmBlocks:
    """The block table's choice for this GEMM (`plain` blocks with warp_specialize=False)."""
    return choose_blocks(m, n, k, b_transposed=b_transposed, device_type=a.device.type,
                         warp_specialize=warp_specialize, sm_count=sm_count, gpu=gpu_name(a.device))
