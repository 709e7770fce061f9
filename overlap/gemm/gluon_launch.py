"""Launcher of the Gluon bf16/fp16 GEMM (kernels/gemm_gluon.py): the operands TMA can read, the host tensor
descriptors, grid and argument order. `triton_mm` calls it for blocks named `...gl` (overlap/gemm/blocks.py
checks which blocks the kernel runs)."""

from __future__ import annotations

import functools

import torch

from tp_overlap.kernels.constants import GLUON_MAX_SPLITS

from .blocks import GemmBlocks
from .launch import ChunkWait, Scatter, b_operand, tma_descriptor, tma_row_problems
from .workspaces import stream_buffers

GLUON_NUM_WARPS = 4             # the default partition: one consumer warpgroup (+ 4 + 1 worker warps)
GLUON_DTYPES = (torch.bfloat16, torch.float16)
MAX_SCATTER_OWNERS = 8          # kernels/gemm_gluon_scatter.py's descriptor arguments (a node's GPUs)
# The split tail's cost model (`split_plan`): one SM's bf16 rate at full tensor-core use (~740 TFLOP/s on
# 132 SMs), a split item's partial store and count, each partial the last arrival reads back (fitted to
# forced splits of 128x128 and 128x256 tiles on an H200; the tuner still compares sk1 with whole tiles: the
# model does not see L2 bandwidth, which limits 128x128 tiles on every SM).
SM_FLOPS = 5.6e12
SPLIT_ITEM_S = 3.0e-6
SPLIT_READ_S = 1.0e-6

__all__ = ["chunk_args", "gluon_operand_problems", "gluon_placeholders", "launch_gluon_gemm", "split_plan",
           "modelled_seconds", "split_buffers", "split_tail", "scatter_descriptors", "launch_gluon_scatter",
           "reduce_descriptors", "launch_gluon_scatter_reduce"]


def gluon_operand_problems(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> list[str]:
    """TMA reads rows that are contiguous, with 16-byte aligned bases and row strides (bf16: multiples of 8
    elements). `b` is the row-major tensor as stored ([K, N], or [N, K] for a transposed weight)."""
    problems = []
    if not (a.dtype == b.dtype == out.dtype and a.dtype in GLUON_DTYPES):
        problems.append(f"gluon: dtypes a {a.dtype}, b {b.dtype}, out {out.dtype}; allowed: one of {GLUON_DTYPES}")
    return problems + tma_row_problems((("a", a), ("b", b), ("out", out)))


@functools.lru_cache(maxsize=1024)
def split_plan(tiles: int, programs: int, k_steps: int, tile_flops: int, max_items: int | None = None,
               split_build_slowdown: float = 0.0) -> tuple[int, int]:
    """(whole tiles, splits) for `tiles` output tiles on `programs` programs: the tiles of the last, partial
    wave (all of them when there are fewer than programs) are cut into `splits` K ranges when the cost model
    says the launch finishes sooner than with whole tiles (splits 1: no split), into at most `max_items` pieces
    in all (a caller's fixed workspace). `split_build_slowdown`: how much slower every tile runs in a launch
    that cuts a tail, for a kernel whose whole-tile launches run a build without the split path (FP8)."""
    tail = tiles % programs
    _, splits = _planned(tiles, programs, k_steps, tile_flops, max_items, split_build_slowdown)
    return (tiles - tail, splits) if splits > 1 else (tiles, 1)


def _planned(tiles: int, programs: int, k_steps: int, tile_flops: int, max_items: int | None = None,
             split_build_slowdown: float = 0.0) -> tuple[float, int]:
    """(modelled seconds, splits) of `split_plan`'s best plan."""
    tail = tiles % programs
    tile_s = tile_flops / SM_FLOPS
    full_waves_s = tiles // programs * tile_s
    best_s, best = full_waves_s + (tile_s if tail else 0.0), 1
    if tail == 0 or k_steps < 2:
        return best_s, best
    for splits in range(2, min(GLUON_MAX_SPLITS, k_steps) + 1):
        if max_items is not None and tail * splits > max_items:
            break
        waves = -(-tail * splits // programs)
        tail_s = waves * (tile_s / splits + SPLIT_ITEM_S) + splits * SPLIT_READ_S
        seconds = (full_waves_s + tail_s) * (1 + split_build_slowdown)
        if seconds < best_s:
            best_s, best = seconds, splits
    return best_s, best


def modelled_seconds(blocks: GemmBlocks, m: int, n: int, k: int, programs: int) -> float:
    """`split_plan`'s cost model of a whole bf16 launch on `programs` programs: whole rounds of tiles, the last
    partial one cut by K where `blocks` has `sk1` and cutting pays (what the fused ops' block choice compares
    tile widths by: gemm/fused_blocks.py `fused_gluon_blocks`)."""
    tiles = -(-m // blocks.block_m) * -(-n // blocks.block_n)
    tile_flops = 2 * blocks.block_m * blocks.block_n * k
    if blocks.stream_k:
        return _planned(tiles, programs, -(-k // blocks.block_k), tile_flops)[0]
    return -(-tiles // programs) * tile_flops / SM_FLOPS


@functools.cache
def gluon_placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split arguments of a launch without a split tail (never read; typed as the real ones). Ops call it
    at construction: made lazily inside a torch.compile warm-up, they would be refused (CUDA-graph trees)."""
    return torch.empty(1, dtype=torch.float32, device=device), torch.zeros(1, dtype=torch.int32, device=device)


def chunk_args(wait: ChunkWait | None, device: torch.device) -> tuple:
    """The kernel's chunk_args (kernels/gemm_gluon_wait.py); without a wait, 0 chunks per rank and placeholders
    of the real arguments' types (never read), so that both launch the same compiled kernel."""
    if wait is None:
        placeholder = gluon_placeholders(device)[1]
        return placeholder, 0, 1, placeholder, 0, 1 << 40
    return (wait.flags, wait.chunks_per_rank, wait.rows_per_rank, wait.error_words, wait.error_code_base,
            int(wait.timeout_s * 1e9))


def split_buffers(device: torch.device, programs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A split tail's (fp32 workspace, int32 counters at zero) for `programs` programs, to own and pass as
    `split_buffers=`: room for `programs` pieces of the widest tile (128 x 256; twice as many of 128 x 128), so
    `split_plan` cuts a last partial wave into no more (~128 KiB a program). Allocated by a caller once
    (an op at construction: outside any capture), used by one launch at a time (stream-ordered)."""
    return (torch.empty(programs * 128 * 256, dtype=torch.float32, device=device),
            torch.zeros(3 * programs, dtype=torch.int32, device=device))  # a counter per split tile and consumer


def split_tail(blocks: GemmBlocks, m: int, n: int, k: int, num_programs: int, device: torch.device,
               buffers: tuple[torch.Tensor, torch.Tensor] | None, operand_bytes: int = 2,
               split_build_slowdown: float = 0.0) -> tuple:
    """(programs, whole tiles, splits, workspace, counters) of a launch (module `split_plan`): `buffers` given,
    at most as many pieces as they hold; else the current stream's (`stream_buffers`). `operand_bytes` 1: FP8,
    whose tensor cores run at twice the bf16 rate the cost model assumes; `split_build_slowdown`: `split_plan`'s."""
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    tiles = -(-m // bm) * -(-n // bn)
    programs = max(1, min(tiles, num_programs))
    if not blocks.stream_k:
        return (programs, tiles, 1) + gluon_placeholders(device)
    max_items = buffers[0].numel() // (bm * bn) if buffers is not None else None
    whole, splits = split_plan(tiles, num_programs, -(-k // bk), bm * bn * k * operand_bytes, max_items,
                               split_build_slowdown)
    if splits == 1:
        return (programs, tiles, 1) + gluon_placeholders(device)
    split_tiles = tiles - whole
    if not 1 < splits <= min(GLUON_MAX_SPLITS, -(-k // bk)):  # the kernel's precondition: no empty piece
        raise ValueError(f"gluon GEMM: {splits} splits of {-(-k // bk)} K steps")
    if buffers is None:  # one growing pair per stream: every launch leaves the counters at zero
        buffers = stream_buffers(device, ("gluon_split",), split_tiles * splits * bm * bn, bm // 64 * split_tiles)
    elif split_tiles > buffers[1].numel() // (bm // 64):
        raise ValueError(f"gluon GEMM: {split_tiles} split tiles, counters for {buffers[1].numel() // (bm // 64)}")
    return (min(num_programs, whole + split_tiles * splits), whole, splits) + tuple(buffers)


def launch_gluon_gemm(*, a: torch.Tensor, b: torch.Tensor, b_transposed: bool, out: torch.Tensor, blocks: GemmBlocks,
                      num_programs: int, tile_row_offset: int = 0, chunk_wait: ChunkWait | None = None,
                      split_buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """out [M, N] = a [M, K] @ B on the current stream, B = b [K, N] or, `b_transposed`, b [N, K] read as its
    transpose. The caller checked `blocks.problems()` and `gluon_operand_problems` (`triton_mm` does).
    Blocks with `sk1` cut the last partial wave by K (`split_plan`) into the workspace and counters of
    `split_buffers` (module `split_buffers`), else of the current stream (allocated on its first use there:
    warm up before a CUDA-graph capture).
    `chunk_wait`: the fused AllGather consumer, each tile's A rows read once their chunk flags are SET
    (`a` is the gathered [M, K]; not with `gluon_boxes` blocks)."""
    from tp_overlap.kernels.gemm_gluon import gluon_gemm_kernel

    if chunk_wait is not None and blocks.gluon_boxes:
        raise ValueError(f"launch_gluon_gemm: blocks {blocks.name!r} (two B boxes) have no chunk wait")
    m, k = a.shape
    n = out.shape[1]
    if not (m and n):
        return
    if not k:  # no K step: the consumers would release a slot no load filled
        out.zero_()
        return
    if blocks.gluon_boxes:
        _launch_boxes(a, b, b_transposed, out, blocks, num_programs, tile_row_offset)
        return
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    programs, whole, splits, workspace, counters = split_tail(blocks, m, n, k, num_programs, a.device, split_buffers)
    gluon_gemm_kernel[(programs,)](
        tma_descriptor(a, (128 if bm == 128 else 64, bk)), tma_descriptor(b, (bn, bk) if b_transposed else (bk, bn)),
        tma_descriptor(out, (64, bn)), m, n, k, tile_row_offset, whole, splits, workspace, counters,
        chunk_args(chunk_wait, a.device), NUM_STAGES=blocks.num_stages, B_TRANSPOSED=b_transposed, CONSUMERS=bm // 64,
        num_warps=GLUON_NUM_WARPS)


def _launch_boxes(a, b, b_transposed, out, blocks: GemmBlocks, num_programs: int, tile_row_offset: int) -> None:
    """kernels/gemm_gluon_boxes.py: the tile's B in two boxes of `blocks.gluon_boxes` columns."""
    from tp_overlap.kernels.gemm_gluon_boxes import gluon_boxes_gemm_kernel

    m, k = a.shape
    n = out.shape[1]
    bm, bk = blocks.block_m, blocks.block_k
    bn0, bn1 = blocks.gluon_boxes
    tiles = -(-m // bm) * -(-n // blocks.block_n)
    b_boxes = ((bn0, bk), (bn1, bk)) if b_transposed else ((bk, bn0), (bk, bn1))
    gluon_boxes_gemm_kernel[(max(1, min(tiles, num_programs)),)](
        tma_descriptor(a, (bm, bk)), tma_descriptor(b, b_boxes[0]), tma_descriptor(b, b_boxes[1]),
        tma_descriptor(out, (64, bn0)), tma_descriptor(out, (64, bn1)), m, n, k, tile_row_offset,
        NUM_STAGES=blocks.num_stages, B_TRANSPOSED=b_transposed, num_warps=GLUON_NUM_WARPS)


def scatter_descriptors(slabs: list[torch.Tensor], blocks: GemmBlocks) -> tuple | None:
    """The host TMA descriptors of this source's slab [rows_per_rank, N] in every owner's partials buffer (in
    owner order), in [64, BLOCK_N] boxes; None when TMA cannot write one of them, or for more than
    MAX_SCATTER_OWNERS owners (the caller runs the @triton.jit scatter); with two B boxes (`gluon_boxes`) in
    [64, BN0] boxes (the first box's columns: kernels/gemm_gluon_scatter_boxes.py). Built once per plan: the
    slabs are pool memory."""
    if len(slabs) > MAX_SCATTER_OWNERS or \
            tma_row_problems(tuple((f"slab {owner}", slab) for owner, slab in enumerate(slabs))):
        return None
    width = blocks.gluon_boxes[0] if blocks.gluon_boxes else blocks.block_n
    return tuple(tma_descriptor(slab, (64, width)) for slab in slabs)


def launch_gluon_scatter(*, a: torch.Tensor, w: torch.Tensor, descriptors: tuple, scatter: Scatter, blocks: GemmBlocks,
                         num_programs: int, tile_row_offset: int,
                         split_buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """a [M, K] @ w [K, N] (row-major, or the transpose view of a row-major [N, K]) scattered by
    kernels/gemm_gluon_scatter.py into the owners' slabs (`scatter_descriptors`), each finished 128-row block
    published on the owners' flags (`scatter`), on the current stream. `blocks`: Gluon, BLOCK_M 128; with
    `sk1`, the last partial wave cut by K as `launch_gluon_gemm` cuts it (`split_buffers` likewise); with two B
    boxes (`gluon_boxes`: a width that is not a power of two), kernels/gemm_gluon_scatter_boxes.py, whole tiles."""
    from tp_overlap.kernels.gemm_gluon_scatter import gluon_scatter_gemm_kernel

    m, k = a.shape
    b, _, b_transposed = b_operand(w)
    n, bk = w.shape[1], blocks.block_k
    if blocks.gluon_boxes:
        _launch_scatter_boxes(a, b, b_transposed, descriptors, scatter, blocks, num_programs, tile_row_offset)
        return
    programs, whole, splits, workspace, counters = split_tail(blocks, m, n, k, num_programs, a.device, split_buffers)
    b_box = (blocks.block_n, bk) if b_transposed else (bk, blocks.block_n)
    owners = (*descriptors, *descriptors[:1] * (MAX_SCATTER_OWNERS - len(descriptors)))  # past W: never used
    gluon_scatter_gemm_kernel[(programs,)](
        tma_descriptor(a, (128, bk)), tma_descriptor(b, b_box), *owners, m, n, k, tile_row_offset, whole, splits,
        workspace, counters, scatter.rows_per_rank, scatter.src_rank, scatter.flag_ptrs, scatter.tile_counters,
        scatter.flags_per_source, scatter.dst_ptrs, chunk_args(None, a.device), NUM_STAGES=blocks.num_stages,
        B_TRANSPOSED=b_transposed, num_warps=GLUON_NUM_WARPS)


def _launch_scatter_boxes(a, b, b_transposed, descriptors: tuple, scatter: Scatter, blocks: GemmBlocks,
                          num_programs: int, tile_row_offset: int) -> None:
    """kernels/gemm_gluon_scatter_boxes.py: `launch_gluon_scatter` for blocks whose tile is two B boxes wide."""
    from tp_overlap.kernels.gemm_gluon_scatter_boxes import gluon_scatter_boxes_gemm_kernel

    m, k = a.shape
    n, bk = b.shape[0] if b_transposed else b.shape[1], blocks.block_k
    bn0, bn1 = blocks.gluon_boxes
    boxes = ((bn0, bk), (bn1, bk)) if b_transposed else ((bk, bn0), (bk, bn1))
    tiles = -(-m // 128) * -(-n // blocks.block_n)
    owners = (*descriptors, *descriptors[:1] * (MAX_SCATTER_OWNERS - len(descriptors)))  # past W: never used
    gluon_scatter_boxes_gemm_kernel[(max(1, min(tiles, num_programs)),)](
        tma_descriptor(a, (128, bk)), tma_descriptor(b, boxes[0]), tma_descriptor(b, boxes[1]), *owners, m, n, k,
        tile_row_offset, scatter.rows_per_rank, scatter.src_rank, scatter.flag_ptrs, scatter.tile_counters,
        scatter.flags_per_source, scatter.dst_ptrs, NUM_STAGES=blocks.num_stages, B_TRANSPOSED=b_transposed,
        num_warps=GLUON_NUM_WARPS)


def reduce_descriptors(own_slots: torch.Tensor, blocks: GemmBlocks):
    """The host TMA descriptor of this rank's partials buffer, its slots [W, rows_per_rank, N] read as
    [W * rows_per_rank, N] in [64, BLOCK_N] boxes (kernels/gemm_gluon_reduce.py); None when TMA cannot read it.
    Built once per plan: the slots are pool memory."""
    rows = own_slots.reshape(-1, own_slots.shape[-1])
    return None if tma_row_problems((("own slots", rows),)) else tma_descriptor(rows, (64, blocks.block_n))


def launch_gluon_scatter_reduce(*, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, descriptors: tuple,
                                own_descriptor, scatter: Scatter, blocks: GemmBlocks, num_programs: int) -> None:
    """out [M/W, N] = this rank's rows of the sum over every rank of a [M, K] @ w [K, N], by
    kernels/gemm_gluon_reduce.py on the current stream: the other owners' rows scattered into their slabs
    (`scatter_descriptors`) and published, the own rows summed from the own slots (`reduce_descriptors`) once
    every other source's flags hold M. `blocks`: one-box Gluon, BLOCK_M 128, whole tiles (no `sk1`); needs
    M/W % 128 == 0, K > 0 and `out` readable by TMA (the caller checks). The grid is at most `num_programs`
    (all resident: the SMs the caller leaves free)."""
    from tp_overlap.kernels.gemm_gluon_reduce import gluon_scatter_reduce_gemm_kernel

    m, k = a.shape
    b, _, b_transposed = b_operand(w)
    n, bk, rows = w.shape[1], blocks.block_k, scatter.rows_per_rank
    tiles = -(-m // 128) * -(-n // blocks.block_n)
    placeholder = gluon_placeholders(a.device)[1]
    b_box = (blocks.block_n, bk) if b_transposed else (bk, blocks.block_n)
    owners = (*descriptors, *descriptors[:1] * (MAX_SCATTER_OWNERS - len(descriptors)))  # past W: never used
    gluon_scatter_reduce_gemm_kernel[(max(1, min(tiles, num_programs)),)](
        tma_descriptor(a, (128, bk)), tma_descriptor(b, b_box), *owners, own_descriptor,
        tma_descriptor(out, (64, blocks.block_n)), m, n, k, scatter.src_rank * rows // 128, rows, scatter.src_rank,
        scatter.flag_ptrs, scatter.tile_counters, scatter.flags_per_source, scatter.dst_ptrs, scatter.error_words,
        scatter.error_code_base, int(scatter.timeout_s * 1e9), (placeholder, 0, rows, placeholder, 0, 1 << 40),
        NUM_STAGES=blocks.num_stages, B_TRANSPOSED=b_transposed, num_warps=GLUON_NUM_WARPS)
