"""Activation offload on one GPU: peak memory and step time of keep / offload / recompute, and the planner
with its budget sweep (the Pareto curve of peak memory against step time).

    python -m tp_overlap.launch.offload_bench [--points llama8b:16:4096,llama70b:8:4096] [--models llama8b]
        [--layers 16] [--tokens 4096] [--reps 12] [--warmup 2] [--budget auto,+0%,+1%,+5%]
        [--pacing none,stagger] [--time-budget-s 300] [--out FILE] [--cpu] [--host-gib G]

For every point (model:layers:M; without --points every model x --layers x --tokens), cheapest first, that
fits the device and the time budget (what is skipped is noted with the reason): a stack of MLPs
(launch/measure/bench_mlp.py: TPMLP's saved tensors at W = 1; bf16), the copy bandwidth each way into the pinned
host pool and the k of the copy and of the GEMM beside the step's fc1 GEMM, the layer's measured times and
the optimizer step's, the plain step's (the step model's compute times are scaled to it: pieces measured
alone add up to more than the step), the planner's table, then training steps (forward, backward, SGD) of
every variant, interleaved (launch.measure.timing: CUDA events, median of --reps, spread):

    none         the plain stack (autograd's activation, which also saves silu(gate))
    none_again   the same, timed again: the noise floor of the time columns
    keep         the engine keeping everything: the plain stack's ops (no hook, autograd's activation)
    recompute    a recomputed from h in every layer, x and h kept
    recompute_s  nothing moved; every layer runs the engine's activation, which saves h only and recomputes
                 silu(gate) in backward (one kernel each way on CUDA): what the activation alone saves
    offload_all  x, h and a offloaded in every layer
    planner      the planner at each --budget: auto (its default time budget, +2 % of the step), +N% (a
                 time budget), <f>x (a memory budget: that fraction of none's measured peak), or bytes
    planner_stagger  (several local ranks under torchrun) the auto plan with node-wide staggered copies

Per variant: the step's peak device memory (weight grads allocated by backward, torch's default), the
activation bytes at their peak (a step with the grads held: its peak minus everything that existed before
it, i.e. weights, grads, inputs, optimizer state), both next to the prediction of the planner's step model
(none too, as the plain stack), the fixed bytes (what exists at the step's start, plus all grads), the step
time measured and predicted, gradients bitwise equal to `none`. Per point: D2H/H2D GB/s, k, the planner's
table and predicted front, and the targets (TARGETS). The JSON (device, commit, command, rows, points,
notes) and the plot (launch/output/offload_plot.py, next to it) are rewritten after every point; no new point
starts past --time-budget-s. Without --out the JSON goes into runs/offload_bench-<UTC time>/. On CPU it is a
functional check (labelled so): copies are memcpys, GEMMs torch.mm, peaks counted by LiveBytes.
"""

from __future__ import annotations

import argparse
import gc
import re
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tp_overlap.config.schema import MODELS
from tp_overlap.config.offload import DEFAULT_MAX_ADDED, PACING
from tp_overlap.offload.host_pool import HostPool, OffloadError
from tp_overlap.offload.planner import MLPShape, OffloadPlanError, Rates, simulate, tensor_bytes
from tp_overlap.launch.output.report import device_slug, format_table, run_labels, write_results
from tp_overlap.launch.measure.timing import progress

from .cli import common as _cli, dist as _dist
from .cli.common import ArgumentParser, distinct, output_file, run_dir, run_launcher
from .cli.limits import available_host_bytes
from .measure.offload_point import OutOfTime, run_point

PROG = "tp_overlap.launch.offload_bench"
COPY_BYTES = 256 << 20
GPU_POINTS = "llama8b:16:4096,llama8b:32:4096,llama70b:8:4096,llama8b:32:8192"
TARGETS = {"act_vs_none": 0.60, "peak_vs_none": 0.85, "time_vs_none": 1.03, "keep_vs_none": 1.005,
           "copy_gbps": 45.0, "peak_error": 0.05, "time_error": 0.03}
COLUMNS = ["run_kind", "model", "layers", "M", "variant", "peak_gib", "pred_peak_gib", "act_gib", "pred_act_gib",
           "peak_vs_none", "act_vs_none", "t_step_ms", "pred_step_ms", "spread", "time_vs_none", "bitwise",
           "demand_fetches"]
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def budget_item(text: str):
    """One --budget item as (label, kind, value): ("auto", "time", default), ("+N%", "time", N/100),
    ("<f>x", "fraction", f) of none's measured peak, or ("<bytes>", "bytes", int)."""
    text = text.strip()
    if text == "auto":
        return "auto", "time", DEFAULT_MAX_ADDED
    if m := re.fullmatch(r"\+?([0-9]+(?:\.[0-9]+)?)%", text):
        return text if text.startswith("+") else "+" + text, "time", float(m.group(1)) / 100
    if m := re.fullmatch(r"([0-9]*\.?[0-9]+)x", text):
        return text, "fraction", float(m.group(1))
    if m := re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)", text):
        unit = m.group(2).lower() or "b"
        if unit in _UNITS:
            return text, "bytes", int(float(m.group(1)) * _UNITS[unit])
    raise ValueError(f"--budget item {text!r}; allowed: auto, +N% (time budget), <f>x (fraction of none's "
                     "peak), bytes (an int or a number with a unit such as 40GiB)")


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--points", default=None, metavar="MODEL:LAYERS:M[,...]",
                   help=f"points to run (default on GPU without --models/--layers/--tokens: {GPU_POINTS})")
    p.add_argument("--models", default=None, help=f"comma-separated names of {', '.join(MODELS)} (default: "
                   "llama8b on GPU, tiny on CPU); with --layers and --tokens when --points is not given")
    p.add_argument("--tokens", default=None, metavar="M[,M...]", help="M values (default 4096 on GPU; 256 on CPU)")
    p.add_argument("--layers", default=None, metavar="L[,L...]", help="MLPs in the stack (default 16; 4 on CPU)")
    p.add_argument("--reps", type=int, default=12, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per variant")
    p.add_argument("--budget", default="auto,+0%,+1%,+5%",
                   help="the planner's budgets, comma-separated: auto | +N%% | <f>x | bytes (see above)")
    p.add_argument("--pacing", default="none,stagger",
                   help=f"pacing modes of the planner variant, comma-separated of {', '.join(PACING)} (several ranks)")
    p.add_argument("--time-budget-s", type=float, default=300.0, help="no new point starts past this")
    p.add_argument("--host-gib", type=float, default=None, help="host pool cap (default: half of MemAvailable)")
    p.add_argument("--out", type=output_file, default=None,
                   help="results JSON (default: runs/offload_bench-<UTC time>/offload_<gpu>"
                   ".json; results of record only with an explicit --out results/...); the plot goes next to it")
    p.add_argument("--cpu", action="store_true", help="run on CPU even if GPUs are present")
    return p


def _ints(p, name, text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        p.error(f"--{name}: {text!r} is not a comma list of integers")
    if any(v <= 0 for v in values):
        p.error(f"--{name} must be > 0, got {text}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = make_parser()
    args = p.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.time_budget_s <= 0:
        p.error("--reps must be >= 1, --warmup >= 0, --time-budget-s > 0")
    try:
        args.budgets = [budget_item(item) for item in args.budget.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    if len({label for label, _, _ in args.budgets}) != len(args.budgets):
        p.error(f"--budget {args.budget!r} lists a budget twice")
    names = args.models.split(",") if args.models else []
    if args.points:
        items = [item.split(":") for item in args.points.split(",")]
        if any(len(item) != 3 for item in items):
            p.error(f"--points {args.points!r}; allowed: comma-separated MODEL:LAYERS:M")
        names += [item[0] for item in items]
        args.point_list = [(name, *_ints(p, "points", f"{layers},{m}")) for name, layers, m in items]
    else:
        args.point_list = None
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        flag = "--models" if set(unknown) & set(args.models.split(",") if args.models else ()) else "--points"
        p.error(f"{flag}: unknown model {', '.join(map(repr, unknown))}; known: {', '.join(MODELS)}")
    distinct("--models", args.models.split(",") if args.models else [], "model")
    if args.point_list:
        distinct("--points", [":".join(map(str, point)) for point in args.point_list], "point")
    args.layer_list = _ints(p, "layers", args.layers) if args.layers else None
    args.token_list = _ints(p, "tokens", args.tokens) if args.tokens else None
    distinct("--tokens", args.token_list or (), "M")
    distinct("--layers", args.layer_list or (), "layer count")
    _cli.names("--pacing", args.pacing, PACING, "mode")
    if args.host_gib is not None and not args.host_gib > 0:
        p.error(f"--host-gib must be > 0, got {args.host_gib}")
    return args


def _points(args, cuda) -> list[tuple[str, int, int]]:
    if args.point_list:
        return args.point_list
    if cuda and not (args.models or args.layer_list or args.token_list):
        return [(n, int(layers), int(m)) for n, layers, m in (item.split(":") for item in GPU_POINTS.split(","))]
    names = args.models.split(",") if args.models else ["llama8b" if cuda else "tiny"]
    layers = args.layer_list or ([16] if cuda else [4])
    tokens = args.token_list or ([4096] if cuda else [256])
    return [(n, L, m) for n in names for L in layers for m in tokens]


def _local_ranks(ctx) -> tuple[int, int]:
    names = [None] * ctx.world_size
    dist.all_gather_object(names, socket.gethostname(), group=ctx.group)
    mine = [r for r, n in enumerate(names) if n == names[ctx.rank]]
    return mine.index(ctx.rank), len(mine)


def _estimate(model, m, layers, args, cuda) -> dict:
    """Nominal cost of a point before building it: seconds, device and host bytes."""
    shape = MLPShape(hidden=model["hidden"], ffn_hidden=model["ffn_hidden"], m=m, num_layers=layers,
                     fused_activation=cuda)
    nominal = Rates(d2h_gbps=54, h2d_gbps=54, gemm_tflops=650 if cuda else 0.05, hbm_gbps=3000 if cuda else 10)
    keep = simulate(shape, nominal, {}, 1).step_ms
    everything = {(p, n): "offload" for p in range(layers) for n in ("x", "h", "a")}
    offload_all = simulate(shape, nominal, everything, 2).step_ms
    variants_ms = (5 + len(args.budgets)) * keep * 1.05 + offload_all  # none twice, keep, recomputes, planners
    b = tensor_bytes(shape)
    weights = layers * (model["hidden"] * b["h"] // (m * 2) + model["ffn_hidden"] * model["hidden"]) * 2
    plain = simulate(shape, nominal, {}, 1).peak_bytes
    device = weights + plain + 2 * b["x"] + 2 * COPY_BYTES + 2 * b["h"]
    steps = args.reps + args.warmup + 5   # per variant: timed, warm-up, two peaks (two steps each), the check
    seconds = steps * variants_ms * 1.15 / 1e3 + (10 if cuda else 2) + 0.05 * layers  # + building, measuring
    host = layers * (sum(b.values()) + 3 * 4096) + COPY_BYTES
    return {"seconds": seconds, "device_bytes": device, "host_bytes": host}


def _targets(rows, point) -> dict:
    """Per target: (value, target, met)."""
    by = {r["variant"]: r for r in rows}
    planner, none = by["planner"], by["none"]
    engines = [r for r in rows if r.get("pred_step_ms") is not None and r["variant"] != "none"]
    peak_err = max((abs(r["peak_error"]) for r in engines if r["peak_error"] is not None), default=None)
    time_err = max(abs(r["time_error"]) for r in engines) if engines else None
    copy = min(point["copies"]["d2h_gbps"], point["copies"]["h2d_gbps"])

    def at_most(value, key):
        return value, TARGETS[key], value is not None and value <= TARGETS[key]

    return {"act_vs_none": at_most(planner["act_vs_none"], "act_vs_none"),
            "peak_vs_none": at_most(planner["peak_vs_none"], "peak_vs_none"),
            "time_vs_none": at_most(planner["time_vs_none"], "time_vs_none"),
            "keep_vs_none": at_most(by["keep"]["t_step_ms"] / none["t_step_ms"], "keep_vs_none"),
            "peak_error": at_most(peak_err, "peak_error"), "time_error": at_most(time_err, "time_error"),
            "copy_gbps": (copy, TARGETS["copy_gbps"], copy >= TARGETS["copy_gbps"])}


def _choose(points, args, cuda, ctx, notes) -> list:
    chosen, spent = [], 0.0
    estimated = sorted(((_estimate(MODELS[n], m, layers, args, cuda), n, layers, m) for n, layers, m in points),
                       key=lambda p: p[0]["seconds"])
    free = torch.cuda.mem_get_info(ctx.device)[0] if cuda else None
    for est, n, layers, m in estimated:
        name = f"{n} L={layers} M={m}"
        if cuda and est["device_bytes"] > 0.9 * free:
            notes.append(f"{name}: skipped, needs ~{est['device_bytes'] / 2**30:.1f} GiB without offload, "
                         f"{free / 2**30:.1f} GiB free")
        elif spent + est["seconds"] > args.time_budget_s * 0.95:
            notes.append(f"{name}: skipped, ~{est['seconds']:.0f} s does not fit the time budget "
                         f"({args.time_budget_s:.0f} s, {spent:.0f} s planned before it)")
        else:
            chosen.append((est, n, layers, m))
            spent += est["seconds"]
    return chosen


def _brief(r) -> str:
    """One line per variant (the GPU script greps "= "): measured (predicted, error), ratios to none."""
    g = 2**30
    return (f"= {r['model']} L={r['layers']} M={r['M']} {r['variant']}: peak {r['peak_bytes'] / g:.2f} GiB "
            f"(pred {r['pred_peak_bytes'] / g:.2f}, {r['peak_error']:+.1%}), act {r['act_peak_bytes'] / g:.2f} GiB "
            f"(pred {r['pred_act_peak_bytes'] / g:.2f}, {r['act_error']:+.1%}), fixed {r['fixed_bytes'] / g:.2f} GiB, "
            f"step {r['t_step_ms']:.1f} ms (pred {r['pred_step_ms']:.1f}, {r['time_error']:+.1%}, spread "
            f"{r['spread']:.3f}); vs none: peak {r['peak_vs_none']:.3f}, act {r['act_vs_none']:.3f}, time "
            f"{r['time_vs_none']:.3f}")


def _heat_line(heat: dict) -> str:
    rms = " / ".join(f"{heat.get(k) or 0:.3f}" for k in ("heating_rms_ms", "cooling_rms_ms", "alternating_rms_ms"))
    edge = f"; at the edge of its range: {', '.join(heat['at_bound'])}" if heat.get("at_bound") else ""
    return (f"  heat: fc1 {heat['cool_gemm_ms']:.3f} ms cool, {heat['hot_gemm_ms']:.3f} ms at the power limit "
            f"(+{heat['gemm_heat']:.1%}); heats in {heat['heat_ms']:.0f} ms, cools in {heat['cool_ms']:.1f} ms, "
            f"memory-bound kernels hold {heat['mem_heat']:.2f}; fit rms {rms} ms{edge}")


def _summary(labels, rows, done, notes, out, plot, start) -> None:
    for line in labels.header:
        print(line)
    print(format_table([{"run_kind": labels.kind} | r for r in rows], COLUMNS))
    for r in rows:
        print(_brief(r))
    for point in done:
        c = point["copies"]
        print(f"\n{point['model']} L={point['layers']} M={point['M']}: copies D2H {c['d2h_gbps']:.1f} GB/s, H2D "
              f"{c['h2d_gbps']:.1f} GB/s, k_copy {c['k_copy_d2h']:.3f}/{c['k_copy_h2d']:.3f}, k_gemm "
              f"{c['k_gemm']:.3f}; fixed {point['fixed_bytes'] / 2**30:.2f} GiB + grads "
              f"{point['grad_bytes'] / 2**30:.2f} GiB; "
              f"planner {point['planner_s']:.1f} s; model calibrated on none's step {point['none_step_ms']:.1f} ms "
              f"(compute x {point['compute_scale']:.3f})")
        if point.get("heat", {}).get("measured"):
            print(_heat_line(point["heat"]))
        print(point["planner_table"])
        for key, (value, target, met) in point["targets"].items():
            print(f"  target {key}: {value if value is None else round(value, 4)} (target {target}) "
                  f"{'met' if met else 'NOT met'}")
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {out}" + (f" and {plot}" if plot else "") + f" in {time.monotonic() - start:.0f} s")


def _run(args) -> int:
    start = time.monotonic()
    where = _dist.placement(force_cpu=args.cpu)
    labels = run_labels(where.device.type, 2)  # one GPU per rank by design: only the CPU note applies
    for line in labels.header:
        progress(line, rank=where.rank)
    with _dist.job(PROG, min_ranks=1, where=where) as ctx:
        cuda = ctx.device.type == "cuda"
        local = _local_ranks(ctx)
        notes = []
        chosen = _choose(_points(args, cuda), args, cuda, ctx, notes)
        cap = int((args.host_gib * 2**30) if args.host_gib else available_host_bytes() // 2)
        need = max([e["host_bytes"] for e, *_ in chosen], default=COPY_BYTES)
        host = HostPool(min(need, cap), device=ctx.device)
        pool_stats = host.stats()
        progress(f"offload_bench: {len(chosen)} point(s); host pool {pool_stats.bytes_total / 2**30:.2f} GiB "
                 f"pinned={pool_stats.pinned} NUMA node {pool_stats.numa_node} ({pool_stats.numa_source}; "
                 f"{pool_stats.placement}; pages on {pool_stats.page_nodes}); {time.monotonic() - start:.1f} s",
                 rank=ctx.rank)
        out = Path(args.out or run_dir("offload_bench") / f"offload_{device_slug(ctx.device_name)}.json")
        plot = out.with_suffix(".png")
        rows, done = [], []
        extra = {"op": "offload_bench", "run_kind": labels.kind, "run_notes": labels.header, "reps": args.reps,
                 "warmup": args.warmup, "budgets": args.budget, "local_ranks": local[1],
                 "host_pool": pool_stats.__dict__, "targets": TARGETS}
        try:
            for est, n, layers, m in chosen:
                name, left = f"{n} L={layers} M={m}", args.time_budget_s - (time.monotonic() - start)
                if est["seconds"] > left:
                    notes.append(f"{name}: skipped, {left:.0f} s left of the time budget, ~{est['seconds']:.0f} s "
                                 "needed")
                    continue
                progress(f"{name}: starting at {time.monotonic() - start:.0f} s (~{est['seconds']:.0f} s)",
                         rank=ctx.rank)
                try:
                    point_rows, point = run_point(ctx, (n, MODELS[n], layers, m), args, host, local,
                                                  start + args.time_budget_s)
                    point["targets"] = _targets(point_rows, point)
                    rows += point_rows
                    done.append(point)
                except (torch.cuda.OutOfMemoryError, OffloadError, OffloadPlanError, OutOfTime) as exc:
                    notes.append(f"{name}: skipped, {type(exc).__name__}: {str(exc)[:300]}")
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                if ctx.rank == 0:  # written as it goes: a run cut short keeps what it measured
                    write_results(out, rows, device=ctx.device_name, tp=1,
                                  extra=extra | {"points": done, "notes": notes})
                    _plot(done, rows, plot, notes)
                progress(f"{name}: done at {time.monotonic() - start:.0f} s", rank=ctx.rank)
        finally:
            host.close()
        if ctx.rank == 0:
            write_results(out, rows, device=ctx.device_name, tp=1, extra=extra | {"points": done, "notes": notes})
            _summary(labels, rows, done, notes, out, _plot(done, rows, plot, notes), start)
        return 0


def _plot(done, rows, path, notes):
    try:
        from .output.offload_plot import plot_pareto
        return plot_pareto(done, rows, path)
    except ImportError as exc:  # matplotlib is the `plot` extra
        if not any("plot" in n for n in notes):
            notes.append(f"no plot: {exc}")
        return None


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
