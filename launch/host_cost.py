"""Host time of one eager call of each op and method, against one `torch.mm` in the same process.

    torchrun --standalone --nproc-per-node 2 -m launch.host_cost [--out FILE] [--reps 30]

Needs a CUDA GPU and at least 2 ranks (two processes may share one GPU).

Every call is timed on the host (perf_counter around the call, no synchronisation) while the device is held
busy by a spin kernel, so the number is the enqueue cost alone: validation, the per-call M check, the
program's stream operations, the GEMM launches. Each op and method runs with and without the eager-call
graphs (OVERLAP_EAGER_GRAPHS). Also a whole TP MLP training step (forward + backward) against the same step's
GEMM calls alone. Median of `--reps` per rank, max over ranks. On one GPU several processes may share it
(pool backend ipc); it measures host time only, which sharing does not make meaningless (the other process
does slow every CUDA call a little: the ratio to torch.mm in the same process is what to read).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from launch.report import device_slug, format_table, write_results
from launch.timing import progress

from symm_mem._layout import BACKENDS

from . import _dist
from ._cli import ArgumentParser, output_file, require, run_launcher
from ._limits import require_fits

PROG = "launch.host_cost"
HOLD_CYCLES = 40_000_000  # ~20 ms: the device stays busy through the timed call
POOL_BYTES = 2 << 30


def _host_us(fn, group, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        torch.cuda._sleep(HOLD_CYCLES)
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return samples


def _max_median(samples, group, device) -> tuple[float, float, float]:
    t = torch.tensor([statistics.median(samples), min(samples), max(samples)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # CPU tensor: gloo when processes share a GPU
    return tuple(t.tolist())


def _op_calls(ctx, pool, m, k, n):
    """{(op, method): (call, the consumer's GEMM as one torch.mm)} on llama8b.qkv / o_proj-like shapes."""
    from overlap.ag_gemm import AgGemm
    from overlap.config import AgGemmConfig, GemmRsConfig
    from overlap.gemm_rs import GemmRs
    dev, world, bf16 = ctx.device, ctx.world_size, torch.bfloat16
    a_shard = torch.randn(m // world, k, device=dev, dtype=bf16)
    w = torch.randn(n, k, device=dev, dtype=bf16).t()
    a_full = torch.randn(m, k, device=dev, dtype=bf16)
    a_rs = torch.randn(m, n, device=dev, dtype=bf16)
    w_rs = torch.randn(k, n, device=dev, dtype=bf16).t()
    calls = {}
    for method, lead in (("decomposed", 0.5), ("decomposed", 0.0), ("fused", 0.0)):
        op = AgGemm(group=ctx.group, pool=pool, max_m=m, k=k, n_local=n, dtype=bf16,
                    config=AgGemmConfig(method=method, lead_fraction=lead), name=f"hc.ag.{method}.{lead}")
        calls[("ag_gemm", f"{method}" + (f" lead={lead}" if lead else ""))] = (
            lambda op=op: op(a_shard, w), lambda: torch.mm(a_full, w))
    rs_methods = [("fused", dict(sm_margin=16, num_comm_sms=16)), ("epilogue_reduce", dict(num_comm_sms=0)),
                  ("decomposed", dict(num_comm_sms=8))] + ([("pair", dict(num_comm_sms=0))] if world == 2 else [])
    for method, extra in rs_methods:
        op = GemmRs(group=ctx.group, pool=pool, max_m=m, k_local=n, n=k, dtype=bf16,
                    config=GemmRsConfig(method=method, **extra), name=f"hc.rs.{method}")
        calls[("gemm_rs", method)] = (lambda op=op: op(a_rs, w_rs), lambda: torch.mm(a_rs, w_rs))
    return calls


def _step_calls(ctx, pool, m, hidden, ffn):
    """A TP MLP step (forward + backward) and the same step's GEMM calls alone (6 torch.mm)."""
    from overlap.layers import TPMLP
    dev, world, bf16 = ctx.device, ctx.world_size, torch.bfloat16
    mlp = TPMLP(hidden, ffn, group=ctx.group, max_m=m, dtype=bf16, pool=pool, name="hc.mlp")
    x = torch.randn(m // world, hidden, device=dev, dtype=bf16, requires_grad=True)
    dy = torch.randn(m // world, hidden, device=dev, dtype=bf16)
    local = ffn // world
    g = {name: torch.randn(*shape, device=dev, dtype=bf16) for name, shape in {
        "x": (m, hidden), "w1": (hidden, 2 * local), "h": (m, local), "w2": (local, hidden), "dy": (m, hidden),
        "dh": (m, 2 * local)}.items()}

    def step():
        mlp(x).backward(dy)

    def gemms():
        torch.mm(g["x"], g["w1"])            # fc1 forward
        torch.mm(g["h"], g["w2"])            # fc2 forward
        torch.mm(g["dy"], g["w2"].t())       # fc2 input grad
        torch.mm(g["h"].t(), g["dy"])        # fc2 weight grad
        torch.mm(g["dh"], g["w1"].t())       # fc1 input grad
        torch.mm(g["x"].t(), g["dh"])        # fc1 weight grad
    return step, gemms, mlp


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--tokens", type=int, default=4096, help="M of the op calls and of the MLP step")
    p.add_argument("--reps", type=int, default=30, help="timed calls per variant (median reported)")
    p.add_argument("--warmup", type=int, default=8, help="untimed calls per variant first")
    p.add_argument("--backend", default="ipc", choices=BACKENDS,
                   help="pool backend (ipc: several processes may share a GPU)")
    p.add_argument("--out", type=output_file, default=None,
                   help="results JSON (default: runs/host_cost-<time>/host_cost.json)")
    return p


def parse_args(argv=None):
    return make_parser().parse_args(argv)


def _check(args, where) -> None:
    """Every argument against the placement, before any process group, pool or GPU allocation."""
    require(where.device.type == "cuda", "needs a CUDA GPU (it measures the host cost of CUDA calls with the "
                                         "device held busy); run it on a GPU machine")
    _dist.check_ranks(PROG, where, 2)
    require(args.tokens > 0 and args.tokens % where.world_size == 0,
            f"--tokens must be > 0 and a multiple of the TP size {where.world_size}, got {args.tokens}")
    require(args.reps > 0, f"--reps must be > 0, got {args.reps}")
    require(args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}")
    # the pool, and the largest of what the calls allocate (bf16): three [M, 4096] operands and the MLP's
    # fc1 output and its gradient, 3 x 14336 / W columns
    need = POOL_BYTES + args.tokens * (3 * 4096 + 3 * 14336 // where.world_size) * 2
    require_fits(f"--tokens {args.tokens}", need, where, "give a smaller --tokens")


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


def _run(args) -> int:
    where = _dist.placement()
    _check(args, where)
    from symm_mem import SymmetricPool
    with _dist.job(PROG, where=where) as ctx:
        rows = []
        with SymmetricPool(POOL_BYTES, group=ctx.group, device=ctx.device, backend=args.backend,
                           num_device_words=1 << 14) as pool:
            calls = _op_calls(ctx, pool, args.tokens, 4096, 3072 // max(1, ctx.world_size // 2))
            step, gemms, mlp = _step_calls(ctx, pool, args.tokens, 4096, 14336)
            for (op, method), (call, mm) in calls.items():
                for eager_graphs in ("1", "0"):
                    os.environ["OVERLAP_EAGER_GRAPHS"] = eager_graphs
                    for _ in range(args.warmup):
                        call()
                    ours = _max_median(_host_us(call, ctx.group, args.reps), ctx.group, ctx.device)
                    ref = _max_median(_host_us(mm, ctx.group, args.reps), ctx.group, ctx.device)
                    rows.append({"op": op, "method": method, "eager_graphs": eager_graphs == "1",
                                 "host_us": ours[0], "host_min_us": ours[1], "host_max_us": ours[2],
                                 "mm_host_us": ref[0], "ratio_to_mm": ours[0] / ref[0]})
                    progress(f"{op} {method} graphs={eager_graphs}: {ours[0]:.0f} us = {ours[0] / ref[0]:.2f} x "
                             f"torch.mm ({ref[0]:.0f} us)", rank=ctx.rank)
            os.environ["OVERLAP_EAGER_GRAPHS"] = "1"
            for _ in range(args.warmup):
                step()
                gemms()
            ours = _max_median(_host_us(step, ctx.group, args.reps), ctx.group, ctx.device)
            ref = _max_median(_host_us(gemms, ctx.group, args.reps), ctx.group, ctx.device)
            rows.append({"op": "tp_mlp step (fwd+bwd)", "method": "preset", "eager_graphs": True,
                         "host_us": ours[0], "host_min_us": ours[1], "host_max_us": ours[2],
                         "mm_host_us": ref[0], "ratio_to_mm": ours[0] / ref[0]})
            mlp.check_errors()
            mlp.close()
            pool.barrier()
        if ctx.rank == 0:
            out = args.out or f"runs/host_cost-{time.strftime('%Y%m%d-%H%M%S')}/host_cost.json"
            write_results(out, rows, device=ctx.device_name, tp=ctx.world_size,
                          extra={"op": "host_cost", "tokens": args.tokens, "reps": args.reps,
                                 "definitions": "host_us: perf_counter around one eager call with the device held "
                                                "busy, median over reps per rank, max over ranks; mm_host_us: the "
                                                "op's consumer GEMM as one torch.mm in the same process (for the "
                                                "MLP row: the step's 6 GEMMs); ratio_to_mm = host_us / mm_host_us"})
            print(format_table(rows, ["op", "method", "eager_graphs", "host_us", "mm_host_us", "ratio_to_mm",
                                      "host_min_us", "host_max_us"]))
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
