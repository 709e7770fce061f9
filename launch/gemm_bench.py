"""The persistent Triton GEMM alone (local epilogue, all SMs) against cuBLAS on every local GEMM of the
AG and RS shape tables (docs/ARCHITECTURE.md) at the given TP sizes, in both layouts of B: what the fused
ops can reach.

    python -m tp_overlap.launch.gemm_bench [--tp 2,4,8] [--m 1024,...,16384] [--layouts kn,nk] [--table PATH]
        [--configs NAME,...] [--time-budget-s 600] [--out FILE (default runs/gemm_bench-<time>/...)]
    python -m tp_overlap.launch.gemm_bench --fp8 [...] [--write-table PATH]     (launch/measure/gemm_bench_fp8.py)
    python -m tp_overlap.launch.gemm_bench --ops [--rs-sm-margin 16] [...]      (launch/measure/gemm_bench_ops.py:
        each fused op's own GEMM, compute_alone, against cuBLAS under the same SM carveout)

Single process, one GPU. Per (shape, layout) -- `kn`: B row-major [K, N]; `nk`: B = w.t() of a row-major
[N, K] (nn.Linear) -- it times, interleaved: cuBLAS (`torch.mm` on the same operands and layout), the
block table's choice (`choose_blocks`, from `--table` or the GPU's package table), the hand heuristic it
replaced, and any `--configs`. Every variant is first checked against cuBLAS (NaN-poisoned output,
relative error <= 1e-2). Times are device times: the stream is held busy for `--hold-us` after each L2
flush, so the Python launch cost is not charged to the kernel; `--hold-us 0` measures from an idle device.
The JSON is rewritten after every shape; shapes that no longer fit in `--time-budget-s` are listed as
skipped. The last lines print the median and minimum of Triton-over-cuBLAS speed per layout.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from tp_overlap.launch.cli.common import (ArgumentParser, UsageError, int_list, parse_shapes, require, run_dir,
                                          run_launcher)
from tp_overlap.launch.output.report import device_slug, format_table, write_results
from tp_overlap.launch.cli.shapes import ag_points, rs_points
from tp_overlap.launch.measure.timing import bench_interleaved, progress
from tp_overlap.gemm import (LAYOUTS, BlockTableError, GemmBlocks, choose_blocks, gpu_name, heuristic_blocks,
                          load_block_table, triton_mm)

from .measure.canary import CANARY_SHAPE, DEFAULT_JOBS, operands
from .measure.gemm_bench_fp8 import run_fp8
from .measure.gemm_bench_ops import run_ops

REL_TOLERANCE = 1e-2
PER_CALL_OVERHEAD_S = 6e-4
HOLD_US = 300.0       # covers triton_mm's and torch.mm's host enqueue
OPS_HOLD_US = 1500.0  # covers an op's compute_alone (0.3-0.65 ms of host time measured on an H100 machine)


def shape_points(tps, ms, layers=None, shapes=()) -> list[tuple[str, str, int, int, int, int]]:
    """(layer, op, tp, m, n, k) for every TP size (or the given (m, n, k) `shapes`); shapes shared by two
    TP sizes are kept once."""
    if shapes:
        return [("given", "gemm", 0, m, n, k) for m, n, k in shapes]
    seen, out = set(), []
    for world in tps:
        for p in ag_points(world, ms=ms, layers=layers) + rs_points(world, ms=ms, layers=layers):
            if (p.m, p.n, p.k) not in seen:
                seen.add((p.m, p.n, p.k))
                out.append((p.layer, p.op, world, p.m, p.n, p.k))
    return out


def summarize(rows: list[dict], key: str) -> dict:
    """Median / min of rows[key] per layout, and how many are >= 0.85."""
    out = {}
    for layout in sorted({r["layout"] for r in rows}):
        values = [r[key] for r in rows if r["layout"] == layout and r.get(key)]
        if values:
            out[layout] = {"median": statistics.median(values), "min": min(values), "n": len(values),
                           "at_least_0.85": sum(v >= 0.85 for v in values)}
    return out


def _parse_list(text: str, cast=str):
    return tuple(cast(x) for x in text.split(",") if x)


def make_parser() -> ArgumentParser:
    p = ArgumentParser("python -m tp_overlap.launch.gemm_bench", description=__doc__)
    p.add_argument("--tp", type=int_list, default=(2, 4, 8), help="TP sizes whose local shapes are timed")
    p.add_argument("--m", type=int_list, default=(1024, 2048, 4096, 8192, 16384), help="M values (rows)")
    p.add_argument("--layouts", type=_parse_list, default=LAYOUTS, help="B layouts, of kn,nk (--fp8: nk only)")
    p.add_argument("--layers", type=_parse_list, default=None,
                   help="subset of docs/ARCHITECTURE.md's layers (default: all)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per variant and shape (median)")
    p.add_argument("--hold-us", type=float, default=None,
                   help="device hold before each timed call (0: none; default 300, with --ops 1500: the ops' host "
                   "enqueue reached 0.3-0.65 ms on an H100 machine, and a rep whose enqueue outlasts the hold "
                   "times host latency)")
    p.add_argument("--table", default=None, help="block table YAML (default: the GPU's package table)")
    p.add_argument("--configs", type=_parse_list, default=(),
                   help="extra block configurations to time (--fp8: the candidates, instead of FP8_CANDIDATES; "
                   "default: none)")
    p.add_argument("--time-budget-s", type=float, default=600.0, help="wall-clock bound of the whole run")
    p.add_argument("--fp8", action="store_true", help="FP8 block-scaled GEMM vs torch._scaled_mm and bf16 cuBLAS")
    p.add_argument("--ops", action="store_true",
                   help="each fused op's compute_alone (AgGemm fused, GemmRs fused / epilogue_reduce) vs cuBLAS")
    p.add_argument("--rs-sm-margin", type=int, default=16,
                   help="--ops: the SMs GemmRs fused leaves to its reduction (the TP 4 / 8 presets': 16)")
    p.add_argument("--write-table", default=None,
                   help="--fp8: write the fastest FP8 blocks per shape there (default: no table written)")
    p.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help=f"--fp8: child processes compiling at once (default: CPU cores - 2, 1 to 12: {DEFAULT_JOBS} here)")
    p.add_argument("--out", default=None, help="results JSON (default: a file in runs/gemm_bench-<time>/)")
    p.add_argument("--shapes", type=parse_shapes, default=(), help="MxNxK,... instead of the TP tables (default: the TP tables)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (the Triton interpreter: a smoke test)")
    p.add_argument("--canary-shape", type=lambda s: parse_shapes(s)[0], default=CANARY_SHAPE,
                   help="--fp8: MxNxK of the compile phase's runs (default: %s)" % "x".join(map(str, CANARY_SHAPE)))
    return p


def _parse(argv):
    from tp_overlap.launch.cli.shapes import AG_LAYERS, RS_LAYERS

    args = make_parser().parse_args(argv)
    layers = set(AG_LAYERS) | set(RS_LAYERS)
    require(all(w >= 1 for w in args.tp), f"--tp: TP sizes must be >= 1, got {args.tp}")
    require(all(m >= 1 for m in args.m), f"--m: M values must be >= 1, got {args.m}")
    require(set(args.layouts) <= set(LAYOUTS), f"--layouts: got {args.layouts}; allowed: {', '.join(LAYOUTS)}")
    require(args.layers is None or set(args.layers) <= layers,
            f"--layers: got {args.layers}; allowed: {', '.join(sorted(layers))}")
    require(args.reps >= 1, f"--reps: got {args.reps}; allowed: >= 1")
    if args.hold_us is None:
        args.hold_us = OPS_HOLD_US if args.ops else HOLD_US
    require(args.hold_us >= 0, f"--hold-us: got {args.hold_us}; allowed: >= 0")
    require(args.time_budget_s >= 0, f"--time-budget-s: got {args.time_budget_s}; allowed: >= 0")
    require(args.jobs >= 1, f"--jobs: got {args.jobs}; allowed: >= 1")
    require(args.device in ("cuda", "cpu"), f"--device: got {args.device!r}; allowed: cuda, cpu")
    require(args.device == "cuda" or bool(args.out), "--device cpu needs --out")
    require(args.fp8 or not args.write_table, "--write-table needs --fp8 (the bf16 table comes from launch.gemm_tune)")
    require(not (args.ops and (args.fp8 or args.configs or args.table)),
            "--ops times the ops' own block choice: without --fp8, --configs or --table")
    require(args.rs_sm_margin >= 0, f"--rs-sm-margin: got {args.rs_sm_margin}; allowed: >= 0")
    require(not (args.fp8 and args.table), "--table is the bf16 table; --fp8 reads configs/gemm_blocks/<gpu>_fp8.yaml")
    for name in args.configs:
        try:
            blocks = GemmBlocks.parse(name)
            problems = blocks.problems(operand_bytes=1 if args.fp8 else 2)
            if args.fp8 and blocks.block_k != 128:
                problems.append("the FP8 GEMM's BLOCK_K is its scale group, 128")
        except ValueError as exc:
            problems = [str(exc)]
        require(not problems, f"--configs: {name}: {'; '.join(problems)}")
    if args.table:
        try:
            load_block_table(path=args.table)
        except BlockTableError as exc:
            raise UsageError(f"--table: {exc}") from None
    return args


def main(argv=None) -> int:
    return run_launcher("tp_overlap.launch.gemm_bench", _parse, _run, argv)


def _run(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("needs a CUDA GPU (or --device cpu with the Triton interpreter)")
    if args.ops:
        dev, device_name = bench_device(args.device)
        return run_ops(args, dev=dev, device_name=device_name,
                       points=shape_points(args.tp, args.m, args.layers, args.shapes))
    if args.fp8:
        dev, device_name = bench_device(args.device)
        return run_fp8(args, dev=dev, device_name=device_name,
                       points=shape_points(args.tp, args.m, args.layers, args.shapes))
    return _run_bf16(args)


def bench_device(name: str) -> tuple[torch.device, str]:
    """(device, its name for the results) -- cpu runs the Triton interpreter."""
    dev = torch.device(name)
    if dev.type != "cuda":
        return dev, "cpu"
    dev = torch.device("cuda", torch.cuda.current_device())
    return dev, torch.cuda.get_device_name(dev)


def _run_bf16(args) -> int:
    from tp_overlap.gemm import release_workspaces

    started = time.monotonic()
    dev, device_name = bench_device(args.device)
    table = load_block_table(path=args.table) if args.table else load_block_table(gpu_name(dev) or "cpu")
    tag = "_".join(str(w) for w in args.tp)
    out = args.out or str(run_dir("gemm_bench") / f"gemm_{device_slug(device_name)}_tp{tag}.json")
    rows, skipped = [], []
    points = [(pt, layout) for pt in shape_points(args.tp, args.m, args.layers, args.shapes) for layout in args.layouts]
    for i, ((layer, op, world, m, n, k), layout) in enumerate(points):
        variants_blocks = {"table": choose_blocks(m, n, k, b_transposed=layout == "nk", table=table, gpu=None),
                           "heuristic": heuristic_blocks(m, n, k)}
        variants_blocks.update({name: GemmBlocks.parse(name) for name in args.configs})
        estimate = (len(variants_blocks) + 1) * (args.reps + 4) * (2 * m * n * k / 600e12 + PER_CALL_OVERHEAD_S)
        if time.monotonic() - started + estimate > args.time_budget_s:
            skipped.append({"layer": layer, "tp": world, "layout": layout, "M": m, "N": n, "K": k})
            continue
        a, b = operands(m, n, k, layout, dev, seed=i)
        ref = torch.mm(a, b)
        outs, usable, errors = _check_variants(a, b, ref, variants_blocks, where=f"{layer} M={m} {layout}")
        out_c = torch.empty_like(ref)
        variants = {"cublas": lambda: torch.mm(a, b, out=out_c)}
        variants.update({name: (lambda blk=blk, o=outs[name]: triton_mm(a, b, o, blocks=blk))
                         for name, blk in usable.items()})
        stats = bench_interleaved(variants, group=None, device=dev, warmup=3, reps=args.reps,
                                  hold_device_us=args.hold_us)
        release_workspaces()  # one per (shape, configuration): 240 shapes would keep them all
        t_cublas = stats["cublas"].median_ms
        row = {"layer": layer, "op": op, "tp": world, "layout": layout, "M": m, "K": k, "N": n,
               "t_cublas_ms": t_cublas, "table_blocks": variants_blocks["table"].name,
               "heuristic_blocks": variants_blocks["heuristic"].name, "errors": errors,
               "tflops_cublas": 2 * m * n * k / t_cublas / 1e9}
        for name in usable:
            row[f"t_{name}_ms"] = stats[name].median_ms
            row[f"{name}_over_cublas"] = t_cublas / stats[name].median_ms
        for name, s in stats.items():
            row.update(s.as_dict(f"{name}_"))
        rows.append(row)
        _write(out, rows, skipped, args, device_name, table)
        progress(f"gemm {i + 1}/{len(points)} {layer}@tp{world} {layout} M={m}: cuBLAS {t_cublas:.4f} ms, table "
                 f"{row.get('t_table_ms', float('nan')):.4f} ms ({variants_blocks['table'].name}, "
                 f"{row.get('table_over_cublas', float('nan')):.3f}x)")
    _write(out, rows, skipped, args, device_name, table)
    _print_summary(rows, skipped, out)
    return 0 if rows else 1


def _check_variants(a, b, ref, variants_blocks: dict, where: str) -> tuple[dict, dict, dict]:
    """Run each variant once into a NaN-poisoned output and check it against cuBLAS's `ref`: (outputs,
    the variants that ran and may be timed, the error text of those that failed to run)."""
    outs, usable, errors = {}, {}, {}
    for name, blocks in variants_blocks.items():
        outs[name] = torch.full_like(ref, float("nan"))
        try:
            triton_mm(a, b, outs[name], blocks=blocks)
        except Exception as exc:  # e.g. OutOfResources: reported, not timed
            errors[name] = f"{type(exc).__name__}: {str(exc)[-160:]}"
            progress(f"  {name} ({blocks.name}) failed: {errors[name]}")
            continue
        err = ((outs[name].float() - ref.float()).norm() / ref.float().norm()).item()
        if not err <= REL_TOLERANCE:
            raise RuntimeError(f"{where} {name} ({blocks.name}): relative error {err:.3g} vs cuBLAS")
        usable[name] = blocks
    return outs, usable, errors


def _print_summary(rows: list[dict], skipped: list[dict], out) -> None:
    print(format_table(rows, ["layer", "tp", "layout", "M", "K", "N", "t_cublas_ms", "t_table_ms", "table_blocks",
                              "table_over_cublas", "heuristic_over_cublas"]))
    for layout, s in summarize(rows, "table_over_cublas").items():
        print(f"{layout}: table/cuBLAS speed median {s['median']:.3f}, min {s['min']:.3f}, "
              f">= 0.85 on {s['at_least_0.85']} of {s['n']}")
    print(f"{len(rows)} shapes measured, {len(skipped)} skipped (budget); results: {out}")


def _write(out, rows, skipped, args, device_name, table) -> None:
    write_results(out, rows, device=device_name, tp=args.tp[0] if len(args.tp) == 1 else 0, extra={
        "op": "gemm", "tp_sizes": list(args.tp), "hold_device_us": args.hold_us, "reps": args.reps,
        "table": args.table or "package", "table_entries": len(table.entries) if table else 0,
        "summary": summarize(rows, "table_over_cublas"), "skipped": skipped})


if __name__ == "__main__":
    sys.exit(main())
