"""`tp_overlap.launch.tp_mlp --offload auto|none|<list>`: the same training step with and without activation offload.

To wire into launch/tp_mlp.py (three places):

    from .offload_report import add_offload_argument, offload_report
    add_offload_argument(p)                                          # in parse_args
    if args.offload.enabled:                                         # in run_point, after the k factors
        row |= offload_report(ctx, ours, x, dy, args.offload, warmup=args.warmup, reps=args.steps,
                              k_factors=lambda step: _k_factors(ctx, ours, x, dy, step, warmup=2,
                                                                reps=max(5, args.steps // 2)))

`offload_report` measures this machine's copy bandwidth and k beside the fc1 GEMM and the layer's times
(all agreed over the ranks: the slowest copy, the longest GEMM), plans per the config, then times the
step of `mlp` without and with the engine, interleaved (max over ranks), with the peak device memory of
each (max over ranks; None on CPU) and, when given, k per AllGather+GEMM op for each step. The host pool is
allocated here for the plan (once per call) unless `host_pool` is passed.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from tp_overlap.config.schema import ConfigError
from tp_overlap.config.offload import OffloadConfig, parse_offload_arg
from tp_overlap.offload.engine import OffloadEngine, host_bytes
from tp_overlap.offload.host_pool import HostPool
from tp_overlap.offload.planner import Rates, plan_for
from tp_overlap.launch.measure.timing import bench_interleaved

from .offload_measure import measure_copies, measure_layer_times, peak_of

COPY_BYTES = 64 << 20


def _offload_arg(text: str) -> OffloadConfig:
    """argparse type of --offload: a bad value is a usage error that lists the allowed forms."""
    try:
        return parse_offload_arg(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.detail) from None


def add_offload_argument(parser) -> None:
    parser.add_argument("--offload", type=_offload_arg, default=OffloadConfig(enabled=False),
                        metavar="auto|none|LIST",
                        help="also time the step with activation offload: auto (the planner), none (default), "
                             "or tensors by hand, e.g. h,a=recompute (x: gathered input, h: fc1 output, a: act, "
                             "s: silu(gate), recompute only)")


_AGREED = ("d2h_gbps", "h2d_gbps", "k_copy_d2h", "k_copy_h2d", "k_gemm", "fc1_ms", "fc2_ms", "act_ms",
           "act_plain_ms", "act_bwd_ms", "act_bwd_plain_ms", "fc1_bwd_ms", "fc2_bwd_ms")


def _agreed_rates(ctx, copies: dict, times: dict) -> Rates:
    """Every rank plans from the same numbers: the slowest copies, the longest times, the largest k."""
    merged = copies | times
    slow = torch.tensor([-merged[k] if k.endswith("gbps") else merged[k] for k in _AGREED], dtype=torch.float64,
                        device=ctx.device)
    if dist.get_world_size(ctx.group) > 1:
        dist.all_reduce(slow, op=dist.ReduceOp.MAX, group=ctx.group)
    v = dict(zip(_AGREED, slow.tolist()))
    return Rates(d2h_gbps=-v["d2h_gbps"], h2d_gbps=-v["h2d_gbps"], k_copy=max(1.0, v["k_copy_d2h"], v["k_copy_h2d"]),
                 k_gemm=max(1.0, v["k_gemm"]), fc1_ms=v["fc1_ms"], fc2_ms=v["fc2_ms"], act_ms=v["act_ms"],
                 act_plain_ms=v["act_plain_ms"], act_bwd_ms=v["act_bwd_ms"], act_bwd_plain_ms=v["act_bwd_plain_ms"],
                 recompute_ms=v["act_ms"], fc1_bwd_ms=v["fc1_bwd_ms"],
                 fc2_bwd_ms=v["fc2_bwd_ms"])


def _measure(ctx, mlp, pool: HostPool, m: int, x: torch.Tensor) -> tuple[Rates, dict]:
    """This machine's numbers for the layer at M rows (temporaries freed on return)."""
    gathered = torch.randn(m, x.shape[1], device=ctx.device).to(x.dtype)  # the fc1 GEMM's operand
    w1 = mlp.fc1.weight.detach()
    out = torch.empty(m, w1.shape[1], dtype=x.dtype, device=ctx.device)
    copies = measure_copies(pool.slot("report.copy", COPY_BYTES).view((COPY_BYTES,), torch.uint8),
                            torch.empty(COPY_BYTES, dtype=torch.uint8, device=ctx.device),
                            lambda: torch.mm(gathered, w1, out=out))
    times = measure_layer_times(mlp, gathered)
    return _agreed_rates(ctx, copies, times), copies


def _drop_grads(mlp, x: torch.Tensor) -> None:
    x.grad = None
    mlp.zero_grad(set_to_none=True)


def _training_step(mlp, x: torch.Tensor, dy: torch.Tensor, opt, engine: OffloadEngine | None):
    """A callable: forward (through `engine` when given), backward and an SGD step of `mlp`."""
    def run():
        _drop_grads(mlp, x)
        y = engine.forward(0, mlp, x) if engine is not None else type(mlp).forward(mlp, x)
        y.backward(dy)
        opt.step()
    return run


def _whole_peak(ctx, run, mlp, x: torch.Tensor) -> tuple[int | None, int]:
    """(peak bytes of `run`, bytes at its start: weights, inputs, optimizer state); CPU: (None, 0)."""
    if ctx.device.type != "cuda":
        return None, 0
    above, before = peak_of(run, ctx.device, prepare=lambda: _drop_grads(mlp, x))
    return above + before, before


def _agreed_peaks(ctx, peak_off: int | None, peak_on: int | None) -> tuple:
    """Both peaks, max over ranks; (None, None) on CPU."""
    peaks = torch.tensor([float(peak_off or 0), float(peak_on or 0)], dtype=torch.float64, device=ctx.device)
    if dist.get_world_size(ctx.group) > 1:
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=ctx.group)
    return tuple(peaks.tolist()) if ctx.device.type == "cuda" else (None, None)


def _report_row(config: OffloadConfig, plan, rates: Rates, copies: dict, pool: HostPool, engine: OffloadEngine,
                stats: dict, peaks: tuple) -> dict:
    row = {"offload": repr(config), "offload_plan": [f"L{p}.{n}={d}" for p, n, d in plan.decisions],
           "offload_table": plan.table(), "offload_prefetch_depth": plan.prefetch_depth,
           "offload_d2h_gbps": rates.d2h_gbps, "offload_h2d_gbps": rates.h2d_gbps,
           "offload_k_copy": rates.k_copy, "offload_k_gemm": rates.k_gemm,
           "offload_measured_concurrency": copies["measured_concurrency"],
           "offload_host_pool": pool.stats().__dict__, "offload_engine": engine.stats()}
    for name, s in stats.items():
        row[f"t_step_{name}_ms"] = s.median_ms
        row[f"t_step_{name}_min_ms"], row[f"t_step_{name}_max_ms"] = s.min_ms, s.max_ms
    row["offload_time_ratio"] = stats["offload_on"].median_ms / stats["offload_off"].median_ms
    row["peak_offload_off_bytes"], row["peak_offload_on_bytes"] = peaks
    row["offload_peak_ratio"] = (row["peak_offload_on_bytes"] / row["peak_offload_off_bytes"]
                                 if row["peak_offload_off_bytes"] else None)
    row["offload_predicted_step_ms"], row["offload_predicted_peak_bytes"] = plan.step_ms, plan.peak_bytes
    return row


def offload_report(ctx, mlp, x: torch.Tensor, dy: torch.Tensor, config: OffloadConfig, *, warmup: int,
                   reps: int, k_factors=None, host_pool: HostPool | None = None) -> dict:
    """Row fields `offload_*` for one TPMLP `mlp` on x [M/W, H] with output grad dy [M/W, H]."""
    m = x.shape[0] * mlp.world_size
    own_pool = host_pool is None
    pool = HostPool(COPY_BYTES + (1 << 20), device=ctx.device) if own_pool else host_pool
    rates, copies = _measure(ctx, mlp, pool, m, x)
    opt = torch.optim.SGD(mlp.parameters(), lr=1e-4)
    plain = _training_step(mlp, x, dy, opt, None)
    plain_peak, fixed = _whole_peak(ctx, plain, mlp, x)
    # pacing staggers the ranks of one node: tp_mlp's TP group is one node, so rank = local rank
    placement = {"local_rank": ctx.rank, "local_world": ctx.world_size}
    plan = plan_for([mlp], config, rates, m=m, fixed_bytes=fixed, **placement)  # fixed: what exists at a step's start
    if own_pool:
        pool.close()
        pool = HostPool(host_bytes(plan), device=ctx.device)
    engine = OffloadEngine(plan, pool=pool, device=ctx.device, name="report")
    try:
        steps = {"offload_off": plain, "offload_on": _training_step(mlp, x, dy, opt, engine)}
        peaks = _agreed_peaks(ctx, plain_peak, _whole_peak(ctx, steps["offload_on"], mlp, x)[0])
        stats = bench_interleaved(steps, group=ctx.group, device=ctx.device, warmup=warmup, reps=reps)
        row = _report_row(config, plan, rates, copies, pool, engine, stats, peaks)
        if k_factors is not None:
            for name, run in steps.items():
                row |= {f"{key}_{name}": value for key, value in k_factors(run).items()}
        return row
    finally:
        engine.close()
        if own_pool:
            pool.close()
