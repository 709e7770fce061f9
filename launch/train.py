"""Train a small Llama under tensor parallelism: ours against DTensor TP (and async-TP on GPUs), side by side.

    torchrun --standalone --nproc-per-node N -m tp_overlap.launch.train [--model tiny|llama1b-ish]
             [--steps S] [--warmup W] [--batch B] [--seq L] [--lr LR] [--optimizer adamw|sgd]
             [--dtype bf16|fp32] [--seed K] [--variants ours,dtensor,async_tp,full] [--cpu] [--out FILE]

Builds a `transformers` LlamaForCausalLM from a preset (random init from --seed, no download; broadcast from
rank 0 so every rank starts from the same weights) and one copy of it per variant, all sequence-parallel
over the N ranks (the TP group):

* ours      `tp_overlap.parallelize` (every block's AllGather and ReduceScatter overlapped with its GEMMs);
* dtensor   `parallelize_module` with ColwiseParallel / RowwiseParallel / SequenceParallel, the
            torchtitan-style plan (launch/measure/train_models.py);
* async_tp  the dtensor plan with each decoder layer compiled under inductor's micro-pipeline TP pass
            (`torch._inductor.config._micro_pipeline_tp`, symmetric memory on for the group). If it fails
            (compile or run), the error is recorded in the JSON and the others go on; the JSON also counts
            the fused ops the pass produced (`fused_ops` 0: async-TP never fired);
* full      (only when asked for) the unconverted model on every rank: the reference the TP variants must
            reproduce (no TP, so its time is no comparison).

Every step feeds the same random tokens (drawn from --seed and the step number, the same on every rank) to
each variant in turn, the order rotated each step, the ranks meeting before each: forward, loss
(labels = inputs), backward, optimizer step. Rank 0 prints a progress line per step on stderr (each
variant's loss and step time). Step times are CUDA events on GPU, the host clock on CPU, max over the ranks;
tokens/s = batch * seq / median step time after the --warmup steps (the compile of async-TP happens in its
first step). Losses are compared with ours' (max relative difference over the steps); ours disagreeing with
dtensor or full beyond LOSS_TOLERANCE fails the run (exit 1) after the JSON is written. Without GPUs (or with
--cpu) it runs on CPU ranks with gloo: a functional check of the same code, not a measurement (labelled so).

Output: a table on stdout and a JSON (commit, command, device, TP size, per-step losses and times, per-variant
summary) in runs/train-<UTC time>/train_<device>_tp<N>.json, or --out (results of record: --out results/...).

The commands for a multi-GPU machine, one per TP size, each sized for a 10-minute call (llama1b-ish, bf16,
batch 4 x 2048 tokens, 40 steps of three variants, async-TP's compile included; fewer --steps if one runs long):

    torchrun --standalone --nproc-per-node 2 -m tp_overlap.launch.train --out results/train_<gpu>_tp2.json
    torchrun --standalone --nproc-per-node 4 -m tp_overlap.launch.train --out results/train_<gpu>_tp4.json
    torchrun --standalone --nproc-per-node 8 -m tp_overlap.launch.train --out results/train_<gpu>_tp8.json

On CPU (the functional check, a few seconds of steps):

    torchrun --standalone --nproc-per-node 2 -m tp_overlap.launch.train --cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import sys

import torch

from .cli import dist as _dist
from .cli.common import ArgumentParser, names, output_file, require, run_dir, run_launcher
from .cli.limits import require_fits
from .cli.tp_mlp_plan import DTYPES
from .measure.timing import progress
from .measure.train_loop import Variant, any_rank, gather_step_times, loss_differences, make_batch, run_steps, summarize
from .measure.train_models import PRESETS, build_model, copy_model, enable_async_tp, parallelize_dtensor
from .output.report import device_slug, format_table, run_labels, write_results

PROG = "tp_overlap.launch.train"
VARIANTS = ("ours", "dtensor", "async_tp", "full")
# max relative loss difference of ours vs dtensor or full that fails the run: fp32 differs by summation order only
# (CUDA: our Triton GEMMs may use TF32); bf16 by rounding of different reduction orders
LOSS_TOLERANCE = {("cpu", "fp32"): 1e-4, ("cuda", "fp32"): 1e-3, ("cpu", "bf16"): 2e-2, ("cuda", "bf16"): 2e-2}
CHECKED = ("dtensor", "full")  # must match ours' losses within LOSS_TOLERANCE (async_tp's are only recorded)
COLUMNS = ["variant", "status", "tokens_per_s", "step_ms_median", "step_ms_min", "step_ms_max", "final_loss",
           "max_rel_loss_diff"]


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--model", choices=tuple(PRESETS), default=None,
                   help="model preset (default: llama1b-ish on GPU, tiny on CPU)")
    p.add_argument("--steps", type=int, default=None, help="training steps per variant (default: 40 on GPU, 5 on CPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="first steps left out of tokens/s (still trained and compared) (default: 5 on GPU, 1 on CPU)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's)")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence, a multiple of the TP size (default: the preset's)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="optimizer of every variant")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="dtype of weights and activations (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the token batches")
    p.add_argument("--variants", default=None,
                   help="comma-separated subset of ours,dtensor,async_tp,full (full: the model without TP on every "
                        "rank, the reference) (default: ours,dtensor,async_tp on GPU, ours,dtensor on CPU, where "
                        "async-TP cannot fuse anything)")
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo even if GPUs are present")
    p.add_argument("--out", type=output_file, default=None,
                   help="results JSON (default: runs/train-<UTC time>/train_<device>_tp<N>.json)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return make_parser().parse_args(argv)


def _defaults(args, cuda: bool) -> None:
    """Fill the device-dependent defaults in place."""
    args.model = args.model or ("llama1b-ish" if cuda else "tiny")
    preset = PRESETS[args.model]
    for key, gpu, cpu in (("steps", 40, 5), ("warmup", 5, 1), ("dtype", "bf16", "fp32"),
                          ("batch", preset.batch, preset.batch), ("seq", preset.seq, preset.seq)):
        if getattr(args, key) is None:
            setattr(args, key, gpu if cuda else cpu)
    args.variants = names("--variants", args.variants or ("ours,dtensor,async_tp" if cuda else "ours,dtensor"),
                          VARIANTS, "variant")


def _validate(args, where) -> None:
    """Every refusal is a UsageError that says what to give instead, the same on every rank."""
    world, preset = where.world_size, PRESETS[args.model]
    require(importlib.util.find_spec("transformers") is not None,
            "transformers is not installed; install the hf extra (pip install -e '.[hf]' in a checkout, or 'tp-overlap[hf]') to build the Llama model")
    require(args.steps >= 1, f"--steps must be >= 1, got {args.steps}")
    require(0 <= args.warmup < args.steps, f"--warmup must be >= 0 and < --steps ({args.steps}), got {args.warmup}: "
            f"tokens/s is the median of the steps after the warm-up")
    require(args.batch >= 1, f"--batch must be >= 1, got {args.batch}")
    require(math.isfinite(args.lr) and args.lr > 0, f"--lr must be a finite number > 0, got {args.lr}")
    require(args.variants != [], "--variants: give at least one of " + ",".join(VARIANTS))
    for what, count in (("attention heads", preset.heads), ("key/value heads", preset.kv_heads),
                        ("ffn_hidden", preset.ffn_hidden)):
        require(count % world == 0, f"--model {args.model}: {what} = {count} is not divisible by the TP size "
                f"{world}; run with --nproc-per-node dividing {count}")
    suggestion = max(1, math.ceil(args.seq / world)) * world
    require(args.seq >= 1 and args.seq % world == 0, f"--seq must be a positive multiple of the TP size {world} "
            f"(every variant splits the sequence evenly), got {args.seq}; try --seq {suggestion}")
    element = torch.finfo(DTYPES[args.dtype]).bits // 8
    # a lower bound: the full model built once plus the copy being converted
    require_fits(f"--model {args.model}", 2 * preset.num_params() * element, where,
                 "use a smaller --model or --dtype bf16")


def _optimizer(model, args) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    return torch.optim.AdamW(model.parameters(), lr=args.lr)


def _convert(name: str, model, ctx, args) -> dict:
    """Convert `model` in place into variant `name`; returns the Variant fields beyond model and optimizer."""
    if name == "full":
        return {}
    if name == "ours":
        import tp_overlap
        handle = tp_overlap.parallelize(model, group=ctx.group, max_tokens=args.batch * args.seq, name="train")
        return {"after_step": handle.check_errors, "close": handle.close, "info": {"pool_bytes": handle.pool_bytes}}
    parallelize_dtensor(model, group=ctx.group, device=ctx.device)
    if name == "dtensor":
        return {}
    counter = enable_async_tp(model, group=ctx.group)
    info = {"async_tp_fusion": counter.summary()}
    return {"may_fail": True, "info": info, "after_step": lambda: info.update(async_tp_fusion=counter.summary())}


def _make_variant(name: str, model, ctx, args) -> Variant:
    """The variant, its optimizer built after the conversion (which replaces the parameters: an optimizer
    built before it would update the detached originals). async-TP's failure is recorded, agreed by every
    rank, and leaves it out."""
    if name != "async_tp":
        fields = _convert(name, model, ctx, args)
        return Variant(name, model, _optimizer(model, args), **fields)
    error = None
    try:
        fields = _convert(name, model, ctx, args)
    except Exception as exc:  # noqa: BLE001 - recorded in the results
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:2000]
    if any_rank(error is not None, ctx.group, ctx.device):
        error = error or "failed on another rank of the group (that rank's error is in its log)"
        progress(f"train: {name} could not be set up and is left out: {error[:300]}", rank=ctx.rank)
        return Variant(name, None, None, may_fail=True, error=error)
    return Variant(name, model, _optimizer(model, args), **fields)


def _build_variants(ctx, args) -> list[Variant]:
    preset = PRESETS[args.model]
    progress(f"train: building {args.model} ({preset.num_params() / 1e6:.1f} M parameters, {args.dtype}) on "
             f"{ctx.world_size} x {ctx.device_name}", rank=ctx.rank)
    base = build_model(preset, seq=args.seq, dtype=DTYPES[args.dtype], device=ctx.device, seed=args.seed,
                       group=ctx.group)
    variants = []
    for name in args.variants:
        progress(f"train: converting a copy for variant {name}", rank=ctx.rank)
        variants.append(_make_variant(name, copy_model(base), ctx, args))
    return variants


def _step_rows(variants: list[Variant], args) -> list[dict]:
    rows = []
    for step in range(args.steps):
        row = {"step": step + 1, "warmup": step < args.warmup}
        for v in variants:
            ran = step < len(v.losses)
            row[f"loss_{v.name}"] = v.losses[step] if ran else None
            row[f"step_ms_{v.name}"] = v.times_ms[step] if ran else None
        rows.append(row)
    return rows


def _compare(variants: list[Variant], args, device_type: str) -> tuple[dict, str | None]:
    """(the loss comparison of the JSON, a message if ours disagrees with a CHECKED variant beyond tolerance)."""
    by_name = {v.name: v for v in variants}
    reference = by_name.get("ours", variants[0])
    tolerance = LOSS_TOLERANCE[(device_type, args.dtype)]
    others = {v.name: loss_differences(reference, v) for v in variants if v is not reference}
    checked = {name: d for name, d in others.items()
               if reference.name == "ours" and name in CHECKED and d["max_rel_diff"] is not None}
    agree = {name: d["max_rel_diff"] <= tolerance for name, d in checked.items()}
    doc = {"reference": reference.name, "tolerance": tolerance, "by_variant": others, "ours_agrees_with": agree}
    wrong = [f"{name} by {checked[name]['max_rel_diff']:.3g} at step {checked[name]['at_step']}"
             for name, ok in agree.items() if not ok]
    failed = (f"the losses of ours differ from {', '.join(wrong)} (relative), more than {tolerance} for "
              f"{args.dtype} on {device_type}") if wrong else None
    return doc, failed


def _report(ctx, args, variants, labels) -> str | None:
    """Write the JSON and print the table on rank 0; returns the disagreement message, if any (every rank)."""
    tokens = args.batch * args.seq
    comparison, failed = _compare(variants, args, ctx.device.type)
    summaries = {v.name: summarize(v, warmup=args.warmup, tokens_per_step=tokens) for v in variants}
    if ctx.rank != 0:
        return failed
    preset = PRESETS[args.model]
    extra = {"op": "train", "model": dataclasses.asdict(preset) | {"num_params": preset.num_params()},
             "batch": args.batch, "seq": args.seq, "tokens_per_step": tokens, "steps": args.steps,
             "warmup": args.warmup, "lr": args.lr, "optimizer": args.optimizer, "dtype": args.dtype,
             "seed": args.seed, "timing": "CUDA events" if ctx.device.type == "cuda" else "host clock",
             "step": "zero_grad + forward + loss + backward + optimizer step, max over ranks",
             "versions": _versions(), "variants": summaries, "loss_comparison": comparison,
             "run_kind": labels.kind, "run_notes": labels.header}
    out = args.out or run_dir("train") / f"train_{device_slug(ctx.device_name)}_tp{ctx.world_size}.json"
    write_results(out, _step_rows(variants, args), device=ctx.device_name, tp=ctx.world_size, extra=extra)
    table = [{"variant": name, **s, "max_rel_loss_diff": comparison["by_variant"].get(name, {}).get("max_rel_diff")}
             for name, s in summaries.items()]
    for line in labels.header:
        print(line)
    print(format_table(table, COLUMNS))
    print(f"wrote {out}")
    return failed


def _versions() -> dict:
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _run(args) -> int:
    where = _dist.placement(force_cpu=args.cpu)
    _defaults(args, where.device.type == "cuda")
    _validate(args, where)
    labels = run_labels(where.device.type, where.world_size)
    for line in labels.header:
        progress(line, rank=where.rank)
    with _dist.job(PROG, min_ranks=1, where=where) as ctx:
        variants = _build_variants(ctx, args)
        vocab = PRESETS[args.model].vocab
        try:
            run_steps(variants, steps=args.steps, group=ctx.group, device=ctx.device, rank=ctx.rank,
                      batch_of=lambda step: make_batch(step, seed=args.seed, batch=args.batch, seq=args.seq,
                                                       vocab=vocab, device=ctx.device))
            gather_step_times(variants, group=ctx.group, device=ctx.device)
            failed = _report(ctx, args, variants, labels)
        finally:
            for v in variants:
                if v.close is not None:
                    v.close()
    if failed:
        raise RuntimeError(failed + " (the JSON holds every step's losses)")
    return 0


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
