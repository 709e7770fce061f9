"""`tp_overlap.launch.gemm_bench --fp8`: the FP8 block-scaled Triton GEMM against cuBLAS's blockwise FP8
(`torch._scaled_mm` with the same scale tensors) and bf16 cuBLAS, on the same shapes as the bf16 bench.

Per shape: a bf16 activation [M, K] and weight [N, K] (nn.Linear layout) are quantised once by
overlap.gemm.fp8 (1x128 and 128x128 scales); the variants -- bf16 `torch.mm(a, w.t())`, `torch._scaled_mm`,
our default blocks (`choose_fp8_blocks`) and every FP8 candidate (launch/measure/tune.py FP8_CANDIDATES, or
`--configs`) -- are
checked against `torch._scaled_mm`'s output on a NaN-poisoned output (relative error <= 5e-3 in norm and
<= 1e-2 of the largest output in the worst element: both round the same fp32 sums to bf16) and timed
interleaved (device time, as the bf16 bench). The configurations first run once each on a small shape,
`--jobs` child processes at a time (launch/measure/canary.py precompile): compiling is most of the cost. `--write-table PATH` writes the fastest
candidate per shape (and the fastest plain one) as an FP8 block table that `choose_fp8_blocks` reads
from configs/gemm_blocks/<gpu>_fp8.yaml.
"""

from __future__ import annotations

import statistics
import time

import torch

from tp_overlap.launch.cli.common import run_dir
from tp_overlap.launch.output.report import device_slug, format_table, write_results
from tp_overlap.launch.measure.timing import bench_interleaved, progress
from tp_overlap.gemm import (PLAIN_BLOCK_M, BlockTableEntry, GemmBlocks, choose_fp8_blocks, fp8_gemm, gpu_name, num_sms,
                          quantize_activation, quantize_weight, scaled_mm_reference)

from .canary import operands, precompile
from .tune import FP8_CANDIDATES, write_table

FP8_REL_TOLERANCE = 5e-3       # Frobenius norm of the difference over the reference's
FP8_MAX_REL_TOLERANCE = 1e-2   # the worst element's difference over the reference's largest magnitude
PER_CALL_OVERHEAD_S = 6e-4


def run_fp8(args, *, dev: torch.device, device_name: str, points: list[tuple[str, str, int, int, int, int]]) -> int:
    """The FP8 sweep over `points` ((layer, op, tp, m, n, k), launch.gemm_bench.shape_points) on `dev`."""
    started = time.monotonic()
    out = args.out or str(run_dir("gemm_bench") / f"gemm_fp8_{device_slug(device_name)}.json")
    candidates = {name: GemmBlocks.parse(name) for name in (args.configs or FP8_CANDIDATES)}
    failed = _canary_failures(args, dev, candidates, points, started)
    rows, skipped, entries = [], [], {}
    for i, (layer, op, world, m, n, k) in enumerate(points):
        default = choose_fp8_blocks(m, n, k, device_type=dev.type, gpu=gpu_name(dev))
        blocks = {name: blk for name, blk in {"default": default, **candidates}.items() if blk.name not in failed}
        estimate = (len(blocks) + 2) * (args.reps + 4) * (2 * m * n * k / 600e12 + PER_CALL_OVERHEAD_S)
        if time.monotonic() - started + estimate > args.time_budget_s:
            skipped.append({"layer": layer, "tp": world, "M": m, "N": n, "K": k})
            continue
        a, w, scaled = _quantised_operands(m, n, k, dev, seed=i)
        row = {"layer": layer, "op": op, "tp": world, "M": m, "K": k, "N": n, "default_blocks": default.name}
        variants, ref = _baseline_variants(a, w, scaled, dev, row)
        variants |= _checked_fp8_variants(a, w, scaled, ref, blocks, dev, row, failed)
        stats = bench_interleaved(variants, group=None, device=dev, warmup=3, reps=args.reps,
                                  hold_device_us=args.hold_us)
        times = _record_times(row, stats, blocks, (m, n, k), entries)
        rows.append(row)
        _write(out, rows, skipped, failed, args, device_name)
        if args.write_table and entries:
            write_table(args.write_table, entries, gpu=gpu_name(dev) or "cpu", num_sms_=num_sms(dev),
                        source={"command": "tp_overlap.launch.gemm_bench --fp8", "reference": "torch._scaled_mm"},
                        operand_bytes=1)
        progress(f"fp8 {i + 1}/{len(points)} {layer}@tp{world} M={m}: bf16 {times['cublas_bf16']:.4f} ms, scaled_mm "
                 f"{times.get('scaled_mm', float('nan')):.4f} ms, ours {row.get('t_best_ms', float('nan')):.4f} ms "
                 f"({row.get('best_blocks')})")
    _write(out, rows, skipped, failed, args, device_name)
    _print_summary(rows, skipped, out)
    return 0 if rows else 1


def _canary_failures(args, dev: torch.device, candidates: dict, points: list, started: float) -> dict[str, str]:
    """Every configuration once in a child process first (launch/measure/canary.py): the configurations a
    crash, a hang or the budget dropped, by name, with why."""
    names = sorted(set(candidates) | {choose_fp8_blocks(m, n, k, device_type=dev.type, gpu=gpu_name(dev)).name
                                      for _, _, _, m, n, k in points})
    verdicts = precompile("fp8", [(name, "nk") for name in names], started + 0.5 * args.time_budget_s,
                          jobs=args.jobs, device=dev.type, shape=args.canary_shape)
    if not verdicts:  # the child itself failed (see its traceback above): run without it
        progress("canary: no verdict at all, timing every configuration without it")
        verdicts = {(name, "nk"): "" for name in names}
    failed: dict[str, str] = {}
    for name in names:
        if verdicts.get((name, "nk"), "not reached within its share of the budget"):
            failed[name] = "canary: " + verdicts.get((name, "nk"), "not reached within its share of the budget")
            progress(f"  fp8 {name} dropped: {failed[name]}")
    return failed


def _quantised_operands(m: int, n: int, k: int, dev: torch.device, seed: int) -> tuple:
    """bf16 a [M, K] and w [N, K] (row-major, the nn.Linear layout), and their FP8 values and scales as
    keyword arguments of fp8_gemm / scaled_mm_reference."""
    a, w_t = operands(m, n, k, "nk", dev, seed=seed)
    w = w_t.t()
    a8, a_scales = quantize_activation(a)
    w8, w_scales = quantize_weight(w)
    return a, w, {"a8": a8, "a_scales": a_scales, "w8": w8, "w_scales": w_scales}


def _baseline_variants(a, w, scaled: dict, dev: torch.device, row: dict) -> tuple[dict, torch.Tensor | None]:
    """bf16 cuBLAS and, where cuBLAS accepts the block scales for this shape, torch._scaled_mm (else its
    error goes into `row`); and _scaled_mm's output (None without it)."""
    out_bf16 = torch.empty(a.shape[0], w.shape[0], dtype=torch.bfloat16, device=dev)
    variants = {"cublas_bf16": lambda: torch.mm(a, w.t(), out=out_bf16)}
    try:
        ref = scaled_mm_reference(**scaled)
        variants["scaled_mm"] = lambda: scaled_mm_reference(**scaled)
    except Exception as exc:  # cuBLAS refused the block scales for this shape: compare with bf16 only
        row["scaled_mm_error"] = str(exc)[-200:]
        ref = None
    return variants, ref


def _checked_fp8_variants(a, w, scaled: dict, ref, blocks: dict, dev: torch.device, row: dict,
                          failed: dict[str, str]) -> dict:
    """Our FP8 GEMM per block configuration, run once into a NaN-poisoned output and checked against `ref`
    (or bf16 cuBLAS, more loosely, without it); errors go into `row`, the failures into `failed`."""
    m, n = a.shape[0], w.shape[0]
    check = ref if ref is not None else torch.mm(a, w.t())
    tolerance = FP8_REL_TOLERANCE if ref is not None else 6e-2
    variants = {}
    for name, blk in blocks.items():
        result = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
        try:
            fp8_gemm(**scaled, out=result, blocks=blk)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except Exception as exc:  # compile error / OutOfResources: dropped from here on
            failed.setdefault(blk.name, f"{type(exc).__name__}: {str(exc)[-160:]}")
            progress(f"  fp8 {name} ({blk.name}) failed: {failed[blk.name]}")
            continue
        diff = result.float() - check.float()
        err = (diff.norm() / check.float().norm()).item()
        worst = (diff.abs().max() / check.float().abs().max()).item()
        row[f"{name}_rel_err"], row[f"{name}_max_rel_err"] = err, worst
        if not (err <= tolerance and (ref is None or worst <= FP8_MAX_REL_TOLERANCE)):
            failed.setdefault(blk.name, f"relative error {err:.3g} (worst element {worst:.3g}) at M={m} N={n} "
                                        f"K={a.shape[1]}")
            progress(f"  fp8 {name} ({blk.name}): {failed[blk.name]}")
            continue
        variants[name] = lambda blk=blk, o=result: fp8_gemm(**scaled, out=o, blocks=blk)
    return variants


def _record_times(row: dict, stats: dict, blocks: dict, shape: tuple[int, int, int], entries: dict) -> dict:
    """Median times and speed ratios into `row`, the fastest (and fastest plain) blocks into `entries`;
    returns the median ms per variant."""
    m, n, k = shape
    times = {name: s.median_ms for name, s in stats.items()}
    ours = {name: t for name, t in times.items() if name not in ("cublas_bf16", "scaled_mm")}
    best = min(ours, key=ours.get) if ours else None
    row.update({f"t_{name}_ms": t for name, t in times.items()})
    if best is None:
        return times
    row.update(best_blocks=blocks[best].name, t_best_ms=ours[best], best_over_bf16=times["cublas_bf16"] / ours[best])
    if "scaled_mm" in times:
        row["best_over_scaled_mm"] = times["scaled_mm"] / ours[best]
        row["default_over_scaled_mm"] = times["scaled_mm"] / ours["default"] if "default" in ours else None
    plains = [nm for nm in ours  # what flag-waiting callers can run: 128-row tiles, one program per SM
              if blocks[nm].plain and blocks[nm].block_m == PLAIN_BLOCK_M and blocks[nm].programs_per_sm == 1]
    plain = min(plains, key=ours.get) if plains else None
    plain_blocks = blocks[plain] if plain else choose_fp8_blocks(m, n, k, warp_specialize=False)
    entries[("nk", m, n, k)] = BlockTableEntry("nk", m, n, k, blocks[best], plain_blocks,
                                               times.get("scaled_mm", times["cublas_bf16"]) / ours[best], None)
    return times


def _print_summary(rows: list[dict], skipped: list[dict], out) -> None:
    print(format_table(rows, ["layer", "tp", "M", "K", "N", "t_cublas_bf16_ms", "t_scaled_mm_ms", "t_default_ms",
                              "t_best_ms", "best_blocks", "best_over_scaled_mm", "default_over_scaled_mm"]))
    ratios = [r["best_over_scaled_mm"] for r in rows if r.get("best_over_scaled_mm")]
    if ratios:
        print(f"fp8: best Triton / scaled_mm speed median {statistics.median(ratios):.3f}, min {min(ratios):.3f}")
    print(f"{len(rows)} shapes measured, {len(skipped)} skipped (budget); results: {out}")


def _write(out, rows, skipped, failed, args, device_name) -> None:
    ratios = [r["best_over_scaled_mm"] for r in rows if r.get("best_over_scaled_mm")]
    defaults = [r["default_over_scaled_mm"] for r in rows if r.get("default_over_scaled_mm")]
    summary = {"best_over_scaled_mm_median": statistics.median(ratios) if ratios else None,
               "best_over_scaled_mm_min": min(ratios) if ratios else None,
               "default_over_scaled_mm_median": statistics.median(defaults) if defaults else None}
    write_results(out, rows, device=device_name, tp=args.tp[0] if len(args.tp) == 1 else 0, extra={
        "op": "gemm_fp8", "tp_sizes": list(args.tp), "hold_device_us": args.hold_us, "reps": args.reps,
        "scales": "A 1x128 [K/128, M].t(), W 128x128 [N/128, K/128] (scale_b = w_scales.t())",
        "summary": summary, "failed": failed, "skipped": skipped})
