"""Private launcher of the Gluon FP8 GEMM (kernels/gemm_fp8_gluon.py): host tensor descriptors, grid and
argument order. Operands are validated by overlap/gemm/fp8.py; what only this kernel needs (TMA alignment, its
tile shapes) is checked here."""

from __future__ import annotations

import torch

from tp_overlap.kernels.constants import SCALE_GROUP

from .blocks import GemmBlocks
from .gluon_launch import chunk_args, split_tail
from .launch import ChunkWait, tma_descriptor, tma_row_problems
from .triton_gemm import num_sms

GLUON_BLOCK_M = 128           # two consumer warpgroups of 64 rows
GLUON_BLOCK_NS = (64, 128, 256)  # one B scale per tile and K group, or per 128-column sub-tile (256)
GLUON_NUM_WARPS = 4           # the default partition: one consumer warpgroup (+ 4 + 1 + 1 + 1 worker warps)
GLUON_GROUP_M = 8             # fixed in the kernel (kernels/gemm_gluon_walk.py GROUP_M)
GLUON_MAX_STAGES = 5          # 6 x (32 KiB of A and B + their scales) + 32 KiB of C staging > 227 KiB
GLUON_WIDE_MAX_STAGES = 3     # 256 wide: 4 x (48 KiB + scales) + 64 KiB of C staging > 227 KiB
B_SCALE_BOX = 4               # B scales per TMA load (kernels/gemm_fp8_gluon.py B_SCALE_BOX)
# Every tile of a launch that cuts a split tail runs the kernel's build with the split path, 4-5 % slower than the
# whole-tile build (H100), so a tail is cut only where that gains more than it costs (few waves). 0.02 is fitted
# to the fused consumer on an H100 (results/logs/one_gpu_184dd85/at_ed3d448_ops_probe.txt): a cut tail gained at
# 3.4 waves of 128x128x4096 tiles and lost 1-4 % at 27 to 217 waves; the model chooses both only for values from
# 0.008 to 0.021, not the build's own slowdown (split_plan's tail cost, fitted to bf16 tiles, is high for FP8).
SPLIT_BUILD_SLOWDOWN = 0.02


def gluon_block_problems(blocks: GemmBlocks) -> list[str]:
    """Why the Gluon kernel cannot run these blocks (empty when it can); `sk1`: the last partial wave split by K."""
    out = []
    for name, allowed in (("block_m", (GLUON_BLOCK_M,)), ("block_n", GLUON_BLOCK_NS), ("block_k", (SCALE_GROUP,)),
                          ("num_warps", (GLUON_NUM_WARPS,)), ("group_m", (GLUON_GROUP_M,)), ("programs_per_sm", (1,)),
                          ("num_stages", tuple(range(2, GLUON_MAX_STAGES + 1))), ("stream_k", (0, 1))):
        value = getattr(blocks, name)
        if value not in allowed:
            out.append(f"gluon: {name} {value} not in {allowed}")
    if not splits_tail(blocks.block_n) and blocks.stream_k:
        out.append(f"gluon: block_n {blocks.block_n} runs whole tiles only (no sk1)")
    if not splits_tail(blocks.block_n) and blocks.num_stages > GLUON_WIDE_MAX_STAGES:
        out.append(f"gluon: block_n {blocks.block_n} fits at most {GLUON_WIDE_MAX_STAGES} stages")
    return out


def splits_tail(block_n: int) -> bool:
    """Whether tiles `block_n` wide can cut a split tail (`sk1`): up to 128 wide; 256-wide tiles (two sub-tiles)
    run whole."""
    return block_n <= SCALE_GROUP


def b_scale_box(block_n: int) -> tuple[int, int]:
    """The TMA box of the B scales: a row of B_SCALE_BOX groups per 128-column sub-tile of the tile."""
    return max(1, block_n // SCALE_GROUP), B_SCALE_BOX


def gluon_operand_problems(*, a8: torch.Tensor, a_scales: torch.Tensor, w8: torch.Tensor, w_scales: torch.Tensor,
                           out: torch.Tensor) -> list[str]:
    """TMA needs rows that are contiguous, with 16-byte aligned bases and row strides: e4m3 K % 16 == 0, bf16
    C N % 8 == 0; the A scales either group-major ([cdiv(K, 128), M] storage, as `quantize_activation`
    makes them: M % 4 == 0) or row-major with rows padded to 4 scales (an AllGather pool's); the B scales
    row-major with such rows (`quantize_weight` pads them)."""
    return tma_row_problems((("a8", a8), ("w8", w8), ("out", out), ("a_scales", _a_scale_rows(a_scales)),
                             ("w_scales", w_scales)))


def _a_scale_rows(a_scales: torch.Tensor) -> torch.Tensor:
    """The A scales as TMA reads them: the [groups, M] storage when group-major, else as they are."""
    return a_scales.t() if a_scales.stride(0) == 1 and a_scales.stride(1) != 1 else a_scales


def _a_scale_descriptor(a_scales: torch.Tensor):
    rows = _a_scale_rows(a_scales)
    # group-major: a group's scales of the tile's 128 rows per load; row-major: the tile's rows, 4 groups
    return tma_descriptor(rows, (1, GLUON_BLOCK_M) if rows is not a_scales else (GLUON_BLOCK_M, B_SCALE_BOX))


def launch_fp8_gluon_gemm(*, a8: torch.Tensor, a_scales: torch.Tensor, w8: torch.Tensor, w_scales: torch.Tensor,
                          out: torch.Tensor, blocks: GemmBlocks, num_programs: int | None = None, checked: bool = False,
                          tile_row_offset: int = 0, chunk_wait: ChunkWait | None = None,
                          split_buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """out [M, N] = (a8 * a_scales) @ (w8 * w_scales).T on the current stream (layouts of overlap/gemm/fp8.py).
    `checked`: the caller has validated the operands and blocks (fp8_gemm: once per call, on the hot path).
    `chunk_wait`: the fused AllGather consumer (each tile's rows and scales read once their chunks are SET).
    Blocks with `sk1` cut the last partial wave by K into `split_buffers` (gluon_launch.split_buffers), else into
    the current stream's (as launch_gluon_gemm); a launch of whole tiles only runs the kernel's build without the
    split path (`SPLIT_TAIL`)."""
    from tp_overlap.kernels.gemm_fp8_gluon import fp8_gluon_gemm_kernel

    if not checked:
        problems = gluon_operand_problems(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales, out=out)
        problems += gluon_block_problems(blocks)
        if problems:
            raise ValueError(f"fp8 gluon GEMM: {'; '.join(problems)}")
    m, k = a8.shape
    n, block_n = w8.shape[0], blocks.block_n
    programs, whole, splits, workspace, counters = split_tail(blocks, m, n, k, num_programs or num_sms(a8.device),
                                                              a8.device, split_buffers, operand_bytes=1,
                                                              split_build_slowdown=SPLIT_BUILD_SLOWDOWN)
    fp8_gluon_gemm_kernel[(programs,)](
        tma_descriptor(a8, (GLUON_BLOCK_M, SCALE_GROUP)), tma_descriptor(w8, (block_n, SCALE_GROUP)),
        tma_descriptor(out, (GLUON_BLOCK_M // 2, block_n)), _a_scale_descriptor(a_scales),
        tma_descriptor(w_scales, b_scale_box(block_n)), m, n, k, tile_row_offset, whole, splits, workspace, counters,
        chunk_args(chunk_wait, a8.device), NUM_STAGES=blocks.num_stages, SPLIT_TAIL=splits > 1,
        num_warps=GLUON_NUM_WARPS)
