"""Side-by-side benchmarks under torchrun.

    torchrun --standalone --nproc-per-node 2 -m tp_overlap.launch.bench --op pool_bw [--sizes-mb 1,4,16]
    torchrun --standalone --nproc-per-node 2 -m tp_overlap.launch.bench --op ag_gemm [--tokens 1024,4096] [--methods fused]
    torchrun --standalone --nproc-per-node 2 -m tp_overlap.launch.bench --op gemm_rs [--sm-margins 0,8,16]

ag_gemm / gemm_rs run every point of the shape table (launch/cli/shapes.py) at the job's TP size (or --shape MxKxN):
ours (each method; gemm_rs fused also per sm_margin), NCCL-then-GEMM ("seq"), PyTorch async-TP
("torch"), GEMM alone (cuBLAS and Triton) and communication alone, with E and speedup columns. On CPU
(gloo + the host pool; a functional check, labelled so) the default shapes are tiny: M = 256, 512 with
K = N = 64 (--layers picks rows of the table instead). pool_bw on CPU times a memcpy from the peer's
shared memory in place of the copy engine. Prints a table on rank 0 and writes its JSON into a new run
folder, runs/bench-<UTC time>/<op>_<device-slug>_tp<W>.json (or --out; results of record: --out
results/...).
"""

from __future__ import annotations

import argparse
import sys

from tp_overlap.config.schema import METHODS
from tp_overlap.config.presets import load_config, load_preset
from tp_overlap.launch.output.report import device_slug, format_table, run_labels, write_results
from tp_overlap.launch.measure.timing import progress
from tp_overlap.launch.cli.shapes import CPU_K, CPU_M_VALUES, CPU_N, M_VALUES, ShapePoint, ag_points, rs_points

from .cli import dist as _dist
from .cli.common import (ArgumentParser, UsageError, distinct, input_file, int_list, output_file, require, run_dir,
                   run_launcher)
from .cli.limits import require_fits

PROG = "tp_overlap.launch.bench"
OPS = ("pool_bw", "ag_gemm", "gemm_rs")
DEFAULT_SM_MARGINS = (0, 4, 8, 16, 24, 32)


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--op", choices=OPS, default="pool_bw", help="what to benchmark")
    p.add_argument("--sizes-mb", type=int_list, default=None,
                   help="pool_bw: shard sizes in MB (default: 1,4,16,64,256 on GPU; 1,4,16 on CPU)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "nvshmem", "ipc", "host"),
                   help="pool_bw: symmetric-memory backend of the pool")
    p.add_argument("--tokens", type=int_list, default=None, metavar="M[,M...]",
                   help="token counts M of the shape table (default: 1024,4096,16384 on GPU; 256,512 on CPU)")
    p.add_argument("--m", dest="tokens", type=int_list, default=None, help=argparse.SUPPRESS)  # old name
    p.add_argument("--layers", default=None,
                   help="comma-separated layer names of the shape table (default: every layer on GPU; on "
                        "CPU tiny shapes unless given)")
    p.add_argument("--shape", default=None,
                   help="one custom point MxKxN instead of the table (K, N local) (default: the table)")
    p.add_argument("--methods", default=None,
                   help="methods of ours (default: every method on GPU, decomposed and pair on CPU)")
    p.add_argument("--sm-margins", type=int_list, default=DEFAULT_SM_MARGINS,
                   help="gemm_rs: sm_margin sweep of the fused method")
    p.add_argument("--config", type=input_file, default=None,
                   help="YAML preset (default: auto-selected by GPU and TP size)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls per variant")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per variant (median reported)")
    p.add_argument("--out", type=output_file, default=None,
                   help="results JSON (default: runs/bench-<UTC time>/<op>_<gpu>_tp<W>"
                   "[_graphs].json; results of record only with an explicit --out results/...)")
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo even if GPUs are present")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="ag_gemm/gemm_rs: time every variant as a CUDA-graph replay (device time, no host cost)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return make_parser().parse_args(argv)


def _points(args, op: str, world: int, cuda: bool) -> list[ShapePoint]:
    if args.shape:
        try:
            m, k, n = (int(x) for x in args.shape.split("x"))
        except ValueError:
            raise UsageError(f"--shape: expected MxKxN (three integers), got {args.shape!r}") from None
        points = [ShapePoint("custom", op, m, k, n)]
    elif cuda or args.layers:
        layers = args.layers.split(",") if args.layers else None
        distinct("--layers", layers or (), "layer")
        table = ag_points if op == "ag_gemm" else rs_points
        known = {p.layer for p in table(world)}
        unknown = sorted(set(layers or ()) - known)
        require(not unknown, f"--layers: unknown {', '.join(unknown)}; the {op} table has {', '.join(sorted(known))}")
        points = table(world, ms=args.tokens or M_VALUES, layers=layers)
    else:  # CPU: tiny shapes (the table's K and N take minutes per point on a CPU)
        points = [ShapePoint("cpu.tiny", op, m, CPU_K, CPU_N) for m in args.tokens or CPU_M_VALUES]
    for p in points:
        require(min(p.m, p.k, p.n) > 0, f"{p.layer}: M, K and N must be > 0, got {p.m}x{p.k}x{p.n}")
        require(p.m % world == 0, f"{p.layer}: M={p.m} is not divisible by the TP size {world}; give multiples of "
                                  f"{world}, e.g. --tokens {-(-p.m // world) * world}")
    return points


def _op_bytes(p: ShapePoint, num_configs: int) -> int:
    """Lower bound of one point's bytes per rank (launch/measure/op_bench.py): the pool's regions, one per config, and
    the operands, the gathered input and two outputs (bf16)."""
    if p.op == "ag_gemm":
        return num_configs * 2 * p.m * p.k * 2 + (p.m * p.k * 2 + p.k * p.n + 2 * p.m * p.n) * 2
    return num_configs * 2 * p.m * p.n * 2 + (p.m * p.k + p.k * p.n + 2 * p.m * p.n) * 2


def _check(args, where, cuda: bool):
    """Every argument against the placement, before any group or pool: (points, configs) of ag_gemm/gemm_rs."""
    require(args.reps > 0, f"--reps must be > 0, got {args.reps}")
    require(args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}")
    require(cuda or not args.cuda_graphs, "--cuda-graphs needs CUDA devices")
    _dist.check_ranks(PROG, where, 2)
    distinct("--tokens", args.tokens or (), "M")
    if args.op == "pool_bw":
        bad = [s for s in args.sizes_mb or () if s <= 0]
        require(not bad, f"--sizes-mb must be > 0, got {','.join(map(str, bad))}")
        distinct("--sizes-mb", args.sizes_mb or (), "size")
        largest = max(args.sizes_mb or (256,)) << 20   # the pool, the pulled copies, the collective's in and out
        require_fits(f"--sizes-mb {largest >> 20}", largest * (2 * where.world_size + 2), where,
                     "give smaller --sizes-mb")
        return None, None
    bad = [s for s in args.sm_margins if s < 0]
    require(not bad, f"--sm-margins must be >= 0, got {','.join(map(str, bad))}")
    distinct("--sm-margins", args.sm_margins, "sm_margin")
    points = _points(args, args.op, where.world_size, cuda)
    configs = _configs(args, where, args.op)
    worst = max(points, key=lambda p: _op_bytes(p, len(configs)))
    require_fits(f"{worst.layer} M={worst.m} K={worst.k} N={worst.n}", _op_bytes(worst, len(configs)), where,
                 "give a smaller --tokens or --shape")
    return points, configs


def _configs(args, ctx, op: str):
    cfg = load_config(args.config) if args.config else load_preset(ctx.device_name, ctx.world_size)
    cfg.check_world_size(ctx.world_size)
    base = getattr(cfg, op).default
    if args.methods:
        methods = args.methods.split(",")
        unknown = [m for m in methods if m not in METHODS[op]]
        require(not unknown, f"--methods: unknown {', '.join(map(repr, unknown))} for {op}; allowed: "
                f"{', '.join(METHODS[op])}")
        distinct("--methods", methods, "method")
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


def _run(args) -> int:
    where = _dist.placement(force_cpu=args.cpu)
    cuda = where.device.type == "cuda"
    points, configs = _check(args, where, cuda)
    labels = run_labels(where.device.type, where.world_size)
    for line in labels.header:
        progress(line, rank=where.rank)
    with _dist.job(PROG, where=where) as ctx:
        if args.op == "pool_bw":
            from .measure import pool_bw
            rows = pool_bw.run(ctx, sizes_mb=args.sizes_mb, backend=args.backend, warmup=args.warmup,
                               reps=args.reps)
        else:
            from .measure import op_bench
            rows = op_bench.run(ctx, args.op, points, configs, warmup=args.warmup, reps=args.reps,
                                cuda_graphs=args.cuda_graphs)
        rows = [{"run_kind": labels.kind} | row for row in rows]
        if ctx.rank == 0:
            slug = device_slug(ctx.device_name)
            suffix = "_graphs" if args.cuda_graphs else ""
            out = args.out or run_dir("bench") / f"{args.op}_{slug}_tp{ctx.world_size}{suffix}.json"
            write_results(out, rows, device=ctx.device_name, tp=ctx.world_size,
                          extra={"op": args.op, "cuda_graphs": args.cuda_graphs, "run_kind": labels.kind,
                                 "run_notes": labels.header})
            for line in labels.header + ([POOL_BW_CPU_NOTE] if args.op == "pool_bw" and not cuda else []):
                print(line)
            print(format_table(rows, ["run_kind"] + COLUMNS[args.op]))
            print(f"wrote {out}")
        return 0


POOL_BW_CPU_NOTE = ("pool_bw on CPU: ce_pull is a memcpy from the peer's shared memory on the calling thread "
                    "(no copy engine), allgather is gloo over TCP")


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
