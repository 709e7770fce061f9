"""The persistent Triton GEMM alone (local epilogue, all SMs) against cuBLAS on every local GEMM of the
AG and RS shape tables at the given TP sizes, in both layouts of B: what the fused ops can reach.

    python -m launch.gemm_bench --tp 2,4,8 [--m 1024,4096,16384] [--layouts kn,nk] [--table PATH]
        [--configs NAME,...] [--time-budget-s 110] [--out FILE (default runs/gemm_bench-<time>/...)]
    python -m launch.gemm_bench --fp8 --tp 2,4,8 [...] [--write-table PATH]     (launch/_gemm_bench_fp8.py)

Single process, one GPU. Per (shape, layout) -- `kn`: B row-major [K, N]; `nk`: B = w.t() of a row-major
[N, K] (nn.Linear) -- it times, interleaved: cuBLAS (`torch.mm` on the same operands and layout), the
block table's choice (`choose_blocks`, from `--table` or the GPU's package table), the hand heuristic it
replaced, and any `--configs`. Every variant is first checked against cuBLAS (relative error <= 1e-2).
Times are device times: the stream is held busy for `--hold-us` (default 300) after each L2 flush, so the
Python launch cost is not charged to the kernel; `--hold-us 0` measures from an idle device instead.
The JSON is rewritten after every shape; shapes that no longer fit in `--time-budget-s` are listed as
skipped. The last lines print the median and minimum of Triton-over-cuBLAS speed per layout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from launch._cli import run_dir
from launch.report import device_slug, format_table, write_results
from launch.shapes import M_VALUES, ag_points, rs_points
from launch.timing import bench_interleaved, progress
from overlap.gemm_blocks import LAYOUTS, GemmBlocks, choose_blocks, heuristic_blocks, load_block_table
from overlap.triton_gemm import gpu_name, triton_mm

from ._canary import CANARY_SHAPE
from .gemm_tune import operands, parse_shapes

__all__ = ["main", "shape_points", "summarize", "bench_device"]

REL_TOLERANCE = 1e-2
PER_CALL_OVERHEAD_S = 6e-4


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.gemm_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=lambda s: _parse_list(s, int), default=(2,))
    p.add_argument("--m", type=lambda s: _parse_list(s, int), default=M_VALUES)
    p.add_argument("--layouts", type=_parse_list, default=LAYOUTS)
    p.add_argument("--layers", type=_parse_list, default=None, help="subset of DESIGN.md's layers")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--hold-us", type=float, default=300.0, help="device hold before each timed call (0: none)")
    p.add_argument("--table", default=None, help="block table YAML (default: the GPU's package table)")
    p.add_argument("--configs", type=_parse_list, default=(),
                   help="extra block configurations to time (--fp8: the candidates, instead of FP8_CANDIDATES)")
    p.add_argument("--time-budget-s", type=float, default=600.0)
    p.add_argument("--fp8", action="store_true", help="FP8 block-scaled GEMM vs torch._scaled_mm and bf16 cuBLAS")
    p.add_argument("--write-table", default=None, help="--fp8: write the fastest FP8 blocks per shape there")
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", type=parse_shapes, default=(), help="MxNxK,... instead of the TP tables")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (the Triton interpreter: a smoke test)")
    p.add_argument("--canary-shape", type=lambda s: parse_shapes(s)[0], default=CANARY_SHAPE,
                   help="--fp8: MxNxK of the child process that runs every configuration once first")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("launch.gemm_bench needs a CUDA GPU (or --device cpu with the Triton interpreter)", file=sys.stderr)
        return 2
    if not args.device.startswith("cuda") and not args.out:
        print("launch.gemm_bench --device cpu needs --out", file=sys.stderr)
        return 2
    if args.fp8:
        from ._gemm_bench_fp8 import run_fp8
        return run_fp8(args)
    return _run_bf16(args)


def bench_device(name: str) -> tuple[torch.device, str]:
    """(device, its name for the results) -- cpu runs the Triton interpreter."""
    dev = torch.device(name)
    if dev.type != "cuda":
        return dev, "cpu"
    dev = torch.device("cuda", torch.cuda.current_device())
    return dev, torch.cuda.get_device_name(dev)


def _run_bf16(args) -> int:
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
                raise RuntimeError(f"{layer} M={m} {layout} {name} ({blocks.name}): relative error {err:.3g} vs cuBLAS")
            usable[name] = blocks
        out_c = torch.empty_like(ref)
        variants = {"cublas": lambda: torch.mm(a, b, out=out_c)}
        variants.update({name: (lambda blk=blk, o=outs[name]: triton_mm(a, b, o, blocks=blk))
                         for name, blk in usable.items()})
        stats = bench_interleaved(variants, group=None, device=dev, warmup=3, reps=args.reps,
                                  hold_device_us=args.hold_us)
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
    print(format_table(rows, ["layer", "tp", "layout", "M", "K", "N", "t_cublas_ms", "t_table_ms", "table_blocks",
                              "table_over_cublas", "heuristic_over_cublas"]))
    for layout, s in summarize(rows, "table_over_cublas").items():
        print(f"{layout}: table/cuBLAS speed median {s['median']:.3f}, min {s['min']:.3f}, "
              f">= 0.85 on {s['at_least_0.85']} of {s['n']}")
    print(f"{len(rows)} shapes measured, {len(skipped)} skipped (budget); results: {out}")
    return 0 if rows else 1


def _write(out, rows, skipped, args, device_name, table) -> None:
    write_results(out, rows, device=device_name, tp=args.tp[0] if len(args.tp) == 1 else 0, extra={
        "op": "gemm", "tp_sizes": list(args.tp), "hold_device_us": args.hold_us, "reps": args.reps,
        "table": args.table or "package", "table_entries": len(table.entries) if table else 0,
        "summary": summarize(rows, "table_over_cublas"), "skipped": skipped})


if __name__ == "__main__":
    sys.exit(main())
