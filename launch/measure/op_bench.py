"""AG+GEMM and GEMM+RS benchmarks: ours (each method) next to NCCL-then-GEMM, PyTorch async-TP, GEMM
alone and communication alone, timed in one interleaved run per shape point (launch.measure.timing).

One row per (point, method[, sm_margin]); every row carries the point's baselines, so
E = T_ideal / T and the speedups can be read off each row. Correctness is checked before timing.

k_comm / k_comp in these rows are span ratios of traced calls (median per rank, then max over ranks):
AG k_comm = comm-stream span / copy-engine gather alone, k_comp = the whole call on the compute stream
(waits for chunks included) / GEMM alone; RS k_comp = GEMM span of the call / GEMM alone on all SMs. They
say where the call's time goes; the contention-only k with the same SM budget is launch.kfactor's.

`cuda_graphs=True` builds our ops with `cuda_graphs=True` and times every variant (ours, NCCL-then-GEMM,
GEMM alone, comm alone) as a CUDA-graph replay (launch/measure/graphs.py): device time without the per-call
host cost. PyTorch's async-TP ops are left out there (not captured), and so are the traced k columns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tp_overlap.config import envs
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.ops.reference import ag_gemm_reference, gemm_rs_reference
from tp_overlap.launch.measure.k_factor import k_from_trace, trace_op
from tp_overlap.launch.cli.shapes import ShapePoint
from tp_overlap.launch.measure.timing import bench_interleaved, progress
from tp_overlap.symm_mem.pool import SymmetricPool

from .accuracy import rel_err as _rel_err
from ..cli.common import UsageError
from ..cli.dist import DistContext
from .graphs import graph_variants

TRACE_REPS = 10


def _agree(ctx: DistContext, problem: str | None) -> None:
    """Raise the same error on every rank if any rank found a problem (so that none waits for the rest)."""
    found = [None] * ctx.world_size
    dist.all_gather_object(found, problem, group=ctx.group)
    bad = [(r, p) for r, p in enumerate(found) if p]
    if bad:
        raise RuntimeError("; ".join(f"rank {r}: {p}" for r, p in bad))


def _torch_group_name(group) -> str | None:
    try:
        import torch.distributed._symmetric_memory as symm
        name = group.group_name
        if hasattr(symm, "enable_symm_mem_for_group"):
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm.enable_symm_mem_for_group(name)
        return name
    except Exception:
        return None


def _keep_if_runs(variants: dict, name: str, ctx) -> None:
    """Drop variant `name` (on every rank) if it fails on any rank: a baseline that does not run on this
    torch build must not take the benchmark down with it."""
    problem = None
    try:
        variants[name]()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:
        problem = f"{type(exc).__name__}: {str(exc)[:200]}"
    found = [None] * ctx.world_size
    dist.all_gather_object(found, problem, group=ctx.group)
    if any(found):
        del variants[name]
        progress(f"{name} baseline dropped: {next(p for p in found if p)}", rank=ctx.rank)


def _baseline_columns(stats, t_ours_ms: float, t_gemm: float, t_comm: float) -> dict:
    t_ideal = max(t_gemm, t_comm)
    seq = stats["seq"].median_ms
    row = {"t_gemm_ms": t_gemm, "t_comm_ms": t_comm, "t_ideal_ms": t_ideal, "t_seq_nccl_ms": seq,
           "t_ours_ms": t_ours_ms, "E_ours": t_ideal / t_ours_ms, "E_seq": t_ideal / seq,
           "speedup_vs_seq": seq / t_ours_ms,
           "hidden_comm": (t_gemm + t_comm - t_ours_ms) / t_comm if t_comm else None}
    if "torch" in stats:
        row.update(t_torch_ms=stats["torch"].median_ms, E_torch=t_ideal / stats["torch"].median_ms,
                   speedup_vs_torch=stats["torch"].median_ms / t_ours_ms)
    else:
        row.update(t_torch_ms=None, E_torch=None, speedup_vs_torch=None)
    for name, s in stats.items():
        row[f"t_{name}_ms"] = s.median_ms
        row[f"t_{name}_min_ms"], row[f"t_{name}_max_ms"] = s.min_ms, s.max_ms
    return row


def _gemm_variants(ctx, a, w, out_cublas, out_triton) -> dict:
    variants = {"gemm_cublas": lambda: torch.mm(a, w, out=out_cublas)}
    if ctx.device.type == "cuda":
        from tp_overlap.gemm import triton_mm
        variants["gemm_triton"] = lambda: triton_mm(a, w, out_triton)
    return variants


def _graphed(ctx, variants: dict, point: ShapePoint) -> dict:
    """Every variant but PyTorch's async-TP as a CUDA-graph replay; a variant the table needs that could not
    be captured is an error (the same on every rank: the drop is agreed), not a KeyError later."""
    variants.pop("torch", None)
    replays = graph_variants(variants, group=ctx.group, rank=ctx.rank)
    missing = sorted(set(variants) - set(replays) - {"gemm_triton"})
    if missing:
        raise RuntimeError(f"{point.layer} M={point.m}: {missing} could not be captured in a CUDA graph; "
                           f"run without --cuda-graphs")
    return replays


def _t_gemm(stats) -> float:
    return min(stats[n].median_ms for n in ("gemm_cublas", "gemm_triton") if n in stats)


# ----- AG + GEMM -------------------------------------------------------------------------------------
def bench_ag_point(ctx: DistContext, point: ShapePoint, configs: list, *, warmup: int,
                   reps: int, cuda_graphs: bool = False) -> list[dict]:
    world, dev, dtype = ctx.world_size, ctx.device, torch.bfloat16
    m, k, n = point.m, point.k, point.n
    gen = torch.Generator(device="cpu").manual_seed(10 + ctx.rank + m + n)
    a_shard = torch.randn(m // world, k, generator=gen).to(dtype).to(dev)
    w = (torch.randn(k, n, generator=gen) / k ** 0.5).to(dtype).to(dev)
    pool_bytes = len(configs) * 2 * m * k * dtype.itemsize + (1 << 20)
    rows = []
    with SymmetricPool(pool_bytes, group=ctx.group, device=dev, timeout_s=envs.timeout_s()) as pool:
        ops = {c.method + str(i): AgGemm(group=ctx.group, pool=pool, max_m=m, k=k, n_local=n, dtype=dtype,
                                        config=c, name=f"ag{i}")
               for i, c in enumerate(configs)}
        ref_out, a_full = ag_gemm_reference(a_shard, w, group=ctx.group)
        problem = None
        for key, op in ops.items():
            out, a = op(a_shard, w, return_gathered=True)
            if not torch.equal(a, a_full):
                problem = f"{point.layer} M={m}: {key} gathered a is not bit-exact"
            err = _rel_err(out, a_full.float() @ w.float())
            if err > 1e-2:
                problem = f"{point.layer} M={m}: {key} relative error {err:.3g} > 1e-2"
        _agree(ctx, problem)
        gather_buf = torch.empty(m, k, dtype=dtype, device=dev)
        out_c, out_t = torch.empty(m, n, dtype=dtype, device=dev), torch.empty(m, n, dtype=dtype, device=dev)
        variants = {f"ours_{key}": (lambda op=op: op(a_shard, w)) for key, op in ops.items()}
        if not cuda_graphs:  # k's compute alone: each op's own plan without its comm lanes
            variants |= {f"compute_{key}": (lambda op=op: op.compute_alone(a_shard, w)) for key, op in ops.items()}
        variants["seq"] = lambda: ag_gemm_reference(a_shard, w, group=ctx.group)
        group_name = _torch_group_name(ctx.group) if dev.type == "cuda" else None
        if group_name:
            variants["torch"] = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [w], 0, group_name)
            _keep_if_runs(variants, "torch", ctx)
        variants.update(_gemm_variants(ctx, a_full, w, out_c, out_t))
        variants["comm_nccl"] = lambda: dist.all_gather_into_tensor(gather_buf, a_shard, group=ctx.group)
        first = next(iter(ops.values()))
        variants["comm_ce"] = lambda: first.all_gather(a_shard)
        if cuda_graphs:
            variants = _graphed(ctx, variants, point)
        stats = bench_interleaved(variants, group=ctx.group, device=dev, warmup=warmup, reps=reps)
        t_gemm = _t_gemm(stats)
        t_comm = min(stats["comm_nccl"].median_ms, stats["comm_ce"].median_ms)
        for (key, op), cfg in zip(ops.items(), configs):
            k_comm, k_comp = (None, None) if cuda_graphs else _k_factors(
                ctx, op, (a_shard, w), stats["comm_ce"].median_ms, stats[f"compute_{key}"].median_ms)
            row = {"layer": point.layer, "op": "ag_gemm", "M": m, "K": k, "N": n, "method": cfg.method,
                   "cuda_graphs": cuda_graphs,
                   "sm_margin": cfg.sm_margin, "chunks_per_rank": cfg.chunks_per_rank,
                   **_baseline_columns(stats, stats[f"ours_{key}"].median_ms, t_gemm, t_comm),
                   "k_comm": k_comm, "k_comp": k_comp}
            rows.append(row)
        for op in ops.values():
            op.close()
        pool.barrier()
    return rows


def _k_factors(ctx, op, args, t_comm_solo: float, t_comp_solo: float) -> tuple[float, float]:
    """k of the op's own call (the one definition, launch/measure/k_factor.py): its traced lane spans over the comm
    path alone and its compute alone (`op.compute_alone`)."""
    kf = k_from_trace(trace_op(op, args, reps=TRACE_REPS), t_comm_solo=t_comm_solo, t_comp_solo=t_comp_solo)
    return kf.k_comm, kf.k_comp


# ----- GEMM + RS -------------------------------------------------------------------------------------
def bench_rs_point(ctx: DistContext, point: ShapePoint, configs: list, *, warmup: int,
                   reps: int, cuda_graphs: bool = False) -> list[dict]:
    world, dev, dtype = ctx.world_size, ctx.device, torch.bfloat16
    m, k, n = point.m, point.k, point.n
    gen = torch.Generator(device="cpu").manual_seed(20 + ctx.rank + m + n)
    a = torch.randn(m, k, generator=gen).to(dtype).to(dev)
    w = (torch.randn(k, n, generator=gen) / k ** 0.5).to(dtype).to(dev)
    pool_bytes = len(configs) * 2 * m * n * dtype.itemsize + (1 << 20)
    rows = []
    with SymmetricPool(pool_bytes, group=ctx.group, device=dev, timeout_s=envs.timeout_s()) as pool:
        ops = {f"{c.method}{i}": GemmRs(group=ctx.group, pool=pool, max_m=m, k_local=k, n=n, dtype=dtype,
                                       config=c, name=f"rs{i}")
               for i, c in enumerate(configs)}
        ref = gemm_rs_reference(a, w, group=ctx.group)
        problem = None
        for key, op in ops.items():
            out = op(a, w)
            if dev.type == "cuda":
                op.check_errors()
            err = _rel_err(out, ref)
            if err > 1e-2:
                problem = f"{point.layer} M={m}: {key} relative error {err:.3g} vs seq > 1e-2"
        _agree(ctx, problem)
        partial = torch.mm(a, w)
        rs_out = torch.empty(m // world, n, dtype=dtype, device=dev)
        out_c, out_t = torch.empty(m, n, dtype=dtype, device=dev), torch.empty(m, n, dtype=dtype, device=dev)
        variants = {f"ours_{key}": (lambda op=op: op(a, w)) for key, op in ops.items()}
        if not cuda_graphs:  # k's compute alone: each op's own plan without its comm lanes
            variants |= {f"compute_{key}": (lambda op=op: op.compute_alone(a, w)) for key, op in ops.items()}
        variants["seq"] = lambda: gemm_rs_reference(a, w, group=ctx.group)
        group_name = _torch_group_name(ctx.group) if dev.type == "cuda" else None
        if group_name:
            variants["torch"] = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
                a, w, "sum", 0, group_name)
            _keep_if_runs(variants, "torch", ctx)
        variants.update(_gemm_variants(ctx, a, w, out_c, out_t))
        variants["comm_nccl"] = lambda: dist.reduce_scatter_tensor(rs_out, partial, group=ctx.group)
        first = next(iter(ops.values()))
        variants["comm_ce"] = lambda: first.reduce_scatter(partial)
        if cuda_graphs:
            variants = _graphed(ctx, variants, point)
        stats = bench_interleaved(variants, group=ctx.group, device=dev, warmup=warmup, reps=reps)
        t_gemm = _t_gemm(stats)
        t_comm = stats["comm_nccl"].median_ms
        for (key, op), cfg in zip(ops.items(), configs):
            k_comm, k_comp = (None, None) if cuda_graphs else _k_factors(
                ctx, op, (a, w), stats["comm_ce"].median_ms, stats[f"compute_{key}"].median_ms)
            row = {"layer": point.layer, "op": "gemm_rs", "M": m, "K": k, "N": n, "method": cfg.method,
                   "cuda_graphs": cuda_graphs,
                   "sm_margin": cfg.sm_margin, "num_comm_sms": cfg.num_comm_sms,
                   **_baseline_columns(stats, stats[f"ours_{key}"].median_ms, t_gemm, t_comm),
                   "k_comm": k_comm, "k_comp": k_comp}
            rows.append(row)
            op.close()
        pool.barrier()
    return rows


def run(ctx: DistContext, op: str, points: list[ShapePoint], configs: list, *, warmup: int,
        reps: int, cuda_graphs: bool = False) -> list[dict]:
    if cuda_graphs and ctx.device.type != "cuda":
        raise UsageError("--cuda-graphs needs CUDA devices")
    bench_point = bench_ag_point if op == "ag_gemm" else bench_rs_point
    rows = []
    for i, point in enumerate(points):
        new = bench_point(ctx, point, configs, warmup=warmup, reps=reps, cuda_graphs=cuda_graphs)
        rows.extend(new)
        best = min(new, key=lambda r: r["t_ours_ms"])
        torch_e = f"{best['E_torch']:.2f}" if best["E_torch"] else "-"
        progress(f"{op} {i + 1}/{len(points)} {point.layer} M={point.m}: best {best['method']} "
                 f"{best['t_ours_ms']:.3f} ms  E {best['E_ours']:.2f} (seq {best['E_seq']:.2f}, torch {torch_e})",
                 rank=ctx.rank)
    return rows
