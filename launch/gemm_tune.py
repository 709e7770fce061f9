"""Tune the persistent Triton GEMM's blocks on one GPU and write the block table that choose_blocks reads.

    python -m launch.gemm_tune [--tp 2,4,8] [--m 1024,4096,16384] [--layouts kn,nk] [--time-budget-s 240]
        [--out-table FILE] [--out FILE]   (default: a run folder, runs/gemm_tune-<time>/)

For every local GEMM of DESIGN.md's table at the given TP sizes and M, and for both layouts of B (`kn`:
row-major [K, N]; `nk`: `w.t()` of a row-major [N, K], the nn.Linear layout), every candidate block
configuration (CANDIDATES: tile sizes 64/128/256, BLOCK_K 64/128, warps, stages, GROUP_M, warp
specialisation, flattened loops, two-half epilogue, stream-K, two programs per SM) is checked against
cuBLAS (`torch.mm` on the same operands and layout) and then timed interleaved with it: device time (the
stream is held busy before each timed call, as launch.gemm_bench does), L2 flushed, median of `--reps`.

First a child process runs every configuration once per layout on a small shape (launch/_canary.py): one
that fails to compile, computes wrong numbers, crashes or hangs is dropped there (with its reason in the
JSON) instead of ending the sweep, and the compiled kernels are in Triton's cache when the sweep starts
(compile time is charged to the budget). Shapes go M = 1024
first, then 4096, then 16384 (where the gaps to cuBLAS were largest first); before each shape the
remaining budget is checked against the shape's estimated cost, and shapes that do not fit are listed as
skipped. After every shape the table (merged over `--merge-table`, by default the GPU's current table, so
unmeasured shapes keep their entries) and the results JSON are rewritten: a run cut short loses nothing
it measured. Progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

from overlap.gemm_blocks import (LAYOUTS, PLAIN_BLOCK_M, BlockTable, BlockTableEntry, GemmBlocks,
                                 heuristic_blocks, load_block_table)
from launch._cli import run_dir
from launch.report import device_slug, write_results
from launch.shapes import M_VALUES, ag_points, rs_points
from launch.timing import bench_interleaved, progress
from overlap.triton_gemm import gpu_name, num_sms, triton_mm

from ._canary import CANARY_SHAPE, run_canaries

__all__ = ["CANDIDATES", "FP8_CANDIDATES", "candidate_names", "fp8_candidate_names", "parse_shapes", "tune_points",
           "operands", "write_table", "main"]

# Every name compiles without register spills for sm_90 with Triton 3.6 and 3.7 in both layouts
# (python -m launch.compile_check --candidates). Warp specialisation only splits the work on Hopper with
# 4 warps (two consumer warpgroups + a producer); with 8 it compiles to the plain kernel.
CANDIDATES = (
    "128x256x64w8s3", "128x256x64w8s3g16", "128x256x64w8s4es2", "256x128x64w8s3",
    "128x128x64w8s4", "128x128x64w4s5", "128x128x128w8s3", "64x256x64w4s4", "64x128x64w4s4o2",
    "128x256x64w4s3ws", "128x256x64w4s3g16ws", "128x128x64w4s5ws", "256x128x64w4s3ws", "128x128x128w4s3ws",
    "128x256x64w8s3fl", "128x128x64w8s4fl",
    # stream-K ("sk") configurations are left out: their late-contributor recompute gave wrong tiles on the
    # H200 in one of two runs (tests/gpu/check_fp8.py, results/NOTES.md): a race; the normal path was right,
    # but a late contributor is what a time-sliced or busy GPU produces
)

# The FP8 GEMM's (kernels/gemm_fp8.py; BLOCK_K is the scale group), timed by launch.gemm_bench --fp8.
FP8_CANDIDATES = (
    "128x128x128w8s4", "64x128x128w4s5", "64x128x128w4s4o2", "128x128x128w8s4fl", "128x64x128w4s6",
    # warp-specialised FP8 ("...w4s4ws", "...w4s5ws") is left out: compiled for the H200 it gave wrong tiles
    # (relative error 0.28-0.77 and NaN against the dequantised product, runs 2 and 6 in results/NOTES.md)
)

REL_TOLERANCE = 1e-2       # bf16 output against cuBLAS's (README tolerance policy)
CANARY_SHARE = 0.5         # at most this share of the budget goes to running every configuration once
PLAIN_PREFERENCE = 1.01    # the plain configuration wins unless the fastest is more than 1 % faster
PER_CALL_OVERHEAD_S = 6e-4  # flush + hold + synchronisation around one timed call (estimate)


def candidate_names() -> list[str]:
    return list(CANDIDATES)


def fp8_candidate_names() -> list[str]:
    return list(FP8_CANDIDATES)


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """'1024x3072x4096,...' (M x N x K) -> ((1024, 3072, 4096), ...)."""
    return tuple(tuple(int(v) for v in item.split("x")) for item in text.split(",") if item)


def tune_points(tps, ms, shapes=()) -> list[tuple[int, int, int, list[str]]]:
    """Unique (m, n, k) over the AG and RS tables at each TP size (or the given `shapes`), M ascending,
    with their layer names."""
    layers: dict[tuple[int, int, int], list[str]] = {}
    for m, n, k in shapes:
        layers.setdefault((m, n, k), []).append("given")
    for world in tps if not shapes else ():
        for p in ag_points(world, ms=ms) + rs_points(world, ms=ms):
            layers.setdefault((p.m, p.n, p.k), []).append(f"{p.layer}@tp{world}")
    order = sorted(layers.items(), key=lambda kv: (kv[0][0], kv[0][2] * kv[0][1]))
    return [(m, n, k, names) for (m, n, k), names in order]


def write_table(path: str | Path, entries: dict, *, gpu: str, num_sms_: int, source: dict,
                operand_bytes: int = 2) -> None:
    """The YAML table (format: overlap/gemm_blocks.py), one flow-style entry per line, sorted."""
    kind = "FP8 GEMM (kernels/gemm_fp8.py)" if operand_bytes == 1 else "GEMM (kernels/gemm.py)"
    lines = [f"# Block table of the persistent Triton {kind} on {gpu} (format and fallback:",
             "# overlap/gemm_blocks.py). vs_cublas = reference time / Triton time, device time.",
             f"gpu: {gpu}", f"num_sms: {num_sms_}"]
    if operand_bytes != 2:
        lines.append(f"operand_bytes: {operand_bytes}")
    lines += ["source: " + yaml.safe_dump(source, default_flow_style=True, width=1 << 20).strip(), "entries:"]
    for key in sorted(entries, key=lambda k: (k[0], k[2], k[3], k[1])):
        e = entries[key]
        ratios = "".join(f", {name}: {value:.3f}" for name, value in (("vs_cublas", e.vs_cublas),
                                                                       ("plain_vs_cublas", e.plain_vs_cublas))
                         if value is not None)
        lines.append(f"  - {{layout: {e.layout}, m: {e.m}, n: {e.n}, k: {e.k}, blocks: {e.blocks.name}, "
                     f"plain: {e.plain.name}{ratios}}}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def _synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Compiled:
    """Which (configuration, layout) pairs compiled and ran; failures are not retried."""

    def __init__(self):
        self.seconds: dict[tuple[str, str], float] = {}
        self.failed: dict[tuple[str, str], str] = {}


def operands(m, n, k, layout, dev, seed):
    """(a [M, K], b [K, N]) bf16 on `dev`, drawn there (a CPU draw of a 28672 x 8192 weight takes seconds):
    b row-major (`kn`) or the transpose view of a row-major [N, K] (`nk`)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    a = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device=dev, dtype=torch.bfloat16) / math.sqrt(k)
    return a, (w.t() if layout == "nk" else w.t().contiguous())


def _tune_shape(m, n, k, layout, dev, args, compiled: _Compiled, deadline: float):
    a, b = operands(m, n, k, layout, dev, seed=m + n + k)
    ref = torch.mm(a, b)
    outs, usable = {}, {}
    heuristic = heuristic_blocks(m, n, k).name  # the hand rule the table replaces: timed for comparison
    for name in dict.fromkeys(args.candidates + (heuristic,)):
        if (name, layout) in compiled.failed or time.monotonic() > deadline:
            continue
        blocks = GemmBlocks.parse(name)
        out = torch.full_like(ref, float("nan"))
        start = time.perf_counter()
        try:
            triton_mm(a, b, out, blocks=blocks)
            _synchronize(dev)
        except Exception as exc:  # a compile error or OutOfResources: drop it for this layout
            compiled.failed[(name, layout)] = f"{type(exc).__name__}: {str(exc).strip()[-160:]}"
            progress(f"  {name} ({layout}) dropped: {compiled.failed[(name, layout)]}")
            continue
        compiled.seconds.setdefault((name, layout), time.perf_counter() - start)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        if not err <= REL_TOLERANCE:
            compiled.failed[(name, layout)] = f"relative error {err:.3g} vs cuBLAS at M={m} N={n} K={k}"
            progress(f"  {name} ({layout}) dropped: {compiled.failed[(name, layout)]}")
            continue
        outs[name], usable[name] = out, blocks
    if not usable:
        return None
    out_c = torch.empty_like(ref)
    variants = {"cublas": lambda: torch.mm(a, b, out=out_c)}
    variants.update({name: (lambda blk=blk, o=outs[name]: triton_mm(a, b, o, blocks=blk))
                     for name, blk in usable.items()})
    stats = bench_interleaved(variants, group=None, device=dev, warmup=2, reps=args.reps, hold_device_us=args.hold_us)
    times = {name: s.median_ms for name, s in stats.items()}
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.gemm_tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=lambda s: tuple(int(x) for x in s.split(",")), default=(2, 4, 8))
    p.add_argument("--m", type=lambda s: tuple(int(x) for x in s.split(",")), default=M_VALUES)
    p.add_argument("--layouts", type=lambda s: tuple(s.split(",")), default=LAYOUTS)
    p.add_argument("--candidates", type=lambda s: tuple(s.split(",")), default=CANDIDATES)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--hold-us", type=float, default=300.0)
    p.add_argument("--time-budget-s", type=float, default=240.0, help="wall-clock cap of the whole run")
    p.add_argument("--out-table", default=None, help="default: runs/gemm_tune-<time>/<gpu>.yaml (copy it to "
                   "configs/gemm_blocks/<gpu>.yaml to use it)")
    p.add_argument("--merge-table", default=None, help="entries kept unless re-measured (default: the GPU's table)")
    p.add_argument("--out", default=None, help="results JSON (default runs/gemm_tune-<time>/gemm_tune_<gpu>.json)")
    p.add_argument("--shapes", type=parse_shapes, default=(), help="MxNxK,... instead of the TP tables")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (the Triton interpreter: a smoke test)")
    p.add_argument("--canary-shape", type=lambda s: parse_shapes(s)[0], default=CANARY_SHAPE,
                   help="MxNxK of the child process that runs every configuration once first")
    args = p.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.time_budget_s
    bad = [n for n in args.candidates if GemmBlocks.parse(n).problems()] + [x for x in args.layouts if x not in LAYOUTS]
    if bad:
        print(f"launch.gemm_tune: unusable candidates or layouts: {bad}", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("launch.gemm_tune needs a CUDA GPU (or --device cpu with the Triton interpreter)", file=sys.stderr)
        return 2
    if dev.type != "cuda" and not args.out_table:
        print("launch.gemm_tune --device cpu needs --out-table", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else dev
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    gpu, sms = gpu_name(dev) or "cpu", num_sms(dev)
    folder = None if (args.out_table and args.out) else run_dir("gemm_tune")
    out_table = args.out_table or str(folder / f"{gpu}.yaml")
    out_json = args.out or str(folder / f"gemm_tune_{device_slug(device_name)}.json")
    base = load_block_table(path=args.merge_table) if args.merge_table else load_block_table(gpu)
    entries = {(e.layout, e.m, e.n, e.k): e for e in (base.entries if isinstance(base, BlockTable) else ())}
    work = [(m, n, k, names, layout) for (m, n, k, names) in tune_points(args.tp, args.m, args.shapes)
            for layout in args.layouts]
    compiled, rows, skipped = _Compiled(), [], []
    # every configuration once in a child process: one that crashes, hangs or computes garbage is dropped
    # here instead of ending the sweep; the kernels it compiles are in Triton's cache for this process
    heuristics = {heuristic_blocks(m, n, k).name for m, n, k, _, _ in work}
    items = [(name, layout) for name in dict.fromkeys(args.candidates + tuple(sorted(heuristics)))
             for layout in args.layouts]
    verdicts = run_canaries("bf16", items, started + CANARY_SHARE * args.time_budget_s, device=dev.type,
                            shape=args.canary_shape)
    if not verdicts and items:  # the child itself failed (see its traceback above): sweep without it
        progress("canary: no verdict at all, sweeping every configuration without it")
        verdicts = {key: "" for key in items}
    for key in items:
        if verdicts.get(key, "not reached within its share of the budget"):
            compiled.failed[key] = "canary: " + verdicts.get(key, "not reached within its share of the budget")
            progress(f"  {key[0]} ({key[1]}) dropped: {compiled.failed[key]}")
    progress(f"canary: {len(items) - len(compiled.failed)} of {len(items)} configurations ran correctly, "
             f"{time.monotonic() - started:.0f} s")
    source = {"command": " ".join(sys.argv), "torch": str(torch.__version__),
              "triton": str(__import__("triton").__version__), "date": time.strftime("%Y-%m-%d")}
    progress(f"gemm_tune: {len(work)} shapes x layouts, {len(args.candidates)} candidates, budget "
             f"{args.time_budget_s:.0f} s, table -> {out_table}")
    for index, (m, n, k, names, layout) in enumerate(work):
        flops = 2 * m * n * k
        estimate = (len(args.candidates) + 1) * (args.reps + 3) * (flops / 600e12 + PER_CALL_OVERHEAD_S)
        left = deadline - time.monotonic()
        if left < estimate:
            skipped.append({"layout": layout, "M": m, "N": n, "K": k, "estimate_s": round(estimate, 2)})
            continue
        times = _tune_shape(m, n, k, layout, dev, args, compiled, deadline)
        if times is None:
            skipped.append({"layout": layout, "M": m, "N": n, "K": k, "reason": "no candidate ran"})
            continue
        t_cublas = times.pop("cublas")
        best = min(times, key=times.get)
        plains = [nm for nm in times if GemmBlocks.parse(nm).plain and GemmBlocks.parse(nm).block_m == PLAIN_BLOCK_M]
        plain = min(plains, key=times.get) if plains else None
        if plain is not None and times[plain] <= times[best] * PLAIN_PREFERENCE:
            best = plain
        plain_blocks = GemmBlocks.parse(plain) if plain else heuristic_blocks(m, n, k, warp_specialize=False)
        entries[(layout, m, n, k)] = BlockTableEntry(
            layout, m, n, k, GemmBlocks.parse(best), plain_blocks, t_cublas / times[best],
            t_cublas / times[plain] if plain else None)
        heuristic = heuristic_blocks(m, n, k).name
        rows.append({"layers": names, "layout": layout, "M": m, "N": n, "K": k, "t_cublas_ms": t_cublas,
                     "best": best, "t_best_ms": times[best], "best_over_cublas": t_cublas / times[best],
                     "plain": plain, "t_plain_ms": times.get(plain), "heuristic": heuristic,
                     "heuristic_over_cublas": t_cublas / times[heuristic] if heuristic in times else None,
                     "tflops_best": flops / times[best] / 1e9, "times_ms": times})
        write_table(out_table, entries, gpu=gpu, num_sms_=sms, source=source)
        _write_json(out_json, rows, skipped, compiled, device_name, args, started)
        progress(f"gemm_tune {index + 1}/{len(work)} {layout} M={m} N={n} K={k}: cuBLAS {t_cublas:.4f} ms, "
                 f"{best} {times[best]:.4f} ms ({t_cublas / times[best]:.3f}x), {time.monotonic() - started:.0f} s")
    _write_json(out_json, rows, skipped, compiled, device_name, args, started)
    ratios = [r["best_over_cublas"] for r in rows]
    if ratios:
        print(f"gemm_tune: {len(rows)} shapes measured, {len(skipped)} skipped; Triton/cuBLAS speed median "
              f"{statistics.median(ratios):.3f}, min {min(ratios):.3f}, >= 0.85 on {sum(r >= 0.85 for r in ratios)}")
    print(f"table: {out_table}\nresults: {out_json}")
    return 0 if rows else 1


def _write_json(path, rows, skipped, compiled: _Compiled, device_name, args, started) -> None:
    ratios = [r["best_over_cublas"] for r in rows]
    summary = {"measured": len(rows), "skipped": len(skipped), "elapsed_s": round(time.monotonic() - started, 1),
               "median_over_cublas": statistics.median(ratios) if ratios else None,
               "min_over_cublas": min(ratios) if ratios else None}
    write_results(path, rows, device=device_name, tp=0, extra={
        "op": "gemm_tune", "tp_sizes": list(args.tp), "hold_device_us": args.hold_us, "reps": args.reps,
        "time_budget_s": args.time_budget_s, "summary": summary, "skipped": skipped,
        "compile_s": {f"{n}/{layout}": round(s, 2) for (n, layout), s in compiled.seconds.items()},
        "failed": {f"{n}/{layout}": why for (n, layout), why in compiled.failed.items()}})


if __name__ == "__main__":
    sys.exit(main())
