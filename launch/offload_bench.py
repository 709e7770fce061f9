"""Activation offload on one GPU: peak memory and step time of keep / offload / recompute, and the planner.

    python -m launch.offload_bench [--models llama8b,llama70b] [--tokens 16384,65536] [--layers 4]
        [--reps 20] [--warmup 3] [--budget auto|<bytes>|<fraction>x] [--pacing none,stagger]
        [--time-budget-s 200] [--out FILE] [--cpu]

For every (model, M) that fits the device without offload and the time budget (cheapest first; what is
skipped is noted with the reason): a stack of `--layers` MLPs (launch/_bench_mlp.py: the saved tensors of
TPMLP at W = 1; bf16), its copy bandwidth each way into the pinned host pool and the copy's / GEMM's k
beside the step's fc1 GEMM, its layer times, the planner's table, then training steps (forward, backward,
SGD) of every variant, interleaved (launch.timing: CUDA events, median of --reps, spread):

    none         the plain stack (autograd's activation: also saves silu(gate))
    keep         the offload engine keeping everything (its activation saves only h)
    recompute    a recomputed from h in every layer, the rest kept
    offload_all  x, h and a offloaded in every layer
    planner      the planner's choice for --budget (auto: lowest peak within 1 % of the step)
    planner_stagger  (several local ranks under torchrun) the same with node-wide staggered copies

Per variant: peak device memory (max_memory_allocated after a reset, one step), step time, gradients
bitwise equal to `none` (checked once before the timed steps). Per point: D2H/H2D GB/s, k_copy, k_gemm,
the planner's prediction next to the measurement, and the targets (planner peak <= 0.70 x none, step <= 1.03
x none, copies >= 45 GB/s, planner within 2 % of the fastest hand variant that is as lean). The JSON
(device, commit, command, rows, points, notes) is rewritten after every point. The whole run stops
starting new points past --time-budget-s. Without --out the JSON goes into a new run folder,
runs/offload_bench-<UTC time>/offload_<gpu>.json (results of record: --out results/...). On CPU it is a
functional check (labelled so): the copies are host memcpys and the GEMMs torch.mm. Under torchrun with N local ranks every rank runs the same
stack on its own GPU (max over ranks), which is how node-wide pacing is measured.
"""

from __future__ import annotations

import argparse
import gc
import math
import socket
import sys
import time

import torch
import torch.distributed as dist

from overlap.config import MODELS
from overlap.offload_config import PACING
from overlap.host_pool import HostPool, OffloadError
from overlap.offload import OffloadEngine
from overlap.offload_plan import (MLPShape, OffloadPlanError, Rates, pacing_offset, plan_offload, simulate,
                                  tensor_bytes)
from launch.report import device_slug, format_table, run_labels, write_results
from launch.timing import bench_interleaved, progress

from . import _cli, _dist
from ._cli import ArgumentParser, distinct, int_list, output_file, run_dir, run_launcher
from ._limits import available_host_bytes
from ._bench_mlp import BenchMLP
from ._offload_measure import measure_copies, measure_layer_times, rates_from

PROG = "launch.offload_bench"
COPY_BYTES = 256 << 20
TARGETS = {"peak_vs_none": 0.70, "time_vs_none": 1.03, "copy_gbps": 45.0, "planner_vs_best": 1.02}
COLUMNS = ["run_kind", "model", "M", "variant", "peak_gib", "peak_vs_none", "t_step_ms", "spread", "time_vs_none",
           "pred_step_ms", "pred_peak_gib", "bitwise", "demand_fetches"]


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--models", default=None,
                   help=f"comma-separated names of {', '.join(MODELS)} (default: llama8b,llama70b on GPU; tiny on CPU)")
    p.add_argument("--tokens", type=int_list, default=None, metavar="M[,M...]",
                   help="M values (default: 16384,65536 on GPU; 256,512 on CPU)")
    p.add_argument("--layers", type=int, default=4,
                   help="MLPs in the stack (an offloaded copy hides behind the later layers)")
    p.add_argument("--reps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per variant")
    p.add_argument("--budget", default="auto", help="auto | bytes | a fraction of none's peak, e.g. 0.7x")
    p.add_argument("--pacing", default="none,stagger",
                   help=f"pacing modes of the planner variant, comma-separated of {', '.join(PACING)} (several ranks)")
    p.add_argument("--time-budget-s", type=float, default=200.0, help="no new point starts past this")
    p.add_argument("--host-gib", type=float, default=None, help="host pool cap (default: half of MemAvailable)")
    p.add_argument("--out", type=output_file, default=None,
                   help="results JSON (default: runs/offload_bench-<UTC time>/offload_<gpu>"
                   ".json; results of record only with an explicit --out results/...)")
    p.add_argument("--cpu", action="store_true", help="run on CPU even if GPUs are present")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = make_parser()
    args = p.parse_args(argv)
    if args.layers < 1 or args.reps < 1 or args.warmup < 0 or args.time_budget_s <= 0:
        p.error("--layers and --reps must be >= 1, --warmup >= 0, --time-budget-s > 0")
    models = args.models.split(",") if args.models else []
    unknown = [n for n in models if n not in MODELS]
    if unknown:
        p.error(f"--models: unknown model {', '.join(map(repr, unknown))}; known: {', '.join(MODELS)}")
    distinct("--models", models, "model")
    if any(m <= 0 for m in args.tokens or ()):
        p.error(f"--tokens must be > 0, got {','.join(map(str, args.tokens))}")
    distinct("--tokens", args.tokens or (), "M")
    try:
        _budget(args.budget, 1)
    except ValueError:
        p.error(f"--budget: got {args.budget!r}; allowed: auto, a number of bytes > 0 (e.g. 40000000000), or a "
                "fraction of none's peak > 0 with an x (e.g. 0.7x)")
    _cli.names("--pacing", args.pacing, PACING, "mode")
    if args.host_gib is not None and not args.host_gib > 0:
        p.error(f"--host-gib must be > 0, got {args.host_gib}")
    return args


def _local_ranks(ctx) -> tuple[int, int]:
    names = [None] * ctx.world_size
    dist.all_gather_object(names, socket.gethostname(), group=ctx.group)
    mine = [r for r, n in enumerate(names) if n == names[ctx.rank]]
    return mine.index(ctx.rank), len(mine)


def _shape(model, m, layers) -> MLPShape:
    return MLPShape(hidden=model["hidden"], ffn_hidden=model["ffn_hidden"], m=m, num_layers=layers)


def _estimate(model, m, args, cuda) -> dict:
    """Nominal cost of a point before building it: step time, device and host bytes."""
    shape = _shape(model, m, args.layers)
    nominal = Rates(d2h_gbps=55, h2d_gbps=55, gemm_tflops=700 if cuda else 0.05, hbm_gbps=3000 if cuda else 10)
    keep = simulate(shape, nominal, {}, 1)
    variants_ms = keep.step_ms * 1.05 + sum(  # none ~ keep; the engine variants as the model predicts them
        plan_offload(shape, nominal, forced=f).step_ms for f in (
            {"x": "keep", "h": "keep", "a": "keep"}, {"a": "recompute"},
            {"x": "offload", "h": "offload", "a": "offload"})) + plan_offload(shape, nominal).step_ms
    b = tensor_bytes(shape)
    width = b["h"] // (m * 2)
    weight_bytes = args.layers * (model["hidden"] * width + model["ffn_hidden"] * model["hidden"]) * 2
    # weights and grads, keep-all's activations plus the plain stack's extra silu(gate) per layer, x and
    # dy, the copy buffer and L2 flush, the measurements' fc1 output
    device = 2 * weight_bytes + keep.peak_bytes + args.layers * b["a"] + 2 * b["x"] + 2 * COPY_BYTES + b["h"]
    steps = args.reps + args.warmup + 3   # per variant: timed, warm-up, peak (2), check
    seconds = steps * variants_ms * 1.15 / 1e3 + (8 if cuda else 1)  # + building, measuring
    host = args.layers * (sum(b.values()) + 3 * 4096) + COPY_BYTES
    return {"seconds": seconds, "device_bytes": device, "host_bytes": host}


def _budget(text: str, none_peak: int):
    """--budget as the planner takes it: "auto", or bytes (ValueError unless a positive number)."""
    if text == "auto":
        return "auto"
    value = float(text[:-1]) * none_peak if text.endswith("x") else int(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"budget {text!r} is not > 0")
    return int(value)


def _measure_copies(host: HostPool, mlp, x: torch.Tensor) -> dict:
    """Copy bandwidth and k beside the layer's fc1 GEMM (its buffers are freed on return)."""
    copy_host = host.slot("bench.copy", COPY_BYTES).view((COPY_BYTES,), torch.uint8)
    copy_dev = torch.empty(COPY_BYTES, dtype=torch.uint8, device=x.device)
    w1 = mlp.fc1.weight.detach()
    fc1_out = torch.empty(x.shape[0], w1.shape[1], dtype=x.dtype, device=x.device)
    return measure_copies(copy_host, copy_dev, lambda: torch.mm(x, w1, out=fc1_out))


class _OutOfTime(Exception):
    pass


def run_point(ctx, name, model, m, args, host, local, deadline) -> tuple[list[dict], dict]:
    cuda, dev = ctx.device.type == "cuda", ctx.device
    gen = torch.Generator(dev).manual_seed(1234 + ctx.rank)
    torch.manual_seed(99 + ctx.rank)
    mlps = [BenchMLP(model["hidden"], model["ffn_hidden"], device=dev, dtype=torch.bfloat16)
            for _ in range(args.layers)]
    x = torch.randn(m, model["hidden"], generator=gen, device=dev).to(torch.bfloat16)
    dy = torch.randn(m, model["hidden"], generator=gen, device=dev).to(torch.bfloat16)
    params = [p for mlp in mlps for p in mlp.parameters()]
    opt = torch.optim.SGD(params, lr=1e-6)
    point = {"model": name, "M": m, "layers": args.layers}
    # ----- measured numbers
    host.reset_slots()
    copies = _measure_copies(host, mlps[0], x)
    times = measure_layer_times(mlps[0], x)
    rates = rates_from(copies, times)
    point |= {"copies": dict(copies), "layer_times_ms": times}
    shape = _shape(model, m, args.layers)

    def step_fn(engine, with_opt=True):
        def step():
            opt.zero_grad(set_to_none=True)
            y = x
            for p, mlp in enumerate(mlps):
                y = engine.forward(p, mlp, y) if engine is not None else mlp(y)
            y.backward(dy)
            if with_opt:
                opt.step()
        return step

    def peak_of(step) -> tuple:
        if not cuda:
            step()
            return None, None
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    # ----- plans: by hand, then the planner calibrated on the measured keep-all peak
    forced = {"keep": {"x": "keep", "h": "keep", "a": "keep"}, "recompute": {"a": "recompute"},
              "offload_all": {"x": "offload", "h": "offload", "a": "offload"}}
    plans = {v: plan_offload(shape, rates, forced=f) for v, f in forced.items()}
    engines = {}
    try:
        for v, plan in plans.items():
            engines[v] = OffloadEngine(plan, pool=host, device=dev, name="bench")
        peaks = {"none": peak_of(step_fn(None, with_opt=False)),
                 "keep": peak_of(step_fn(engines["keep"], with_opt=False))}
        fixed = (peaks["keep"][0] - simulate(shape, rates, {}, 1).peak_bytes) if cuda else 0
        budget = _budget(args.budget, peaks["none"][0] or 0)
        point |= {"fixed_bytes": fixed, "budget": budget}
        # the hand plans were planned before the calibration: add it to their prediction
        pred_peak = {v: plan.peak_bytes + fixed for v, plan in plans.items()}
        for mode in ["none"] + [p for p in args.pacing.split(",") if p != "none"]:
            offset = pacing_offset(mode, *local)
            if mode != "none" and local[1] == 1:
                continue  # one rank per node: nothing to stagger against
            v = "planner" if mode == "none" else f"planner_{mode}"
            plans[v] = plan_offload(shape, rates, budget_bytes=budget, fixed_bytes=fixed, pacing_offset=offset)
            pred_peak[v] = plans[v].peak_bytes
            engines[v] = OffloadEngine(plans[v], pool=host, device=dev, name="bench")
        # the measured layer times give a better estimate than the nominal one: refuse to start what would
        # overrun the time budget (the timed phase cannot be cut short once it started)
        predicted = sum(plan.step_ms for plan in plans.values()) + plans["keep"].step_ms * 1.3  # + none
        seconds = predicted * (args.reps + args.warmup + 3) * 1.3 / 1e3
        verdict = torch.tensor([seconds - (deadline - time.monotonic())], dtype=torch.float64, device=dev)
        if ctx.world_size > 1:  # every rank takes the same decision, or the others would wait at a barrier
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=ctx.group)
        if verdict.item() > 0:
            raise _OutOfTime(f"~{seconds:.0f} s of timed steps (measured layer times) do not fit the "
                             f"{max(0.0, deadline - time.monotonic()):.0f} s left")
        point["planner_table"] = plans["planner"].table()
        progress(f"{name} M={m}: planner\n{point['planner_table']}", rank=ctx.rank)
        # ----- correctness: every variant's gradients against none's, same weights, no optimizer step
        step_fn(None, with_opt=False)()
        ref = [p.grad.clone() for p in params]
        bitwise = {"none": True}
        for v, engine in engines.items():
            step_fn(engine, with_opt=False)()
            bitwise[v] = all(torch.equal(a, p.grad) for a, p in zip(ref, params))
        del ref
        for v, engine in engines.items():
            if v not in peaks:
                peaks[v] = peak_of(step_fn(engine, with_opt=False))
        # ----- timing, interleaved
        steps = {"none": step_fn(None)} | {v: step_fn(e) for v, e in engines.items()}
        stats = bench_interleaved(steps, group=ctx.group, device=dev, warmup=args.warmup, reps=args.reps)
        peak_t = torch.tensor([float(peaks[v][0] or 0) for v in steps], dtype=torch.float64, device=dev)
        if ctx.world_size > 1:
            dist.all_reduce(peak_t, op=dist.ReduceOp.MAX, group=ctx.group)
        rows = []
        for i, v in enumerate(steps):
            s, plan = stats[v], plans.get(v)
            peak = peak_t[i].item() if cuda else None
            engine_stats = engines[v].stats() if v in engines else {}
            rows.append({
                "model": name, "M": m, "layers": args.layers, "variant": v,
                "peak_bytes": peak, "peak_gib": peak / 2**30 if peak else None,
                "peak_reserved_bytes": peaks[v][1], "t_step_ms": s.median_ms, "t_step_min_ms": s.min_ms,
                "t_step_max_ms": s.max_ms, "spread": s.spread, "bitwise": bitwise[v],
                "pred_step_ms": plan.step_ms if plan else None,
                "pred_peak_gib": pred_peak[v] / 2**30 if plan and cuda else None,
                "decisions": None if plan is None else sorted({f"{n}={d}" for _, n, d in plan.decisions}),
                "per_layer": None if plan is None else [f"L{p}.{n}={d}" for p, n, d in plan.decisions if d != "keep"],
                "prefetch_depth": plan.prefetch_depth if plan else None, "engine": engine_stats,
                "demand_fetches": engine_stats.get("demand_fetches"),
            })
        none = rows[0]
        for row in rows:
            row["time_vs_none"] = row["t_step_ms"] / none["t_step_ms"]
            row["peak_vs_none"] = row["peak_bytes"] / none["peak_bytes"] if cuda and none["peak_bytes"] else None
        point |= _targets(rows, copies, cuda)
        return rows, point


    finally:  # an error or a skip must not leave slots held for the next point
        for engine in engines.values():
            engine.close()

def _targets(rows, copies, cuda) -> dict:
    by = {r["variant"]: r for r in rows}
    planner, hand = by["planner"], [by[v] for v in ("keep", "recompute", "offload_all")]
    lean = [r for r in hand if cuda and r["peak_bytes"] <= planner["peak_bytes"] * 1.02] if cuda else hand
    best = min(lean, key=lambda r: r["t_step_ms"]) if lean else None
    out = {"planner_vs_best": planner["t_step_ms"] / best["t_step_ms"] if best else None,
           "best_hand_variant": best["variant"] if best else None,
           "planner_vs_fastest_hand": planner["t_step_ms"] / min(r["t_step_ms"] for r in hand)}
    out["targets"] = {
        "peak_vs_none": (planner["peak_vs_none"], TARGETS["peak_vs_none"],
                         planner["peak_vs_none"] is not None and planner["peak_vs_none"] <= TARGETS["peak_vs_none"]),
        "time_vs_none": (planner["time_vs_none"], TARGETS["time_vs_none"],
                         planner["time_vs_none"] <= TARGETS["time_vs_none"]),
        "copy_gbps": (min(copies["d2h_gbps"], copies["h2d_gbps"]), TARGETS["copy_gbps"],
                      min(copies["d2h_gbps"], copies["h2d_gbps"]) >= TARGETS["copy_gbps"]),
        "planner_vs_best": (out["planner_vs_best"], TARGETS["planner_vs_best"],
                            out["planner_vs_best"] is not None
                            and out["planner_vs_best"] <= TARGETS["planner_vs_best"]),
    }
    return out


def _run(args) -> int:
    start = time.monotonic()
    where = _dist.placement(force_cpu=args.cpu)
    labels = run_labels(where.device.type, 2)  # one GPU per rank by design: only the CPU note applies
    for line in labels.header:
        progress(line, rank=where.rank)
    with _dist.job(PROG, min_ranks=1, where=where) as ctx:
        cuda = ctx.device.type == "cuda"
        names = (args.models or ("llama8b,llama70b" if cuda else "tiny")).split(",")
        tokens = list(args.tokens or ((16384, 65536) if cuda else (256, 512)))
        local = _local_ranks(ctx)
        notes, chosen, spent = [], [], 0.0
        points = sorted(((_estimate(MODELS[n], m, args, cuda), n, m) for n in names for m in tokens),
                        key=lambda p: p[0]["seconds"])
        free = torch.cuda.mem_get_info(ctx.device)[0] if cuda else None
        for est, n, m in points:
            if cuda and est["device_bytes"] > 0.9 * free:
                notes.append(f"{n} M={m}: skipped, needs ~{est['device_bytes'] / 2**30:.1f} GiB without offload, "
                             f"{free / 2**30:.1f} GiB free")
            elif spent + est["seconds"] > args.time_budget_s * 0.9:
                notes.append(f"{n} M={m}: skipped, ~{est['seconds']:.0f} s does not fit the time budget")
            else:
                chosen.append((est, n, m))
                spent += est["seconds"]
        cap = int((args.host_gib * 2**30) if args.host_gib else available_host_bytes() // 2)
        need = max([e["host_bytes"] for e, _, _ in chosen], default=COPY_BYTES)
        host = HostPool(min(need, cap), device=ctx.device)
        pool_stats = host.stats()
        progress(f"offload_bench: {len(chosen)} point(s); host pool {pool_stats.bytes_total / 2**30:.2f} GiB "
                 f"pinned={pool_stats.pinned} NUMA node {pool_stats.numa_node} ({pool_stats.numa_source}; "
                 f"{pool_stats.placement}; pages on {pool_stats.page_nodes}); {time.monotonic() - start:.1f} s",
                 rank=ctx.rank)
        out = (args.out or run_dir("offload_bench") / f"offload_{device_slug(ctx.device_name)}.json") \
            if ctx.rank == 0 else None  # rank 0 writes
        rows, done = [], []
        extra = {"op": "offload_bench", "run_kind": labels.kind, "run_notes": labels.header,
                 "layers": args.layers, "reps": args.reps, "warmup": args.warmup,
                 "local_ranks": local[1], "host_pool": pool_stats.__dict__, "targets": TARGETS}
        try:
            for est, n, m in chosen:
                left = args.time_budget_s - (time.monotonic() - start)
                if est["seconds"] > left:
                    notes.append(f"{n} M={m}: skipped, {left:.0f} s left of the time budget, "
                                 f"~{est['seconds']:.0f} s needed")
                    continue
                try:
                    point_rows, point = run_point(ctx, n, MODELS[n], m, args, host, local,
                                                  start + args.time_budget_s)
                    rows += point_rows
                    done.append(point)
                except (torch.cuda.OutOfMemoryError, OffloadError, OffloadPlanError, _OutOfTime) as exc:
                    notes.append(f"{n} M={m}: skipped, {type(exc).__name__}: {str(exc)[:300]}")
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                if ctx.rank == 0:  # written as it goes: a run cut short keeps what it measured
                    write_results(out, rows, device=ctx.device_name, tp=1,
                                  extra=extra | {"points": done, "notes": notes})
                progress(f"{n} M={m} done at {time.monotonic() - start:.0f} s", rank=ctx.rank)
        finally:
            host.close()
        if ctx.rank == 0:
            write_results(out, rows, device=ctx.device_name, tp=1, extra=extra | {"points": done, "notes": notes})
            for line in labels.header:
                print(line)
            print(format_table([{"run_kind": labels.kind} | r for r in rows], COLUMNS))
            for point in done:
                print(f"\n{point['model']} M={point['M']}: copies D2H {point['copies']['d2h_gbps']:.1f} GB/s, H2D "
                      f"{point['copies']['h2d_gbps']:.1f} GB/s, k_copy {point['copies']['k_copy_d2h']:.3f}/"
                      f"{point['copies']['k_copy_h2d']:.3f}, k_gemm {point['copies']['k_gemm']:.3f}; planner vs best "
                      f"hand variant as lean: {point['planner_vs_best']}")
                print(point["planner_table"])
                for key, (value, target, met) in point["targets"].items():
                    print(f"  target {key}: {value if value is None else round(value, 4)} (target {target}) "
                          f"{'met' if met else 'NOT met'}")
            for note in notes:
                print(f"note: {note}")
            print(f"wrote {out} in {time.monotonic() - start:.0f} s")
        return 0


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
