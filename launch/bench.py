"""Side-by-side benchmarks under torchrun.

    torchrun --standalone --nproc-per-node 2 -m launch.bench --op pool_bw [--sizes-mb 1,4,16]

Prints a table on rank 0 and writes results/<op>_<device-slug>_tp<W>.json (or --out).
"""

from __future__ import annotations

import argparse
import sys
import warnings

from overlap.report import device_slug, format_table, write_results

from . import _dist

OPS = ("pool_bw",)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=OPS, default="pool_bw", help="what to benchmark")
    p.add_argument("--sizes-mb", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="pool_bw: shard sizes in MB (default 1,4,16,64,256 on GPU; 1,4,16 on CPU)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "nvshmem", "host"),
                   help="symmetric-memory backend of the pool")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per variant (median reported)")
    p.add_argument("--out", default=None, help="results JSON path (default results/<op>_<gpu>_tp<W>.json)")
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo even if GPUs are present")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # torch >= 2.13 renames all_gather_into_tensor; the GPU machine's 2.11 has only the old name.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated", category=FutureWarning)
    ctx = _dist.init(force_cpu=args.cpu)
    try:
        if ctx.world_size < 2:
            print("launch.bench needs at least 2 ranks (torchrun --nproc-per-node N, N >= 2)", file=sys.stderr)
            return 2
        from . import pool_bw
        rows = pool_bw.run(ctx, sizes_mb=args.sizes_mb, backend=args.backend, warmup=args.warmup,
                           reps=args.reps)
        if ctx.rank == 0:
            slug = device_slug(ctx.device_name)
            out = args.out or f"results/{args.op}_{slug}_tp{ctx.world_size}.json"
            write_results(out, rows, device=ctx.device_name, tp=ctx.world_size, extra={"op": args.op})
            cols = ["size_bytes", "ce_pull_median_ms", "ce_pull_GBps", "allgather_median_ms",
                    "allgather_GBps", "ce_pull_min_ms", "ce_pull_max_ms", "allgather_backend"]
            print(format_table(rows, cols))
            print(f"wrote {out}")
        return 0
    finally:
        _dist.shutdown()


if __name__ == "__main__":
    sys.exit(main())
