"""Side-by-side benchmarks under torchrun.

    torchrun --standalone --nproc-per-node 2 -m launch.bench --op pool_bw [--sizes-mb 1,4,16]
    torchrun --standalone --nproc-per-node 2 -m launch.bench --op ag_gemm [--m 1024,4096] [--methods fused]
    torchrun --standalone --nproc-per-node 2 -m launch.bench --op gemm_rs [--sm-margins 0,8,16]

ag_gemm / gemm_rs run every point of DESIGN.md's shape table at the job's TP size (or --shape MxKxN):
ours (each method; gemm_rs fused also per sm_margin), NCCL-then-GEMM ("seq"), PyTorch async-TP
("torch"), GEMM alone (cuBLAS and Triton) and communication alone, with E and speedup columns.
Prints a table on rank 0 and writes results/<op>_<device-slug>_tp<W>.json (or --out).
"""

from __future__ import annotations

import argparse
import sys

from overlap.presets import load_config, load_preset
from launch.report import device_slug, format_table, write_results
from launch.shapes import M_VALUES, ShapePoint, ag_points, rs_points

from . import _dist

OPS = ("pool_bw", "ag_gemm", "gemm_rs")
DEFAULT_SM_MARGINS = (0, 4, 8, 16, 24, 32)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=OPS, default="pool_bw", help="what to benchmark")
    p.add_argument("--sizes-mb", type=_ints, default=None,
                   help="pool_bw: shard sizes in MB (default 1,4,16,64,256 on GPU; 1,4,16 on CPU)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "nvshmem", "ipc", "host"),
                   help="pool_bw: symmetric-memory backend of the pool")
    p.add_argument("--tokens", "--m", dest="m", type=_ints, default=M_VALUES,
                   help="token counts M of the shape table (--m is ambiguous behind torchrun)")
    p.add_argument("--layers", default=None, help="comma-separated layer names of the shape table")
    p.add_argument("--shape", default=None, help="one custom point MxKxN instead of the table (K, N local)")
    p.add_argument("--methods", default=None, help="methods of ours (default: all on GPU, decomposed on CPU)")
    p.add_argument("--sm-margins", type=_ints, default=DEFAULT_SM_MARGINS,
                   help="gemm_rs: sm_margin sweep of the fused method")
    p.add_argument("--config", default=None, help="YAML preset (default: auto-selected by GPU and TP size)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per variant (median reported)")
    p.add_argument("--out", default=None, help="results JSON path (default results/<op>_<gpu>_tp<W>.json)")
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo even if GPUs are present")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="ag_gemm/gemm_rs: time every variant as a CUDA-graph replay (device time, no host cost)")
    return p.parse_args(argv)


def _points(args, op: str, world: int) -> list[ShapePoint]:
    if args.shape:
        m, k, n = _ints(args.shape.replace("x", ","))
        return [ShapePoint("custom", op, m, k, n)]
    layers = args.layers.split(",") if args.layers else None
    return (ag_points if op == "ag_gemm" else rs_points)(world, ms=args.m, layers=layers)


def _configs(args, ctx, op: str):
    cfg = load_config(args.config) if args.config else load_preset(ctx.device_name, ctx.world_size)
    cfg.check_world_size(ctx.world_size)
    base = getattr(cfg, op).default
    if args.methods:
        methods = args.methods.split(",")
    else:
        methods = ["decomposed", "fused"] if ctx.device.type == "cuda" else ["decomposed"]
        if op == "gemm_rs":
            methods += ["pair"] + (["epilogue_reduce"] if ctx.device.type == "cuda" else [])
    out = []
    for method in methods:
        if op == "gemm_rs" and method == "fused":
            out += [base.with_method(method, sm_margin=s, num_comm_sms=s) for s in args.sm_margins if s > 0]
        elif op == "gemm_rs" and method == "pair" and ctx.world_size != 2:
            continue  # the W = 2 schedule
        else:
            out.append(base.with_method(method))
    return out


COLUMNS = {
    "pool_bw": ["size_bytes", "ce_pull_median_ms", "ce_pull_GBps", "allgather_median_ms", "allgather_GBps",
                "ce_pull_min_ms", "ce_pull_max_ms", "allgather_backend"],
    "ag_gemm": ["layer", "M", "K", "N", "method", "t_ours_ms", "t_seq_nccl_ms", "t_torch_ms", "t_gemm_ms",
                "t_comm_ms", "E_ours", "E_seq", "E_torch", "speedup_vs_seq", "speedup_vs_torch", "k_comm",
                "k_comp"],
    "gemm_rs": ["layer", "M", "K", "N", "method", "sm_margin", "t_ours_ms", "t_seq_nccl_ms", "t_torch_ms",
                "t_gemm_ms", "t_comm_ms", "E_ours", "E_seq", "E_torch", "speedup_vs_seq", "speedup_vs_torch"],
}


def main(argv=None) -> int:
    args = parse_args(argv)
    with _dist.job("launch.bench", force_cpu=args.cpu) as ctx:
        if args.op == "pool_bw":
            from . import pool_bw
            rows = pool_bw.run(ctx, sizes_mb=args.sizes_mb, backend=args.backend, warmup=args.warmup,
                               reps=args.reps)
        else:
            from . import op_bench
            rows = op_bench.run(ctx, args.op, _points(args, args.op, ctx.world_size),
                                _configs(args, ctx, args.op), warmup=args.warmup, reps=args.reps,
                                cuda_graphs=args.cuda_graphs)
        if ctx.rank == 0:
            slug = device_slug(ctx.device_name)
            suffix = "_graphs" if args.cuda_graphs else ""
            out = args.out or f"results/{args.op}_{slug}_tp{ctx.world_size}{suffix}.json"
            write_results(out, rows, device=ctx.device_name, tp=ctx.world_size,
                          extra={"op": args.op, "cuda_graphs": args.cuda_graphs})
            print(format_table(rows, COLUMNS[args.op]))
            print(f"wrote {out}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
