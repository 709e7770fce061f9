"""k of the two AllGather+GEMM ops inside the main job's training step (launch.tp_mlp): each op's traced
spans inside a step (CUDA streams; CPU: the host clock of the caller and of the comm thread) over its gather
alone and its GEMM alone, through the one k definition (`KFactor.from_times`, launch/measure/k_factor.py)."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from tp_overlap.launch.measure.k_factor import KFactor
from tp_overlap.launch.measure.timing import Ticker, barrier, bench_interleaved, progress

TRACE_STEPS = 5


def max_over_ranks(values: list[float], ctx) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t.tolist()


def step_k_factors(ctx, mlp, x, dy, step, warmup: int, reps: int, label: str = "") -> dict:
    """k_comm / k_comp of the two AllGather+GEMM ops (fc1 forward, fc2 backward) inside training steps: the
    op.s traced spans (comm stream or thread; the whole call) over its gather alone and its compute alone."""
    keys = ("fc1_fwd_ag", "fc2_bwd_ag")
    ops = {"fc1_fwd_ag": mlp.fc1.ops.ag, "fc2_bwd_ag": mlp.fc2.ops.ag}
    shards = {"fc1_fwd_ag": x.detach(), "fc2_bwd_ag": dy}
    weights = {"fc1_fwd_ag": mlp.fc1.weight.detach(), "fc2_bwd_ag": mlp.fc2.weight.detach().t()}  # as backward passes it
    variants = {}
    for key, op in ops.items():
        op.all_gather(shards[key])  # compute_alone reads the rows the gather left in the pool
        if ctx.device.type == "cuda":  # CPU: the comm thread's span, below
            variants[f"comm_{key}"] = lambda op=op, s=shards[key]: op.all_gather(s)
        variants[f"gemm_{key}"] = lambda op=op, s=shards[key], w=weights[key]: op.compute_alone(s, w)
    progress(f"{label}k: each AllGather and GEMM alone", rank=ctx.rank)
    solo = {name: st.median_ms for name, st in
            bench_interleaved(variants, group=ctx.group, device=ctx.device, warmup=warmup, reps=reps,
                              label=f"{label}k: ").items()}
    spans = {key: ([], []) for key in keys}
    for op in ops.values():
        op.enable_trace(True)
    if ctx.device.type != "cuda":
        solo |= _host_comm_solo(ctx, ops, shards, reps)
    tick = Ticker(f"{label}k: ")
    for i in range(TRACE_STEPS):
        tick("traced training step", i, TRACE_STEPS, "overlap")
        barrier(ctx.group, ctx.device)
        step()
        for key, op in ops.items():
            trace = op.last_trace_ms()
            spans[key][0].append(trace["comm_ms"])
            spans[key][1].append(trace["compute_ms"])
    for op in ops.values():
        op.enable_trace(False)
    medians = max_over_ranks([statistics.median(v) for key in keys for v in spans[key]], ctx)
    out = {}
    for i, key in enumerate(keys):  # the one k definition (launch/measure/k_factor.py)
        kf = KFactor.from_times(t_comm_solo=solo[f"comm_{key}"], t_comp_solo=solo[f"gemm_{key}"],
                                t_comm_overlap=medians[2 * i], t_comp_overlap=medians[2 * i + 1],
                                t_total=medians[2 * i + 1])
        out[f"k_comm_{key}"], out[f"k_comp_{key}"] = kf.k_comm, kf.k_comp
    return out


def _host_comm_solo(ctx, ops: dict, shards: dict, reps: int) -> dict[str, float]:
    """CPU: each op's gather alone as the comm thread's traced span (median, max over ranks), the span that
    the step is traced with; the whole call's host time would add starting and joining the thread."""
    spans = {key: [] for key in ops}
    for _ in range(reps):
        for key, op in ops.items():
            barrier(ctx.group, ctx.device)
            op.all_gather(shards[key])
            spans[key].append(op.last_trace_ms()["comm_ms"])
    medians = max_over_ranks([statistics.median(spans[key]) for key in ops], ctx)
    return {f"comm_{key}": ms for key, ms in zip(ops, medians)}
