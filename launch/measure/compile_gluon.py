"""Compile the Gluon kernels for a CUDA target without a GPU (`compile_check`'s Gluon half): the kernels as
their launchers call them, host tensor descriptors written `tensordesc<dtype[block],layout>`."""

from __future__ import annotations

import functools

from tp_overlap.gemm import GemmBlocks

# kernels/gemm_gluon_wait.py's chunk_args: chunk flags, chunks per rank, rows per rank, error words, code, timeout
_GLUON_CHUNK_ARGS = ("*i32:16", "i32", "i32", "*i32:16", "i32", "i64")


def _signature(fn, types: dict, constexprs: dict) -> tuple[dict, dict, dict]:
    """(signature, constants, attrs) of `fn` for an ASTSource (see `compile_for_target`)."""
    signature, attrs, constants = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            constants[(index,)] = constexprs[name]
        elif name in types and isinstance(types[name], tuple):
            elements = []
            for position, element in enumerate(types[name]):
                if isinstance(element, int):
                    elements.append("constexpr")
                    constants[(index, position)] = element
                else:
                    elements.append(_typed(element, (index, position), attrs))
            signature[name] = tuple(elements)
        elif name in types:
            signature[name] = _typed(types[name], (index,), attrs)
        else:
            raise KeyError(f"{fn.__name__}: no type or value for argument {name!r}")
    return signature, constants, attrs


def _typed(kind: str, path: tuple, attrs: dict) -> str:
    kind, _, divisible = kind.partition(":")
    if divisible:
        attrs[path] = [["tt.divisibility", 16]]
    return kind


def compile_gluon(fn, types: dict, constexprs: dict, *, num_warps: int, arch: int = 90):
    """triton.compile of the Gluon kernel `fn` for sm_<arch> (types and constexprs as `compile_for_target`,
    tensor descriptors written `tensordesc<dtype[block],layout>`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature, constants, attrs = _signature(fn, types, constexprs)
    source = GluonASTSource(fn, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def _gluon_descriptor(layout_of, dtype: str, block: list[int]) -> str:
    import torch

    torch_dtype = {"fp8e4nv": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16,
                   "fp32": torch.float32}[dtype]
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}],{layout_of(tuple(block), torch_dtype)!r}>"


def compile_fp8_gluon_gemm(blocks: GemmBlocks, *, arch: int = 90, a_scales_group_major: bool = True,
                           split_tail: bool | None = None):
    """The Gluon FP8 GEMM (kernels/gemm_fp8_gluon.py) as overlap/gemm/fp8_gluon_launch.py launches it: host
    descriptors of A [128, 128], B [BLOCK_N, 128] e4m3, C [64, BLOCK_N] bf16 and the scale boxes fp32: A [1, 128]
    (group-major) or [128, 4] (row-major), B [1, 4] (a 256-wide tile's [2, 4]); `split_tail` False: the build of
    whole-tile launches (None: the split build where the blocks can cut a tail, i.e. up to 128 wide)."""
    from tp_overlap.kernels.gemm_fp8_gluon import fp8_gluon_gemm_kernel
    from tp_overlap.gemm.fp8_gluon_launch import B_SCALE_BOX, b_scale_box, splits_tail
    from tp_overlap.gemm.launch import tma_shared_layout

    if split_tail is None:
        split_tail = splits_tail(blocks.block_n)

    def descriptor(dtype: str, block: list[int]) -> str:
        return _gluon_descriptor(tma_shared_layout, dtype, block)

    a_scale_box = [1, blocks.block_m] if a_scales_group_major else [blocks.block_m, B_SCALE_BOX]
    types = dict(a_desc=descriptor("fp8e4nv", [blocks.block_m, 128]),
                 b_desc=descriptor("fp8e4nv", [blocks.block_n, 128]),
                 c_desc=descriptor("bf16", [blocks.block_m // 2, blocks.block_n]),
                 a_scale_desc=descriptor("fp32", a_scale_box), b_scale_desc=descriptor("fp32", list(b_scale_box(blocks.block_n))),
                 M="i32", N="i32", K="i32", tile_row_offset="i32", num_whole_tiles="i32", splits="i32",
                 workspace="*fp32:16", counters="*i32:16", chunk_args=_GLUON_CHUNK_ARGS)
    constexprs = dict(NUM_STAGES=blocks.num_stages, SPLIT_TAIL=split_tail, MMA_REGS=232, LOAD_REGS=40)
    return compile_gluon(fp8_gluon_gemm_kernel, types, constexprs, num_warps=blocks.num_warps, arch=arch)


def compile_gluon_gemm(blocks: GemmBlocks, *, b_transposed: bool, arch: int = 90, dtype: str = "bf16"):
    """The Gluon bf16/fp16 GEMM (kernels/gemm_gluon.py) as overlap/gemm/gluon_launch.py launches it: host
    descriptors of A [128, BLOCK_K], B [BLOCK_K, BLOCK_N] (or [BLOCK_N, BLOCK_K] transposed), C [64, BLOCK_N]."""
    from tp_overlap.kernels.gemm_gluon import gluon_gemm_kernel
    from tp_overlap.gemm.launch import tma_shared_layout

    if blocks.gluon_boxes:
        return _compile_gluon_boxes_gemm(blocks, b_transposed=b_transposed, arch=arch, dtype=dtype)
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    types = dict(a_desc=_gluon_descriptor(tma_shared_layout, dtype, [128 if bm == 128 else 64, bk]),
                 b_desc=_gluon_descriptor(tma_shared_layout, dtype, [bn, bk] if b_transposed else [bk, bn]),
                 c_desc=_gluon_descriptor(tma_shared_layout, dtype, [64, bn]), M="i32", N="i32", K="i32",
                 tile_row_offset="i32", num_whole_tiles="i32", splits="i32", workspace="*fp32:16",
                 counters="*i32:16", chunk_args=_GLUON_CHUNK_ARGS)
    constexprs = dict(NUM_STAGES=blocks.num_stages, B_TRANSPOSED=b_transposed, CONSUMERS=bm // 64, LOAD_REGS=40)
    return compile_gluon(gluon_gemm_kernel, types, constexprs, num_warps=blocks.num_warps, arch=arch)


def _compile_gluon_boxes_gemm(blocks: GemmBlocks, *, b_transposed: bool, arch: int, dtype: str):
    """kernels/gemm_gluon_boxes.py as overlap/gemm/gluon_launch.py launches it: A [BLOCK_M, BLOCK_K], B in boxes of
    BN0 and BN1 columns, C [64, BN0] and [64, BN1]."""
    from tp_overlap.kernels.gemm_gluon_boxes import gluon_boxes_gemm_kernel
    from tp_overlap.gemm.launch import tma_shared_layout

    bk, widths = blocks.block_k, blocks.gluon_boxes
    desc = functools.partial(_gluon_descriptor, tma_shared_layout, dtype)
    types = dict(a_desc=desc([blocks.block_m, bk]), M="i32", N="i32", K="i32", tile_row_offset="i32")
    for i, bn in enumerate(widths):
        types |= {f"b{i}_desc": desc([bn, bk] if b_transposed else [bk, bn]), f"c{i}_desc": desc([64, bn])}
    constexprs = dict(NUM_STAGES=blocks.num_stages, B_TRANSPOSED=b_transposed)
    return compile_gluon(gluon_boxes_gemm_kernel, types, constexprs, num_warps=blocks.num_warps, arch=arch)


def compile_gluon_scatter_gemm(blocks: GemmBlocks, *, b_transposed: bool, arch: int = 90):
    """kernels/gemm_gluon_scatter.py as overlap/gemm/gluon_launch.py launches it: A [128, BLOCK_K], B boxes as
    the Gluon GEMM's, one [64, BLOCK_N] descriptor per owner's slab."""
    from tp_overlap.kernels.gemm_gluon_scatter import gluon_scatter_gemm_kernel
    from tp_overlap.gemm.launch import tma_shared_layout

    bn, bk = blocks.block_n, blocks.block_k
    desc = functools.partial(_gluon_descriptor, tma_shared_layout, "bf16")
    if blocks.gluon_boxes:
        return _compile_gluon_scatter_boxes_gemm(blocks, b_transposed=b_transposed, arch=arch)
    types = dict(a_desc=desc([128, bk]), b_desc=desc([bn, bk] if b_transposed else [bk, bn]),
                 **{f"dst{owner}": desc([64, bn]) for owner in range(8)},
                 **{name: "i32" for name in ("M", "N", "K", "tile_row_offset", "num_whole_tiles", "splits",
                                             "rows_per_rank", "src_rank", "flags_per_source")},
                 workspace="*fp32:16", counters="*i32:16",
                 flag_ptrs="*i64:16", tile_counters="*i32:16", dst_ptrs="*i64:16", chunk_args=_GLUON_CHUNK_ARGS)
    constexprs = dict(NUM_STAGES=blocks.num_stages, B_TRANSPOSED=b_transposed, LOAD_REGS=40)
    return compile_gluon(gluon_scatter_gemm_kernel, types, constexprs, num_warps=blocks.num_warps, arch=arch)


def _compile_gluon_scatter_boxes_gemm(blocks: GemmBlocks, *, b_transposed: bool, arch: int):
    """kernels/gemm_gluon_scatter_boxes.py as overlap/gemm/gluon_launch.py launches it: A [128, BLOCK_K], B in
    boxes of BN0 and BN1 columns, one [64, BN0] descriptor per owner's slab."""
    from tp_overlap.kernels.gemm_gluon_scatter_boxes import gluon_scatter_boxes_gemm_kernel
    from tp_overlap.gemm.launch import tma_shared_layout

    bk, (bn0, bn1) = blocks.block_k, blocks.gluon_boxes
    desc = functools.partial(_gluon_descriptor, tma_shared_layout, "bf16")
    types = dict(a_desc=desc([128, bk]), **{f"b{i}_desc": desc([bn, bk] if b_transposed else [bk, bn])
                                            for i, bn in enumerate((bn0, bn1))},
                 **{f"dst{owner}": desc([64, bn0]) for owner in range(8)},
                 **{name: "i32" for name in ("M", "N", "K", "tile_row_offset", "rows_per_rank", "src_rank",
                                             "flags_per_source")},
                 flag_ptrs="*i64:16", tile_counters="*i32:16", dst_ptrs="*i64:16")
    constexprs = dict(NUM_STAGES=blocks.num_stages, B_TRANSPOSED=b_transposed, LOAD_REGS=40)
    return compile_gluon(gluon_scatter_boxes_gemm_kernel, types, constexprs, num_warps=blocks.num_warps, arch=arch)


def compile_gluon_reduce_gemm(blocks: GemmBlocks, *, b_transposed: bool, arch: int = 90):
    """kernels/gemm_gluon_reduce.py as overlap/gemm/gluon_launch.py launches it: the scatter GEMM's descriptors,
    the own partials and the output shard in [64, BLOCK_N] boxes."""
    from tp_overlap.kernels.gemm_gluon_reduce import gluon_scatter_reduce_gemm_kernel
    from tp_overlap.gemm.launch import tma_shared_layout

    bn, bk = blocks.block_n, blocks.block_k
    desc = functools.partial(_gluon_descriptor, tma_shared_layout, "bf16")
    types = dict(a_desc=desc([128, bk]), b_desc=desc([bn, bk] if b_transposed else [bk, bn]),
                 **{f"dst{owner}": desc([64, bn]) for owner in range(8)}, own_desc=desc([64, bn]),
                 out_desc=desc([64, bn]),
                 **{name: "i32" for name in ("M", "N", "K", "own_first_row_block", "rows_per_rank", "src_rank",
                                             "flags_per_source", "error_code_base")},
                 flag_ptrs="*i64:16", tile_counters="*i32:16", dst_ptrs="*i64:16", error_ptr="*i32:16",
                 timeout_ns="i64", chunk_args=("*i32:16", "i32", "i32:16", "*i32:16", "i32", "i64"))
    constexprs = dict(NUM_STAGES=blocks.num_stages, B_TRANSPOSED=b_transposed, LOAD_REGS=40)
    return compile_gluon(gluon_scatter_reduce_gemm_kernel, types, constexprs, num_warps=blocks.num_warps, arch=arch)
