"""The Gluon FP8 block-scaled GEMM (kernels/gemm_fp8_gluon.py) on one GPU: correctness, then speed.

    OVERLAP_GIT_COMMIT=$(git rev-parse --short HEAD) python -m tests.gpu.check_fp8_gluon
        --json results/gemm_fp8_gluon_h200.json [--max-seconds 120]     (one line; ~60-90 s on one H200)

(a) every Gluon candidate (launch/measure/tune.py FP8_CANDIDATES ending in `gl`) against torch._scaled_mm with the
same scale tensors where cuBLAS takes them (K/128 a multiple of 4), else against the fp32 product of the
dequantised operands: worst element <= 1e-2 of the largest output. K tails (1280, 1344), M and N tails, A
poisoned with NaN past K (TMA must read zeros there) and in the padding of scale rows, the output inside a
NaN-filled buffer (nothing written outside [M, N], nothing left unwritten inside), three runs bitwise
identical, and the same bits from row-major A scales (an AllGather pool's layout); where TMA cannot read the
A scales (M % 4 != 0) explicit Gluon blocks are refused and fp8_gemm's own choice falls back to plain blocks.
(b) llama8b / llama70b TP2 local shapes at M = 1024, 4096, 16384: the Gluon kernel vs torch._scaled_mm and
bf16 torch.mm (L2 flushed, CUDA events, interleaved, median of 20, device held 300 us before each call
so Python launch cost is not timed).

Each case reports its exception and the run continues. The work runs in a child process that writes the
JSON after every case; the parent kills it after --max-seconds (a hung kernel cannot stop itself) and
records that. Exit status 1 when a correctness case failed or nothing was timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

MAX_REL_TOLERANCE = 1e-2
# (M, N, K): K 1344 = 10.5 groups, 1280 = 10 (not a multiple of 4), M/N not multiples of the tile
# M 333 and 1: A scale rows TMA cannot read, refused (fp8_gemm's own choice falls back to plain blocks)
CORRECTNESS_SHAPES = ((1000, 1032, 1344), (256, 4096, 1280), (4096, 3072, 4096), (333, 200, 1024), (1, 128, 256),
                      (1500, 1536, 2048), (332, 200, 1024), (4, 128, 256))
M_VALUES = (1024, 4096, 16384)
TIMED_BLOCKS = ("128x128x128w4s4gl", "128x128x128w4s5gl")


def tp2_shapes() -> list[tuple[str, int, int]]:
    from tp_overlap.launch.cli.shapes import AG_LAYERS, RS_LAYERS

    out = [(name, h, n_total // 2) for name, (h, n_total) in AG_LAYERS.items()]   # (layer, K, N)
    out += [(name, k_total // 2, h) for name, (h, k_total) in RS_LAYERS.items()]
    return out


def _log(msg: str) -> None:
    print(f"[check_fp8_gluon {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _grouped(rows, cols, block_rows, gen, dev):
    """Values whose magnitude changes by up to 2**±3 between scale groups: a wrong scale index shows."""
    import torch

    x = torch.randn(rows, cols, generator=gen, device=dev)
    exps = torch.randint(-3, 4, (-(-rows // block_rows), -(-cols // 128)), generator=gen, device=dev).float()
    factors = torch.exp2(exps).repeat_interleave(block_rows, 0).repeat_interleave(128, 1)
    return (x * factors[:rows, :cols]).bfloat16()


def _correctness_case(name, m, n, k, gen, dev) -> dict:
    import torch

    from tp_overlap.gemm import fp8
    from tp_overlap.gemm.blocks import GemmBlocks

    x8, xs = fp8.quantize_activation(_grouped(m, k, 1, gen, dev))
    w8, ws = fp8.quantize_weight(_grouped(n, k, 128, gen, dev) * 0.05)
    # NaN in the padding of the weight scale rows: TMA may read it, the kernel must not use it
    torch.as_strided(ws, (ws.shape[0], ws.stride(0)), (ws.stride(0), 1))[:, ws.shape[1]:] = float("nan")
    padded = torch.full((m, k + 64), 0x7F, dtype=torch.uint8, device=dev).view(fp8.FP8_DTYPE)  # NaN past K
    padded[:, :k] = x8
    frame = torch.full((m + 8, n + 16), float("nan"), dtype=torch.bfloat16, device=dev)
    out = frame[:m, :n]
    blocks = GemmBlocks.parse(name)
    if m % 4:  # the A scale rows (stride M) are not 16-byte aligned: TMA cannot read them, the call must refuse
        try:
            fp8.fp8_gemm(a8=padded[:, :k], a_scales=xs, w8=w8, w_scales=ws, out=out, blocks=blocks)
        except ValueError as exc:
            return {"blocks": name, "M": m, "N": n, "K": k, "refused": str(exc)[-120:],
                    "ok": "a_scales needs a 16-byte aligned" in str(exc)}
        return {"blocks": name, "M": m, "N": n, "K": k, "refused": None, "ok": False}
    runs = []
    for _ in range(3):
        out.fill_(float("nan"))
        fp8.fp8_gemm(a8=padded[:, :k], a_scales=xs, w8=w8, w_scales=ws, out=out, blocks=blocks)
        torch.cuda.synchronize(dev)
        runs.append(out.clone())
    try:
        ref, reference = fp8.scaled_mm_reference(a8=x8, a_scales=xs, w8=w8, w_scales=ws).float(), "scaled_mm"
    except (ValueError, RuntimeError):  # K/128 not a multiple of 4 (or M = 1): cuBLAS refuses the scales
        ref = fp8.dequantize_activation(x8, xs) @ fp8.dequantize_weight(w8, ws).T
        reference = "dequantised fp32"
    # the same product from row-major scale rows padded to 4 (an AllGather pool's layout): bitwise equal
    rows = torch.full((m, fp8.padded_scale_groups(k)), float("nan"), device=dev)[:, :xs.shape[1]]
    rows.copy_(xs)
    out_rows = torch.full_like(out, float("nan"))
    fp8.fp8_gemm(a8=padded[:, :k], a_scales=rows, w8=w8, w_scales=ws, out=out_rows, blocks=blocks)
    torch.cuda.synchronize(dev)
    row = {"blocks": name, "M": m, "N": n, "K": k, "reference": reference,
           "row_major_scales_equal": torch.equal(out_rows, runs[0]),
           "nan_inside": int(torch.isnan(out).sum().item()),
           "written_outside": int((~torch.isnan(frame[:, n:])).sum().item()
                                  + (~torch.isnan(frame[m:, :n])).sum().item()),
           "repeatable": all(torch.equal(runs[0], r) for r in runs[1:])}
    diff = (out.float() - ref).abs()
    row["max_rel_err"] = (diff.max() / ref.abs().max().clamp_min(1e-30)).item()
    row["ok"] = (row["nan_inside"] == 0 and row["written_outside"] == 0 and row["repeatable"]
                 and row["row_major_scales_equal"] and row["max_rel_err"] <= MAX_REL_TOLERANCE)
    return row


def _fallback_case(m, n, k, gen, dev) -> dict:
    """fp8_gemm's own choice where the table names Gluon blocks but TMA cannot read the A scales (M % 4):
    the table's plain blocks run, and match the dequantised product."""
    import torch

    from tp_overlap.gemm import fp8

    table_choice = fp8.choose_fp8_blocks(m, n, k)
    x8, xs = fp8.quantize_activation(_grouped(m, k, 1, gen, dev))
    w8, ws = fp8.quantize_weight(_grouped(n, k, 128, gen, dev) * 0.05)
    out = fp8.fp8_gemm(a8=x8, a_scales=xs, w8=w8, w_scales=ws)
    ref = fp8.dequantize_activation(x8, xs) @ fp8.dequantize_weight(w8, ws).T
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    return {"fallback": True, "M": m, "N": n, "K": k, "table_blocks": table_choice.name, "max_rel_err": err,
            "ok": table_choice.gluon and err <= MAX_REL_TOLERANCE}


def _timed_case(layer, m, n, k, gen, dev, reps) -> dict:
    import torch

    from tp_overlap.launch.measure.timing import bench_interleaved
    from tp_overlap.gemm import fp8
    from tp_overlap.gemm.blocks import GemmBlocks

    a = torch.randn(m, k, generator=gen, device=dev).bfloat16()
    w = (torch.randn(n, k, generator=gen, device=dev) * 0.05).bfloat16()
    a8, a_scales = fp8.quantize_activation(a)
    w8, w_scales = fp8.quantize_weight(w)
    ref = fp8.scaled_mm_reference(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales)
    row = {"layer": layer, "M": m, "N": n, "K": k}
    out_bf16 = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    variants = {"cublas_bf16": lambda: torch.mm(a, w.t(), out=out_bf16),
                "scaled_mm": lambda: fp8.scaled_mm_reference(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales)}
    for name in TIMED_BLOCKS:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
        blocks = GemmBlocks.parse(name)
        fp8.fp8_gemm(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales, out=out, blocks=blocks)
        torch.cuda.synchronize(dev)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        row[f"{name}_max_rel_err"] = err
        if err <= MAX_REL_TOLERANCE:  # NaN fails too
            variants[name] = (lambda blk=blocks, o=out: fp8.fp8_gemm(a8=a8, a_scales=a_scales, w8=w8,
                                                                       w_scales=w_scales, out=o, blocks=blk))
    stats = bench_interleaved(variants, group=None, device=dev, warmup=3, reps=reps, hold_device_us=300.0)
    row.update({f"t_{name}_ms": s.median_ms for name, s in stats.items()})
    ours = {name: s.median_ms for name, s in stats.items() if name in TIMED_BLOCKS}
    if ours:
        best = min(ours, key=ours.get)
        row.update(best_blocks=best, t_best_ms=ours[best], best_over_scaled_mm=row["t_scaled_mm_ms"] / ours[best],
                   best_over_bf16=row["t_cublas_bf16_ms"] / ours[best],
                   tflops_best=2 * m * n * k / ours[best] / 1e9)
    return row


def _summary(timed: list[dict]) -> dict:
    ratios = [r["best_over_scaled_mm"] for r in timed if "best_over_scaled_mm" in r]
    big = [r["best_over_bf16"] for r in timed if "best_over_bf16" in r and r["M"] >= 4096]
    return {"over_scaled_mm_median": statistics.median(ratios) if ratios else None,
            "over_scaled_mm_min": min(ratios) if ratios else None,
            "over_bf16_min_at_m_ge_4096": min(big) if big else None, "timed_points": len(ratios)}


def child(args) -> int:
    import torch

    from tp_overlap.launch.measure.tune import FP8_CANDIDATES

    started = time.monotonic()
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    result = {"commit": os.environ.get("OVERLAP_GIT_COMMIT", "unknown"), "command": args.command,
              "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "correctness": [], "timed": [], "errors": [],
              "skipped": [], "finished": False}

    def write():
        result["summary"] = _summary(result["timed"])
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    def guarded(kind, label, fn):
        try:
            row = fn()
            result[kind].append(row)
            _log(f"{label}: {json.dumps(row)}")
        except Exception as exc:  # report, keep going with the next case
            traceback.print_exc()
            result["errors"].append({"case": label, "error": f"{type(exc).__name__}: {str(exc)[-600:]}"})
            _log(f"{label}: FAILED {type(exc).__name__}: {str(exc)[-300:]}")
        write()

    names = [name for name in FP8_CANDIDATES if name.endswith("gl")]
    for name in names:
        for m, n, k in CORRECTNESS_SHAPES:
            guarded("correctness", f"correctness {name} M={m} N={n} K={k}",
                    lambda name=name, m=m, n=n, k=k: _correctness_case(name, m, n, k, gen, dev))
    guarded("correctness", "fallback M=333 N=4096 K=1024", lambda: _fallback_case(333, 4096, 1024, gen, dev))
    for layer, k, n in tp2_shapes():
        for m in M_VALUES:
            if time.monotonic() - started > args.timing_seconds:
                result["skipped"].append({"layer": layer, "M": m, "N": n, "K": k})
                continue
            guarded("timed", f"timed {layer} M={m} N={n} K={k}",
                    lambda layer=layer, m=m, n=n, k=k: _timed_case(layer, m, n, k, gen, dev, 20))
            torch.cuda.empty_cache()
    result["finished"] = True
    write()
    bad = [r for r in result["correctness"] if not r["ok"]]
    s = result["summary"]
    _log(f"correctness: {len(result['correctness']) - len(bad)} of {len(result['correctness'])} ok, "
         f"{len(result['errors'])} errors; timed {s['timed_points']} points, Gluon / scaled_mm median "
         f"{s['over_scaled_mm_median']}, min {s['over_scaled_mm_min']}; / bf16 at M >= 4096 min "
         f"{s['over_bf16_min_at_m_ge_4096']}")
    return 1 if (bad or result["errors"] or not s["timed_points"]) else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tests.gpu.check_fp8_gluon", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="where to write the results (JSON)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="wall-time bound of the whole run (default 120)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timing-seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--command", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.max_seconds <= 10:
        p.error(f"--max-seconds must be > 10, got {args.max_seconds}")
    if args.child:
        return child(args)
    command = " ".join([os.path.basename(sys.executable), "-m", "tests.gpu.check_fp8_gluon"]
                       + list(argv if argv is not None else sys.argv[1:]))
    cmd = [sys.executable, "-m", "tests.gpu.check_fp8_gluon", "--child", "--json", args.json,
           "--max-seconds", str(args.max_seconds), "--timing-seconds", str(0.8 * args.max_seconds),
           "--command", command]
    _log(f"running {command} (bound {args.max_seconds:.0f} s)")
    try:
        return subprocess.run(cmd, timeout=args.max_seconds, check=False).returncode
    except subprocess.TimeoutExpired:
        _log(f"child still running after {args.max_seconds:.0f} s (a hung kernel?): killed")
        try:
            with open(args.json) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {"commit": os.environ.get("OVERLAP_GIT_COMMIT", "unknown"), "command": command}
        result["killed_after_s"] = args.max_seconds
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
