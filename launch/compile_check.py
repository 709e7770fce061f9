"""Compile the GEMM kernels for a CUDA target without a GPU: does every configuration we might launch
compile with this Triton, and what does it cost in shared memory, registers and spills?

    python -m tp_overlap.launch.compile_check [--table] [--candidates] [--fp8] [--configs NAME,...] [--jobs 2]
    python -m tp_overlap.launch.compile_check --sass DIR [--only scatter,fp8]

The target is sm_90 (Hopper). `--table` checks every configuration of the block tables
(configs/gemm_blocks/), `--candidates` the sweep of launch.gemm_tune, `--fp8` the FP8 GEMM's candidates and
the quantisers, `--configs` the bf16 configurations named (BMxBNxBKw<warps>s<stages>[g<group>][ws][fl][es2]
[sk<waves>][o2][sp<splits>], e.g. 128x256x64w8s3 or the split-K 128x128x64w4s3sp4); give at least one of
the four. Exit status 1 when a configuration fails to compile or spills registers. Runs on CPU (Triton's own
ptxas); it checks the compiler, not speed or results. `--sass DIR` writes the SASS of every Gluon GEMM build the
launchers use instead (launch/measure/sass.py; `--only` keeps the builds whose label contains one of the
comma-separated words): two runs' `diff -r` shows whether a change left the machine code as it was.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time

from tp_overlap.gemm import GemmBlocks

from .cli.common import ArgumentParser, run_launcher
from .measure.compile_gluon import _signature, compile_fp8_gluon_gemm, compile_gluon_gemm

PROG = "tp_overlap.launch.compile_check"


def compile_for_target(fn, types: dict, constexprs: dict, *, num_warps: int, num_stages: int, arch: int = 90):
    """triton.compile of `fn` for sm_<arch>: `types` maps runtime arguments to Triton types ('*bf16', 'i32',
    ...; a trailing ':16' marks the value as divisible by 16, as the launcher's specialisation would; a tuple
    argument gets a tuple of them, where an int is an element Triton specialises to that constant),
    `constexprs` the compile-time ones (None for absent optional arguments)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attrs = _signature(fn, types, constexprs)
    source = ASTSource(fn, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resource_usage(compiled) -> dict:
    """Registers, spill bytes (ptxas -v on the kernel's PTX) and shared memory of a compiled kernel, and the
    wgmma wait depths in its PTX (a `0` only means no MMA stays in flight across that point)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    arch = compiled.metadata.target.arch
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(compiled.asm["ptx"])
        text = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, timeout=300).stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    waits = sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", compiled.asm["ptx"])))
    return {"regs": int(regs.group(1)) if regs else -1,
            "spill": int(spills.group(1)) + int(spills.group(2)) if spills else -1,
            "shared": compiled.metadata.shared, "wgmma_waits": ",".join(waits)}


_GEMM_TYPES = {"M": "i32", "N": "i32:16", "K": "i32:16", "strides": ("i32:16", "i32:16", "i32:16"),
               "tile_row_offset": "i32", "rows_per_rank": "i32", "src_rank": "i32"}
_CHUNK_WAIT = ("*i32:16", "i32", "*i32:16", "i32", "i32")   # chunk flags, chunks_per_rank, error words, code, timeout


def _gemm_config(blocks: GemmBlocks, **overrides):
    from tp_overlap.kernels.gemm import GemmConfig

    fields = dict(BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, GROUP_M=blocks.group_m,
                  WARP_SPECIALIZE=blocks.warp_specialize, FLATTEN=blocks.flatten,
                  EPILOGUE_SUBTILE=blocks.epilogue_subtile, STREAM_K_WAVES=blocks.stream_k, USE_TIMER=True)
    return GemmConfig(**(fields | overrides))


def compile_gemm(blocks: GemmBlocks, *, b_transposed: bool, arch: int = 90, dtype: str = "bf16"):
    """The local-epilogue persistent GEMM as overlap.gemm.triton_mm launches it (aligned operands)."""
    from tp_overlap.kernels.gemm import persistent_gemm_kernel

    types = dict(_GEMM_TYPES, a_ptr=f"*{dtype}:16", b_ptr=f"*{dtype}:16", c_ptr=f"*{dtype}:16")
    constexprs = dict(CONFIG=_gemm_config(blocks, B_TRANSPOSED=b_transposed), scatter=None, chunk_wait=None,
                      scales=None)
    if blocks.stream_k:
        types.update(stream_k=("*fp32:16", "*i32:16", "i32:16"))
    else:
        constexprs.update(stream_k=None)
    return compile_for_target(persistent_gemm_kernel, types, constexprs, num_warps=blocks.num_warps,
                              num_stages=blocks.num_stages, arch=arch)


def compile_split_k_gemm(blocks: GemmBlocks, *, b_transposed: bool, arch: int = 90, dtype: str = "bf16"):
    """The split-K GEMM (a name with `sp<S>`) as overlap/gemm/splitk.py launches it: host-side TMA
    descriptors for aligned operands."""
    from tp_overlap.kernels.gemm_splitk import SplitKConfig, reduce_rows, split_k_gemm_kernel

    b_block = (blocks.block_n, blocks.block_k) if b_transposed else (blocks.block_k, blocks.block_n)
    types = dict(a=f"tensordesc<{dtype}[{blocks.block_m}, {blocks.block_k}]>", b=f"tensordesc<{dtype}[{b_block[0]}, "
                 f"{b_block[1]}]>", c_ptr=f"*{dtype}:16", workspace_ptr="*fp32:16", counters_ptr="*i32:16",
                 M="i32", tile_row_offset="i32", N="i32:16", K="i32:16", lda="i32:16", ldb="i32:16", ldc="i32:16")
    constexprs = dict(CONFIG=SplitKConfig(blocks.block_m, blocks.block_n, blocks.block_k, blocks.group_m,
                                          blocks.split_k, True, b_transposed,
                                          reduce_rows(blocks.block_m, blocks.block_n, blocks.num_warps)))
    return compile_for_target(split_k_gemm_kernel, types, constexprs, num_warps=blocks.num_warps,
                              num_stages=blocks.num_stages, arch=arch)


def compile_fp8_gemm(blocks: GemmBlocks, *, arch: int = 90, wait_chunks: bool = False):
    """The FP8 block-scaled GEMM as overlap.gemm.fp8.fp8_gemm launches it (aligned operands)."""
    from tp_overlap.kernels.gemm import persistent_gemm_kernel

    if blocks.gluon:
        return compile_fp8_gluon_gemm(blocks, arch=arch)

    # scales: a [M, K/128] view with strides (1, M), w [N/128, K/128] row-major (stride 1 is a constant)
    types = dict(_GEMM_TYPES, a_ptr="*fp8e4nv:16", b_ptr="*fp8e4nv:16", c_ptr="*bf16:16",
                 scales=("*fp32:16", "*fp32:16", 1, "i32:16", "i32:16", 1))
    constexprs = dict(CONFIG=_gemm_config(blocks, B_TRANSPOSED=True, STREAM_K_WAVES=0, WARP_SPECIALIZE=
                                          blocks.warp_specialize and not wait_chunks,
                                          FLATTEN=blocks.flatten and not wait_chunks),
                      scatter=None, stream_k=None)
    if wait_chunks:
        types.update(chunk_wait=_CHUNK_WAIT)
    else:
        constexprs.update(chunk_wait=None)
    return compile_for_target(persistent_gemm_kernel, types, constexprs, num_warps=blocks.num_warps,
                              num_stages=blocks.num_stages, arch=arch)


def compile_quantizers(arch: int = 90) -> dict:
    from tp_overlap.kernels.quant_fp8 import quantize_activation_kernel, quantize_weight_kernel

    out = {}
    out["quantize_activation"] = compile_for_target(
        quantize_activation_kernel,
        dict(x_ptr="*bf16:16", q_ptr="*fp8e4nv:16", scales_ptr="*fp32:16", M="i32", K="i32:16", ldx="i32:16",
             ldq="i32:16", scale_stride_k="i32"),
        dict(BLOCK_M=32, scale_stride_m=1), num_warps=4, num_stages=1, arch=arch)
    out["quantize_weight"] = compile_for_target(
        quantize_weight_kernel,
        dict(w_ptr="*bf16:16", q_ptr="*fp8e4nv:16", scales_ptr="*fp32:16", N="i32:16", K="i32:16", ldw="i32:16",
             ldq="i32:16", scale_stride_n="i32"),
        dict(scale_stride_k=1), num_warps=8, num_stages=1, arch=arch)
    return out


def compile_swiglu(arch: int = 90) -> dict:
    from tp_overlap.kernels.swiglu import swiglu_backward_kernel, swiglu_forward_kernel

    ptr = "*bf16:16"
    return {"swiglu forward": compile_for_target(
                swiglu_forward_kernel, dict(h_ptr=ptr, a_ptr=ptr, F="i32:16", ld_h="i32:16", ld_a="i32:16"),
                dict(BLOCK=1024, INTERPRETED=False), num_warps=4, num_stages=1, arch=arch),
            "swiglu backward": compile_for_target(
                swiglu_backward_kernel, dict(grad_a_ptr=ptr, h_ptr=ptr, grad_h_ptr=ptr, F="i32:16", ld_ga="i32:16",
                                             ld_h="i32:16", ld_gh="i32:16"),
                dict(BLOCK=1024, INTERPRETED=False), num_warps=4, num_stages=1, arch=arch)}


def _check(job):
    kind, name, extra = job
    start = time.perf_counter()
    try:
        blocks = GemmBlocks.parse(name)
        if kind == "gemm":
            compile = (compile_gluon_gemm if blocks.gluon else compile_split_k_gemm if blocks.split_k > 1
                       else compile_gemm)
            compiled = compile(blocks, b_transposed=extra)
        else:
            compiled = compile_fp8_gemm(blocks, wait_chunks=extra)
        usage = resource_usage(compiled)
        usage["error"] = ""
    except Exception as exc:  # report every failure, keep going
        usage = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc) else ''}"}
    usage["seconds"] = time.perf_counter() - start
    return kind, name, extra, usage


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--table", action="store_true", help="every configuration of the block tables")
    p.add_argument("--candidates", action="store_true", help="tp_overlap.launch.gemm_tune's sweep")
    p.add_argument("--fp8", action="store_true", help="the FP8 GEMM candidates and the quantisers")
    p.add_argument("--configs", default="", help="comma-separated extra bf16 configuration names (default: none)")
    p.add_argument("--jobs", type=int, default=None,
                   help="compiler processes in parallel (default: the number of CPUs)")
    p.add_argument("--sass", default=None, metavar="DIR",
                   help="write the SASS of every Gluon GEMM build into DIR (one file each) instead (default: none)")
    p.add_argument("--only", default="",
                   help="with --sass: the builds whose label contains one of these comma-separated words (default: "
                        "every build)")
    return p


def parse_args(argv=None):
    p = make_parser()
    args = p.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    for name in names:
        try:
            GemmBlocks.parse(name)
        except ValueError as exc:
            p.error(f"--configs: {exc}")
    if args.only and not args.sass:
        p.error("--only selects builds of --sass DIR")
    if not (names or args.table or args.candidates or args.fp8 or args.sass):
        p.error("nothing to compile: give --table, --candidates, --fp8, --configs NAME,... or --sass DIR")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    return args


def _jobs(args) -> set:
    from tp_overlap.launch.measure.tune import FP8_CANDIDATES, GEMM_CANDIDATES
    from tp_overlap.gemm import LAYOUTS, block_table_path, load_block_table

    jobs = set()
    names = [n for n in args.configs.split(",") if n]
    if args.candidates:
        names += GEMM_CANDIDATES
    if args.table:
        table_dir = block_table_path("x").parent
        for path in sorted(table_dir.glob("*.yaml")):
            table = load_block_table(path=str(path))
            for e in table.entries:
                if table.operand_bytes == 1:   # an FP8 table (B is always [N, K])
                    jobs.update({("fp8", e.blocks.name, False), ("fp8", e.plain.name, True)})
                else:
                    jobs.update({("gemm", e.blocks.name, e.layout == "nk"), ("gemm", e.plain.name, e.layout == "nk")})
    for name in names:
        for layout in LAYOUTS:
            jobs.add(("gemm", name, layout == "nk"))
    if args.fp8:
        for name in FP8_CANDIDATES:
            jobs.add(("fp8", name, False))
        jobs.add(("fp8", FP8_CANDIDATES[0], True))
    return jobs


def _run(args) -> int:
    if args.sass:
        from .measure.sass import write_sass

        written = write_sass(args.sass, tuple(w for w in args.only.split(",") if w))
        print(f"{len(written)} builds' SASS in {args.sass}: {', '.join(written)}")
        return 0 if written else 1
    jobs = _jobs(args)
    if args.fp8:
        for kernel, compiled in compile_quantizers().items():
            print(f"{kernel}: {resource_usage(compiled)}")
    failures = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs or os.cpu_count() or 1) as pool:
        for kind, name, extra, usage in pool.map(_check, sorted(jobs)):
            bad = usage["error"] or usage.get("spill", 0) != 0
            failures += bool(bad)
            tag = {"gemm": "nk" if extra else "kn", "fp8": "wait" if extra else "nk"}[kind]
            print(f"{'FAIL' if bad else 'ok  '} {kind} {tag} {name:28s} " + " ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in usage.items() if k != "error")
                  + (f" {usage['error']}" if usage["error"] else ""), flush=True)
    print(f"{len(jobs) - failures} of {len(jobs)} compiled without spills")
    return 1 if failures else 0


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


if __name__ == "__main__":
    sys.exit(main())


def compile_overlap_kernels(arch: int = 90) -> dict:
    """The kernels the ops launch with flags (scatter epilogues, the chunk-waiting consumer, the reduction),
    as their launchers call them: what the interpreter cannot check (it accepts a non-constexpr global the
    compiler refuses)."""
    from tp_overlap.kernels.gemm import persistent_gemm_kernel
    from tp_overlap.kernels.rs_epilogue import reduce_partials_kernel

    out = {}
    blocks = GemmBlocks.parse("128x128x64w8s3")
    for epilogue, wait in ((0, True), (1, False), (2, False), (1, True)):
        types = dict(_GEMM_TYPES, a_ptr="*bf16:16", b_ptr="*bf16:16", c_ptr="*bf16:16")
        constexprs = dict(CONFIG=_gemm_config(blocks, EPILOGUE=epilogue, B_TRANSPOSED=True), stream_k=None,
                          scales=None)
        if epilogue:  # dst and flag pointer tables, tile counters, flags_per_source, error words, code, timeout
            types.update(scatter=("*i64", "*i64", "*i32", "i32:16", "*i32", "i32", "i32"))
        else:
            constexprs.update(scatter=None)
        if wait:
            types.update(chunk_wait=("*i32", "i32", "*i32", "i32", "i32"))
        else:
            constexprs.update(chunk_wait=None)
        out[f"gemm epilogue {epilogue}{' + chunk waits' if wait else ''}"] = compile_for_target(
            persistent_gemm_kernel, types, constexprs, num_warps=8, num_stages=3, arch=arch)
    types = {"partials_ptr": "*bf16:16", "out_ptr": "*bf16:16",
             **{name: "i32" for name in ("rows_per_rank", "N", "ld_out", "world_size", "owner_rank")}}
    for wait in (False, True):
        waits = {"waits": ("*i32", "i32", "*i32", "i32", "i64")} if wait else {}
        out[f"reduce{' (waits)' if wait else ''}"] = compile_for_target(
            reduce_partials_kernel, types | waits,
            dict(BLOCK_M=32, BLOCK_N=256, GEMM_BLOCK_M=128, USE_TIMER=True) | ({} if wait else {"waits": None}),
            num_warps=4, num_stages=2, arch=arch)
    return out
