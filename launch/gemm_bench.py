"""The persistent Triton GEMM alone (local epilogue, all SMs) against cuBLAS on every local GEMM of the
AG and RS shape tables at a given TP size: it bounds everything the fused ops can reach.

    python -m launch.gemm_bench --tp 2 [--m 1024,4096,16384] [--out results/gemm_<gpu>_tp2.json]

Single process, one GPU. Each Triton block configuration is timed interleaved with cuBLAS. Times are device
times: the stream is held busy for `--hold-us` (default 300) after each L2 flush, so Python launch cost
(about 70 us for the Triton launch against 12 us for cuBLAS, results/launch_overhead_*.json) is not charged
to the kernel; `--hold-us 0` measures from an idle device instead.
"""

from __future__ import annotations

import argparse
import sys

import torch

from launch.report import device_slug, format_table, write_results
from launch.shapes import M_VALUES, ag_points, rs_points
from launch.timing import bench_interleaved, progress
from overlap.triton_gemm import GemmBlocks, choose_blocks, num_sms, triton_mm

CANDIDATES = {
    "128x256x64w8s3": GemmBlocks(128, 256, 64, 8, 8, 3),
    "128x256x64w8s3ws": GemmBlocks(128, 256, 64, 8, 8, 3, True),
    "128x256x64w8s4ws": GemmBlocks(128, 256, 64, 8, 8, 4, True),
    "128x128x64w8s4": GemmBlocks(128, 128, 64, 8, 8, 4),
    "128x128x64w4s4": GemmBlocks(128, 128, 64, 8, 4, 4),
    "128x128x64w4s4ws": GemmBlocks(128, 128, 64, 8, 4, 4, True),
    "64x128x64w4s5": GemmBlocks(64, 128, 64, 8, 4, 5),
    "128x256x128w8s2ws": GemmBlocks(128, 256, 128, 8, 8, 2, True),
    "256x128x64w8s3ws": GemmBlocks(256, 128, 64, 8, 8, 3, True),
    "128x256x64w8s3g16ws": GemmBlocks(128, 256, 64, 16, 8, 3, True),
    "128x128x128w8s3ws": GemmBlocks(128, 128, 128, 8, 8, 3, True),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.gemm_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--m", type=lambda s: tuple(int(x) for x in s.split(",")), default=M_VALUES)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--hold-us", type=float, default=300.0, help="device hold before each timed call (0: none)")
    p.add_argument("--configs", default=None, help="comma-separated subset of the block configurations")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch.gemm_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    candidates = {n: CANDIDATES[n] for n in args.configs.split(",")} if args.configs else CANDIDATES
    points = ag_points(args.tp, ms=args.m) + rs_points(args.tp, ms=args.m)
    rows = []
    for i, pt in enumerate(points):
        gen = torch.Generator().manual_seed(i)
        a = torch.randn(pt.m, pt.k, generator=gen).bfloat16().to(dev)
        b = (torch.randn(pt.k, pt.n, generator=gen) / pt.k ** 0.5).bfloat16().to(dev)
        ref = torch.mm(a, b)
        outs = {name: torch.full_like(ref, float("nan")) for name in candidates}
        usable = {}
        for name, blocks in candidates.items():
            try:
                triton_mm(a, b, outs[name], blocks=blocks)
            except Exception as exc:  # e.g. OutOfResources (shared memory): this config cannot run
                progress(f"  {name} skipped: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            usable[name] = blocks
            err = ((outs[name].float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 1e-2:
                raise RuntimeError(f"{pt.layer} M={pt.m} {name}: relative error {err:.3g} vs cuBLAS")
        out_c = torch.empty_like(ref)
        variants = {"cublas": lambda: torch.mm(a, b, out=out_c)}
        variants.update({name: (lambda blk=blk, o=outs[name]: triton_mm(a, b, o, blocks=blk))
                         for name, blk in usable.items()})
        stats = bench_interleaved(variants, group=None, device=dev, warmup=3, reps=args.reps,
                                  hold_device_us=args.hold_us)
        best = min(usable, key=lambda n: stats[n].median_ms)
        heuristic = next((n for n, blk in usable.items() if blk == choose_blocks(pt.m, pt.n, pt.k, sm_count=num_sms(dev))),
                         best)
        flops = 2 * pt.m * pt.n * pt.k
        row = {"layer": pt.layer, "op": pt.op, "M": pt.m, "K": pt.k, "N": pt.n,
               "t_cublas_ms": stats["cublas"].median_ms, "t_triton_best_ms": stats[best].median_ms,
               "best_blocks": best, "heuristic_blocks": heuristic,
               "t_triton_heuristic_ms": stats[heuristic].median_ms,
               "triton_over_cublas": stats["cublas"].median_ms / stats[best].median_ms,
               "heuristic_over_cublas": stats["cublas"].median_ms / stats[heuristic].median_ms,
               "tflops_cublas": flops / stats["cublas"].median_ms / 1e9,
               "tflops_triton": flops / stats[best].median_ms / 1e9, "num_sms": num_sms(dev)}
        for name, s in stats.items():
            row.update(s.as_dict(f"{name}_"))
        rows.append(row)
        progress(f"gemm {i + 1}/{len(points)} {pt.layer} M={pt.m}: cuBLAS {row['t_cublas_ms']:.3f} ms, "
                 f"triton {row['t_triton_best_ms']:.3f} ms ({best})")
    out = args.out or f"results/gemm_{device_slug(torch.cuda.get_device_name(dev))}_tp{args.tp}.json"
    write_results(out, rows, device=torch.cuda.get_device_name(dev), tp=args.tp,
                  extra={"op": "gemm", "hold_device_us": args.hold_us})
    print(format_table(rows, ["layer", "op", "M", "K", "N", "t_cublas_ms", "t_triton_best_ms", "best_blocks",
                              "triton_over_cublas", "heuristic_over_cublas"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
