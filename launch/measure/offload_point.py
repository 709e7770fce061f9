"""One point (model, layers, M) of launch.offload_bench: build the stack, measure this machine, plan every
variant, check the gradients, measure the peaks and time the steps. See launch/offload_bench.py."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tp_overlap.ipc.errors import OverlapError
from tp_overlap.offload.activation import activation_forward, fused_swiglu_available
from tp_overlap.offload.engine import OffloadEngine
from tp_overlap.offload.host_pool import HostPool
from tp_overlap.offload.planner import (MLPShape, OffloadPlanError, calibrate, pacing_offset, plan_offload, plan_sweep,
                                    simulate, tensor_bytes)
from tp_overlap.launch.measure.timing import bench_interleaved, progress

from .bench_mlp import BenchMLP
from .offload_measure import measure_copies, measure_heat, measure_layer_times, measure_ms, peak_of, rates_from

COPY_BYTES = 256 << 20
HAND = {"keep": {"x": "keep", "h": "keep", "a": "keep", "s": "keep"},
        "recompute": {"x": "keep", "h": "keep", "a": "recompute", "s": "keep"},
        "recompute_s": {"x": "keep", "h": "keep", "a": "keep", "s": "recompute"},
        "offload_all": {"x": "offload", "h": "offload", "a": "offload", "s": "keep"}}


class OutOfTime(OverlapError):
    """The point's timed steps would not end before the run's time budget."""


class _Stack:
    """The MLPs, data, optimizer and the step functions every variant runs."""

    def __init__(self, ctx, model, layers, m):
        dev = ctx.device
        gen = torch.Generator(dev).manual_seed(1234 + ctx.rank)
        torch.manual_seed(99 + ctx.rank)
        self.mlps = [BenchMLP(model["hidden"], model["ffn_hidden"], device=dev, dtype=torch.bfloat16)
                     for _ in range(layers)]
        self.x = torch.randn(m, model["hidden"], generator=gen, device=dev).to(torch.bfloat16)
        self.dy = torch.randn(m, model["hidden"], generator=gen, device=dev).to(torch.bfloat16)
        self.params = [p for mlp in self.mlps for p in mlp.parameters()]
        self.opt = torch.optim.SGD(self.params, lr=1e-6)
        self.grad_bytes = sum(p.numel() * p.element_size() for p in self.params)

    def drop_grads(self):
        self.opt.zero_grad(set_to_none=True)

    def hold_grads(self):
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def step(self, engine, *, with_opt=True, hold=False):
        """A training step; hold: the grads exist before it (accumulated into), as across micro-batches."""
        def run():
            if not hold:
                self.drop_grads()
            y = self.x
            for p, mlp in enumerate(self.mlps):
                y = engine.forward(p, mlp, y) if engine is not None else mlp(y)
            y.backward(self.dy)
            if with_opt:
                self.opt.step()
        return run


def _probes(stack, host: HostPool, shape: MLPShape) -> tuple[dict, dict]:
    """Copies (a backlog of the step's tensor sizes) and k beside fc1's GEMM, and the GPU's heat under that
    GEMM (its buffers freed on return)."""
    mlp = stack.mlps[0]
    x, w1 = stack.x, mlp.fc1.weight.detach()
    copy_host = host.slot("bench.copy", COPY_BYTES).view((COPY_BYTES,), torch.uint8)
    copy_dev = torch.empty(COPY_BYTES, dtype=torch.uint8, device=x.device)
    fc1_out = torch.empty(x.shape[0], w1.shape[1], dtype=x.dtype, device=x.device)
    fc1 = lambda: torch.mm(x, w1, out=fc1_out)  # noqa: E731
    sizes = [b for n, b in tensor_bytes(shape).items() if n != "s"]
    copies = measure_copies(copy_host, copy_dev, fc1, sizes=sizes)
    heat = measure_heat(fc1, lambda: activation_forward(fc1_out, mlp.activation), cuda=x.is_cuda)
    return copies, heat


def _machine(ctx, stack, host: HostPool, shape: MLPShape) -> tuple:
    """The probes, the layer's times, the optimizer step."""
    copies, heat = _probes(stack, host, shape)
    times = measure_layer_times(stack.mlps[0], stack.x)
    stack.step(None, with_opt=False)()   # the optimizer needs grads
    times["optimizer_ms"] = measure_ms(stack.opt.step, ctx.device)
    stack.drop_grads()
    return copies, heat, times, rates_from(copies, times, step_extra_ms=times["optimizer_ms"], heat=heat)


def _plans(shape, rates, args, fixed, none_peak, local, notes) -> dict:
    """The hand variants, the planner at every --budget (one search), and its staggered form."""
    plans = {v: plan_offload(shape, rates, forced=f, fixed_bytes=fixed, explain=False) for v, f in HAND.items()}
    asks = []
    for label, kind, value in args.budgets:
        if kind == "time":
            asks.append(("auto", value))
        else:
            asks.append((int(value * none_peak) if kind == "fraction" else value, 0.0))
    sweep = plan_sweep(shape, rates, asks, fixed_bytes=fixed, explain="first")
    for i, ((label, _, _), plan) in enumerate(zip(args.budgets, sweep)):
        name = "planner" if i == 0 else f"planner[{label}]"
        if isinstance(plan, OffloadPlanError):
            notes.append(f"{name}: {plan}")
        else:
            plans[name] = plan
    if "planner" not in plans:
        raise OffloadPlanError(f"the first --budget item ({args.budgets[0][0]}) has no plan: {notes[-1]}")
    for mode in [p for p in args.pacing.split(",") if p != "none"]:
        if local[1] > 1:  # one rank per node: nothing to stagger against
            first = plans["planner"]
            plans[f"planner_{mode}"] = plan_offload(
                shape, rates, budget_bytes=first.budget_bytes or "auto", max_added=first.max_added,
                fixed_bytes=fixed, pacing_offset=pacing_offset(mode, *local))
    return plans


def _max_over_ranks(ctx, values: list) -> list:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return [int(v) for v in t.tolist()]


def run_point(ctx, spec, args, host: HostPool, local, deadline) -> tuple[list[dict], dict]:
    name, model, layers, m = spec
    dev = ctx.device
    stack = _Stack(ctx, model, layers, m)
    host.reset_slots()
    shape = MLPShape(hidden=model["hidden"], ffn_hidden=model["ffn_hidden"], m=m, num_layers=layers,
                     fused_activation=fused_swiglu_available(dev, torch.bfloat16))
    copies, heat, times, rates = _machine(ctx, stack, host, shape)
    # pieces measured alone add up to more than the step they run in: scale the model's compute to the
    # measured plain step (the slowest rank's), copies keep their measured bandwidth
    none_us = _max_over_ranks(ctx, [1e3 * measure_ms(stack.step(None), dev, reps=5)])[0]
    stack.drop_grads()
    rates = calibrate(shape, rates, none_us / 1e3)
    # what exists when a step starts (weights, inputs; grads are dropped first) and the plain stack's peak
    none_above, fixed = peak_of(stack.step(None, with_opt=False), dev, prepare=stack.drop_grads)
    notes = []
    t0 = time.monotonic()
    plans = _plans(shape, rates, args, fixed, none_above + fixed, local, notes)
    planner_s = time.monotonic() - t0
    none_pred = simulate(shape, rates, {}, 1, fixed_bytes=fixed)
    point = {"model": name, "M": m, "layers": layers, "copies": dict(copies), "heat": heat, "layer_times_ms": times,
             "none_step_ms": none_us / 1e3, "compute_scale": rates.compute_scale,
             "fixed_bytes": fixed, "grad_bytes": stack.grad_bytes, "planner_s": planner_s, "notes": notes,
             "planner_table": plans["planner"].table(), "frontier": list(plans["planner"].frontier)}
    # refuse to start what would overrun the time budget: the timed phase cannot be cut short
    count = args.reps + args.warmup + 5
    seconds = (sum(p.step_ms for p in plans.values()) + 2 * none_pred.step_ms) * count * 1.3 / 1e3
    if _max_over_ranks(ctx, [1e3 * (seconds - (deadline - time.monotonic()))])[0] > 0:
        raise OutOfTime(f"~{seconds:.0f} s of steps (planned from measured layer times) do not fit the "
                        f"{max(0.0, deadline - time.monotonic()):.0f} s left")
    progress(f"{name} L={layers} M={m}: planner ({planner_s:.1f} s)\n{point['planner_table']}", rank=ctx.rank)
    engines = {v: OffloadEngine(plan, pool=host, device=dev, name="bench") for v, plan in plans.items()}
    try:
        return _measure_variants(ctx, stack, plans, engines, none_pred, point, args)
    finally:  # an error or a skip must not leave slots held for the next point
        for engine in engines.values():
            engine.close()


def _measure_variants(ctx, stack, plans, engines, none_pred, point, args):
    dev = ctx.device
    # correctness: every variant's gradients against none's, same weights, no optimizer step
    stack.step(None, with_opt=False)()
    ref = [p.grad.clone() for p in stack.params]
    bitwise = {"none": True, "none_again": True}
    for v, engine in engines.items():
        stack.step(engine, with_opt=False)()
        bitwise[v] = all(torch.equal(a, p.grad) for a, p in zip(ref, stack.params))
    del ref
    variants = ["none"] + list(engines)
    peak, act = {}, {}
    for v in variants:
        engine = engines.get(v)
        above, before = peak_of(stack.step(engine, with_opt=False), dev, prepare=stack.drop_grads)
        peak[v] = above + before
        act[v] = peak_of(stack.step(engine, with_opt=False, hold=True), dev, prepare=stack.hold_grads)[0]
    stack.drop_grads()
    measured = dict(zip(variants, _max_over_ranks(ctx, [peak[v] for v in variants])))
    measured_act = dict(zip(variants, _max_over_ranks(ctx, [act[v] for v in variants])))
    steps = {"none": stack.step(None), "none_again": stack.step(None)} | {v: stack.step(e) for v, e in engines.items()}
    label = f"{point['model']} L={point['layers']} M={point['M']}: "
    stats = bench_interleaved(steps, group=ctx.group, device=dev, warmup=args.warmup, reps=args.reps, label=label)
    rows = []
    for v in steps:
        plan, s = plans.get(v), stats[v]
        pred = plan if plan is not None else none_pred
        peak_v, act_v = measured[v.removesuffix("_again")], measured_act[v.removesuffix("_again")]
        engine_stats = engines[v].stats() if v in engines else {}
        rows.append({
            "model": point["model"], "M": point["M"], "layers": point["layers"], "variant": v,
            "peak_bytes": peak_v, "peak_gib": peak_v / 2**30, "pred_peak_bytes": pred.peak_bytes,
            "pred_peak_gib": pred.peak_bytes / 2**30, "peak_error": peak_v / pred.peak_bytes - 1,
            "act_peak_bytes": act_v, "act_gib": act_v / 2**30, "pred_act_peak_bytes": pred.act_peak_bytes,
            "pred_act_gib": pred.act_peak_bytes / 2**30, "act_error": act_v / pred.act_peak_bytes - 1,
            "fixed_bytes": point["fixed_bytes"] + point["grad_bytes"], "t_step_ms": s.median_ms,
            "t_step_min_ms": s.min_ms, "t_step_max_ms": s.max_ms, "spread": s.spread, "pred_step_ms": pred.step_ms,
            "time_error": s.median_ms / pred.step_ms - 1, "bitwise": bitwise[v],
            "budget": None if plan is None or not v.startswith("planner") else (plan.budget_bytes or
                                                                               f"+{plan.max_added:.1%}"),
            "decisions": None if plan is None else sorted({f"{n}={d}" for _, n, d in plan.decisions}),
            "per_layer": None if plan is None else [f"L{p}.{n}={d}" for p, n, d in plan.decisions if d != "keep"],
            "prefetch_depth": plan.prefetch_depth if plan else None, "engine": engine_stats,
            "demand_fetches": engine_stats.get("demand_fetches")})
    none = rows[0]
    for row in rows:
        row["time_vs_none"] = row["t_step_ms"] / none["t_step_ms"]
        row["peak_vs_none"] = row["peak_bytes"] / none["peak_bytes"] if none["peak_bytes"] else None
        row["act_vs_none"] = row["act_peak_bytes"] / none["act_peak_bytes"] if none["act_peak_bytes"] else None
    return rows, point
