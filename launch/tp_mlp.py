"""The main job: training steps of the sequence-parallel TP MLP, overlapped vs plain collectives.

    torchrun --standalone --nproc-per-node N -m tp_overlap.launch.tp_mlp [--config FILE] [--model llama8b,llama70b]
             [--tokens 4096,16384] [--steps S] [--warmup W] [--dtype bf16|fp32] [--cpu] [--out FILE]
             [--cuda-graphs] [--sustained SECONDS] [--trace-dir DIR] [--fp8] [--offload auto|LIST]

For every (model, M): builds the MLP from the model dims (--model, else the preset's `model` section, else
llama8b on GPU / tiny on CPU) and the per-op SM partition of the preset (--config, else auto-selected by
GPU name and TP size); checks output and gradients against the `overlap=False` module once; then times
training steps (forward, backward, SGD step) of ours, the NCCL baseline and, on CUDA, PyTorch's async-TP
fused ops, interleaved (launch.measure.timing: median of the max over ranks). k per op (AllGather+GEMM ops):
its spans inside a step (CUDA streams; CPU: host clock on the caller's and the comm thread) over the op's
solo comm / GEMM times. Prints a table on rank 0 and writes its JSON into a new run folder,
runs/tp_mlp-<UTC time>/tp_mlp_<device-slug>_tp<W>.json (or --out; results of record: --out results/...).
Rank 0 reports progress on stderr within every point (building, numerics check, warm-up, timed step i/N,
k, sustained blocks). Without GPUs (or with --cpu) it runs on CPU ranks with gloo and the host pool: a
functional check, labelled so in the table (`run_kind`) and above it; one rank (plain `python -m
launch.tp_mlp`) runs too, labelled "1 rank" (nothing to overlap). --cuda-graphs (CUDA) times each
variant's whole training step as a CUDA-graph replay (ours and the NCCL baseline; torch_symm and the k
columns are left out), i.e. device time without the per-call host cost. --trace-dir DIR (CUDA) profiles
one more step of ours and of the baseline per point: rank 0's Chrome traces, a per-stream Gantt PNG and
each stream's busy time in the row's `timeline` (launch/measure/timeline.py). --sustained S also times every
variant as two blocks of about S seconds of back-to-back steps (order A B C, C B A), with rank 0's GPU's
SM clock and power per variant where nvidia-smi answers (launch/measure/sustained.py): a training loop does not
pause between steps, which on a power-capped GPU costs the faster variant clock and, where the eager step is
host-bound, lets the host run ahead (`speedup_sustained`, `speedup_sustained_vs_torch_symm`). --fp8 adds
our MLP with FP8 GEMMs (variant overlap_fp8: e4m3 rows gathered with their scales, bf16 partials reduced;
checked against overlap=False within FP8_TOLERANCE; `speedup_fp8`, `speedup_fp8_vs_bf16`). --offload
times our step without and with activation offload of that MLP (launch/measure/offload_report.py: measured copy
rates, the plan, `offload_time_ratio`, `offload_peak_ratio`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from tp_overlap.config import envs
from tp_overlap.config.schema import ACTIVATIONS, MODELS, ModelConfig
from tp_overlap.ops.layers import TPMLP, pool_requirements
from tp_overlap.launch.output.report import device_slug, format_table, run_labels, write_results
from tp_overlap.launch.measure.timing import bench_interleaved, progress
from tp_overlap.symm_mem.pool import SymmetricPool

from .measure.accuracy import rel_err as _rel_err
from .cli import dist as _dist, tp_mlp_plan as _plan
from .measure.offload_report import add_offload_argument, offload_report
from .cli.common import ArgumentParser, input_file, int_list, output_dir, output_file, run_dir, run_launcher
from .cli.tp_mlp_plan import DTYPES
from .measure.step_k import max_over_ranks, step_k_factors
from .measure.sustained import sustained_blocks

PROG = "tp_overlap.launch.tp_mlp"
TOLERANCE = {"bf16": 2e-2, "fp32": 1e-5}  # relative (norm-wise) vs overlap=False; fp32 on CUDA: 1e-3 (TF32)
# e4m3 costs ~4e-2 per GEMM on Gaussian data and a gradient chains up to three quantised GEMMs
FP8_TOLERANCE = 0.15
FP8_COLUMNS = ["t_step_overlap_fp8_ms", "speedup_fp8", "speedup_fp8_vs_bf16", "rel_err_overlap_fp8_max"]
OFFLOAD_COLUMNS = ["offload_time_ratio", "offload_peak_ratio"]
COLUMNS = ["run_kind", "model", "M", "activation", "t_step_overlap_ms", "t_step_baseline_ms", "t_step_torch_symm_ms",
           "speedup", "speedup_vs_torch_symm", "speedup_sustained", "k_comm_fc1_fwd_ag", "k_comp_fc1_fwd_ag",
           "k_comm_fc2_bwd_ag", "k_comp_fc2_bwd_ag", "rel_err_max"]


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--config", type=input_file, default=None,
                   help="YAML preset (default: auto-selected by GPU name and TP size); its model section, if "
                        "any, is the model to build unless --model is given")
    p.add_argument("--model", default=None, help=f"comma-separated names of {', '.join(MODELS)} "
                   "(default: the preset's model section, else llama8b on GPU / tiny on CPU)")
    p.add_argument("--activation", default=None, choices=ACTIVATIONS,
                   help="override the model's activation (default: the model's)")
    p.add_argument("--tokens", type=int_list, default=None, metavar="M[,M...]",
                   help="token counts M, each a multiple of the TP size (default: 16384 on GPU, 256 on CPU)")
    p.add_argument("--steps", "--reps", dest="steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps per variant (default: 20 on GPU, 2 on CPU)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="dtype of weights and activations")
    p.add_argument("--baselines", default=None,
                   help="comma-separated subset of nccl,torch_symm (default: both on GPU, nccl on CPU and "
                        "with --cuda-graphs; nccl is always run: the numerics check and the speedup use it)")
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo even if GPUs are present")
    p.add_argument("--out", type=output_file, default=None,
                   help="results JSON (default: runs/tp_mlp-<UTC time>/tp_mlp_<gpu>_tp<W>"
                   "[_graphs].json; results of record only with an explicit --out results/...)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="time each training step as a CUDA-graph replay (CUDA only; ours and the nccl baseline)")
    p.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                   help="also time two blocks of about SECONDS of back-to-back steps per variant (A B C, "
                        "C B A), with SM clock and power where nvidia-smi answers (0: off)")
    p.add_argument("--trace-dir", type=output_dir, default=None,
                   help="CUDA: profile one step of ours and of the baseline per point; Chrome traces, a Gantt "
                        "PNG and per-stream busy times go here (and into the row's `timeline`) (default: off)")
    p.add_argument("--fp8", action="store_true",
                   help="also time our MLP with FP8 GEMMs (e4m3, 1x128 activation and 128x128 weight scales; "
                        f"variant overlap_fp8, checked against overlap=False within {FP8_TOLERANCE})")
    add_offload_argument(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return make_parser().parse_args(argv)


def _fwd_bwd(mlp: TPMLP, x: torch.Tensor, dy: torch.Tensor):
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    y = mlp(x)
    y.backward(dy)
    return y.detach()


def _grads(mlp: TPMLP, x, dy) -> tuple:
    y = _fwd_bwd(mlp, x, dy)
    return y, x.grad.clone(), mlp.fc1.weight.grad.clone(), mlp.fc2.weight.grad.clone()


def _check_numerics(ctx, mlps: dict, x, dy, dtype_name: str, label: str = "") -> dict:
    """One forward+backward of every variant against the baseline; ours out of tolerance raises (the
    same error, max over ranks, on every rank); the torch_symm baseline's error is only recorded."""
    progress(f"{label}numerics check: one training step of each variant against overlap=False", rank=ctx.rank)
    base = _grads(mlps["baseline"], x, dy)
    names = ("out", "grad_x", "grad_fc1", "grad_fc2")
    row = {}
    for variant in [v for v in mlps if v != "baseline"]:
        progress(f"{label}numerics check: {variant}", rank=ctx.rank)
        got = _grads(mlps[variant], x, dy)
        errors = dict(zip(names, max_over_ranks([_rel_err(a, b) for a, b in zip(got, base)], ctx)))
        if variant == "overlap":
            row |= {f"rel_err_{k}": v for k, v in errors.items()} | {"rel_err_max": max(errors.values())}
        else:  # per tensor too: FP8's error differs between the output and each gradient
            row |= {f"rel_err_{variant}_{k}": v for k, v in errors.items()}
            row[f"rel_err_{variant}_max"] = max(errors.values())
    tol = TOLERANCE[dtype_name] if ctx.device.type == "cpu" or dtype_name == "bf16" else 1e-3
    if row["rel_err_max"] > tol:
        raise RuntimeError(f"overlap vs overlap=False: relative errors {row} exceed {tol}")
    if row.get("rel_err_overlap_fp8_max", 0.0) > FP8_TOLERANCE:
        raise RuntimeError(f"overlap_fp8 vs overlap=False: relative error {row['rel_err_overlap_fp8_max']:.3g} "
                           f"exceeds {FP8_TOLERANCE}")
    return row


def _timelines(ctx, model: ModelConfig, m: int, steps: dict, args) -> tuple[dict, str | None]:
    """Per-stream busy times of one profiled step of ours and of the baseline, and the path of their
    Gantt PNG (rank 0; ({}, None) on the other ranks)."""
    from .output import plots as _plots
    from .measure import timeline as _timeline

    stem = f"tp_mlp_{model.name}_M{m}{'_graphs' if args.cuda_graphs else ''}"
    chosen = {name: steps[name] for name in ("overlap", "baseline")}
    summaries, lanes = _timeline.profile_steps(chosen, group=ctx.group, rank=ctx.rank, out_dir=args.trace_dir,
                                               stem=stem)
    png = None
    if ctx.rank == 0 and lanes:
        png = _plots.plot_timeline(
            [(f"{model.name} M={m} {name}: span {summaries[name]['span_ms']:.2f} ms", by_lane)
             for name, by_lane in lanes.items()], f"{args.trace_dir}/{stem}_timeline.png",
            xlabel="ms from the step's first GPU activity (rank 0)")
        png = str(png)
    return summaries, png


def _sustained(ctx, steps: dict, stats: dict, args, label: str) -> dict:
    """Row fields of --sustained (None when off): ms/step, SM clock and power per variant, and the speedup."""
    names = ("overlap", "baseline", "torch_symm")
    fields = {f"{key}_{name}{unit}": None for name in names
              for key, unit in (("t_step", "_sustained_ms"), ("t_step", "_sustained_blocks_ms"),
                                ("sm_clock", "_mhz"), ("power", "_w"))}
    fields["speedup_sustained"] = fields["speedup_sustained_vs_torch_symm"] = None
    if not args.sustained:
        return fields
    fastest = min(s.median_ms for s in stats.values())
    blocks = sustained_blocks(steps, seconds=args.sustained, step_ms=fastest, group=ctx.group,
                              device=ctx.device, rank=ctx.rank, label=label)
    for name, block in blocks.items():
        fields[f"t_step_{name}_sustained_ms"] = block["ms"]
        fields[f"t_step_{name}_sustained_blocks_ms"] = block["block_ms"]
        fields[f"sm_clock_{name}_mhz"], fields[f"power_{name}_w"] = block["sm_clock_mhz"], block["power_w"]
    ours = blocks["overlap"]["ms"]
    fields["speedup_sustained"] = blocks["baseline"]["ms"] / ours
    if "torch_symm" in blocks:
        fields["speedup_sustained_vs_torch_symm"] = blocks["torch_symm"]["ms"] / ours
    return fields


def _build_mlps(ctx, model: ModelConfig, m: int, cfg, pool, args, baselines: list[str], label: str) -> dict:
    """Ours (and overlap_fp8 with --fp8) on `pool`, then each baseline; the nccl one is named "baseline"."""
    common = dict(group=ctx.group, max_m=m, dtype=DTYPES[args.dtype], device=ctx.device)
    progress(f"{label}building the MLPs (ours, {', '.join(baselines)}; H={model.hidden}, "
             f"FFN={model.ffn_hidden}, {model.activation})", rank=ctx.rank)
    mlps = {"overlap": TPMLP.from_model_config(model, pool=pool, config=cfg, name=f"{model.name}.M{m}", fp8=False,
                                               **common)}
    if args.fp8:
        mlps["overlap_fp8"] = TPMLP.from_model_config(model, pool=pool, config=cfg, name=f"{model.name}.M{m}.fp8",
                                                      fp8=True, **common)
    for name in baselines:
        mlps[name if name != "nccl" else "baseline"] = TPMLP.from_model_config(
            model, overlap=False, baseline=name, **common)
    return mlps


def _load_data(ctx, model: ModelConfig, m: int, mlps: dict, dtype: torch.dtype) -> tuple:
    """The same per-rank weight shards copied into every variant, and this rank's input x and gradient dy
    (no full weights: llama70b's would take seconds to draw on the host)."""
    gen = torch.Generator(ctx.device).manual_seed(1000 + ctx.rank)

    def draw(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, device=ctx.device) * scale).to(dtype)

    ours = mlps["overlap"]
    w1 = draw(*ours.fc1.weight.shape, scale=model.hidden ** -0.5)
    w2 = draw(*ours.fc2.weight.shape, scale=model.ffn_hidden ** -0.5)
    for mlp in mlps.values():
        with torch.no_grad():
            mlp.fc1.weight.copy_(w1)
            mlp.fc2.weight.copy_(w2)
    x = draw(m // ctx.world_size, model.hidden).requires_grad_()
    dy = draw(m // ctx.world_size, model.hidden)
    return x, dy


def _training_steps(mlps: dict, x, dy) -> dict:
    """One callable per variant: forward, backward and an SGD step of its own parameters."""
    optimizers = {name: torch.optim.SGD(mlp.parameters(), lr=1e-4) for name, mlp in mlps.items()}

    def make_step(name):
        mlp, opt = mlps[name], optimizers[name]

        def step():
            _fwd_bwd(mlp, x, dy)
            opt.step()
        return step

    return {name: make_step(name) for name in mlps}


def _graph_steps(ctx, steps: dict, model: ModelConfig, m: int, label: str) -> dict:
    """--cuda-graphs: each variant's step as a graph replay; ours and the baseline must both capture."""
    from .measure.graphs import graph_variants
    progress(f"{label}capturing each variant's training step in a CUDA graph", rank=ctx.rank)
    steps = graph_variants(steps, group=ctx.group, rank=ctx.rank)
    if {"overlap", "baseline"} - set(steps):  # the drop was agreed: every rank raises this
        raise RuntimeError(f"{model.name} M={m}: a training step could not be captured in a CUDA graph "
                           f"(captured: {sorted(steps)}); run without --cuda-graphs")
    return steps


def _step_times(stats: dict, fp8: bool) -> dict:
    """Row fields of the interleaved timing: median, min and max ms per variant (None if not run), speedups."""
    row = {}
    for name in ("overlap", "baseline", "torch_symm") + (("overlap_fp8",) if fp8 else ()):
        s = stats.get(name)
        row[f"t_step_{name}_ms"] = s.median_ms if s else None
        row[f"t_step_{name}_min_ms"], row[f"t_step_{name}_max_ms"] = (s.min_ms, s.max_ms) if s else (None, None)
    row["speedup"] = row["t_step_baseline_ms"] / row["t_step_overlap_ms"]
    row["speedup_vs_torch_symm"] = (row["t_step_torch_symm_ms"] / row["t_step_overlap_ms"]
                                    if "torch_symm" in stats else None)
    if fp8:
        row["speedup_fp8"] = row["t_step_baseline_ms"] / row["t_step_overlap_fp8_ms"]
        row["speedup_fp8_vs_bf16"] = row["t_step_overlap_ms"] / row["t_step_overlap_fp8_ms"]
    return row


def _after_timing(ctx, model: ModelConfig, m: int, ours: TPMLP, x, dy, steps: dict, args, label: str) -> dict:
    """Row fields measured after the timed steps: the timeline (--trace-dir), k per op and the offload report."""
    row = {}
    if args.trace_dir:
        progress(f"{label}profiling one step of ours and of the baseline", rank=ctx.rank)
        row["timeline"], row["timeline_png"] = _timelines(ctx, model, m, steps, args)
    if args.cuda_graphs:  # eager traced calls after a capture are not what was timed
        row |= {f"k_{kind}_{key}": None for key in ("fc1_fwd_ag", "fc2_bwd_ag") for kind in ("comm", "comp")}
    else:
        row |= step_k_factors(ctx, ours, x, dy, steps["overlap"], warmup=2, reps=max(5, args.steps // 2), label=label)
    if args.offload.enabled:
        progress(f"{label}activation offload: rates, plan, the step without and with it", rank=ctx.rank)
        row |= offload_report(ctx, ours, x, dy, args.offload, warmup=args.warmup, reps=args.steps)
    return row


def run_point(ctx, model: ModelConfig, m: int, cfg, pool, args, baselines: list[str], label: str = "") -> dict:
    """One (model, M): build, check numerics, time (progress lines on rank 0 prefixed with `label`)."""
    mlps = _build_mlps(ctx, model, m, cfg, pool, args, baselines, label)
    ours = mlps["overlap"]
    x, dy = _load_data(ctx, model, m, mlps, DTYPES[args.dtype])
    row = {"model": model.name, "M": m, "hidden": model.hidden, "ffn_hidden": model.ffn_hidden,
           "activation": model.activation, "dtype": args.dtype}
    row |= _check_numerics(ctx, mlps, x, dy, args.dtype, label)
    steps = _training_steps(mlps, x, dy)
    if args.cuda_graphs:
        steps = _graph_steps(ctx, steps, model, m, label)
        row["cuda_graphs"] = True
    stats = bench_interleaved(steps, group=ctx.group, device=ctx.device, warmup=args.warmup, reps=args.steps,
                              label=label)
    ours.check_errors()
    row |= _step_times(stats, args.fp8)
    row |= _after_timing(ctx, model, m, ours, x, dy, steps, args, label)
    # last: its minutes of full load would change what the k and trace steps above measure
    row |= _sustained(ctx, steps, stats, args, label=label)
    ours.check_errors()
    row["ops"] = {role: dataclasses.asdict(op.config) for role, op in (
        ("fc1.fwd.ag", ours.fc1.ops.ag), ("fc1.bwd.rs", ours.fc1.ops.rs), ("fc2.fwd.rs", ours.fc2.ops.rs),
        ("fc2.bwd.ag", ours.fc2.ops.ag))}
    for mlp in mlps.values():
        mlp.close()
    return row


def _run(args) -> int:
    where = _dist.placement(force_cpu=args.cpu)
    plan = _plan.plan(args, where)
    args.warmup = plan.warmup
    cfg, models, tokens = plan.cfg, plan.models, plan.tokens
    labels = run_labels(where.device.type, where.world_size)
    for line in labels.header:
        progress(line, rank=where.rank)
    # a one-rank job is allowed (labelled: nothing to overlap); _dist imports torch._dynamo before the group
    with _dist.job(PROG, min_ranks=1, where=where) as ctx:
        needs = [pool_requirements(hidden=mo.hidden, max_m=m, world_size=ctx.world_size, dtype=DTYPES[args.dtype],
                                   chunks_per_rank=cfg.op_config("ag_gemm", m).chunks_per_rank, fp8=fp8)
                 for mo in models for m in tokens for fp8 in ([False, True] if args.fp8 else [False])]
        pool_bytes, signal_words, device_words = (sum(column) for column in zip(*needs))
        points = [(model, m) for model in models for m in tokens]
        progress(f"tp_mlp: {len(points)} point(s) on {ctx.world_size} x {ctx.device_name}, "
                 f"preset {cfg.source}, pool {pool_bytes / 2**20:.1f} MiB", rank=ctx.rank)
        rows = []
        with SymmetricPool(pool_bytes, group=ctx.group, device=ctx.device, num_signal_words=signal_words,
                           num_device_words=device_words, timeout_s=envs.timeout_s()) as pool:
            for i, (model, m) in enumerate(points):
                label = f"point {i + 1}/{len(points)} {model.name} M={m}: "
                row = {"run_kind": labels.kind} | run_point(ctx, model, m, cfg, pool, args, plan.baselines, label)
                rows.append(row)
                k = row["k_comm_fc1_fwd_ag"]
                progress(f"{label}step {row['t_step_overlap_ms']:.3f} ms, overlap=False "
                         f"{row['t_step_baseline_ms']:.3f} ms, speedup {row['speedup']:.3f}x, k_comm fc1 "
                         f"{'-' if k is None else f'{k:.2f}'}, rel err {row['rel_err_max']:.2g}"
                         + (f", sustained {row['speedup_sustained']:.3f}x" if args.sustained else ""),
                         rank=ctx.rank)
            pool.barrier()
        if ctx.rank == 0:
            suffix = "_graphs" if args.cuda_graphs else ""
            name = f"tp_mlp_{device_slug(ctx.device_name)}_tp{ctx.world_size}{suffix}.json"
            out = args.out or run_dir("tp_mlp") / name
            write_results(out, rows, device=ctx.device_name, tp=ctx.world_size,
                          extra={"op": "tp_mlp", "preset": cfg.source, "steps": args.steps,
                                 "warmup": args.warmup, "step": "forward + backward + SGD step",
                                 "cuda_graphs": args.cuda_graphs, "sustained_s": args.sustained,
                                 "fp8": args.fp8, "offload": repr(args.offload),
                                 "run_kind": labels.kind, "run_notes": labels.header})
            for line in labels.header:
                print(line)
            print(format_table(rows, COLUMNS + FP8_COLUMNS * args.fp8 + OFFLOAD_COLUMNS * args.offload.enabled))
            print(f"wrote {out}")
        return 0


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
