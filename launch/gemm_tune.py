"""Tune the persistent Triton GEMM's blocks on one GPU and write the block table that choose_blocks reads.

    python -m tp_overlap.launch.gemm_tune [--tp 2,4,8] [--m 1024,2048,4096,8192,16384] [--layouts kn,nk]
        [--time-budget-s 240] [--jobs N] [--resume] [--out-table FILE] [--out FILE]

Points: every local GEMM of docs/ARCHITECTURE.md's shape table (AG: K = H, N = N_total / W; RS: K =
K_total / W, N = H) at the given TP sizes and M, in both layouts of B (`kn`: row-major [K, N]; `nk`:
`w.t()` of a row-major [N, K], the nn.Linear layout), or the `--shapes` given.

Candidates: a short list per shape class (launch/measure/tune.py GEMM_CLASSES: few tiles -> smaller tiles, two
CTAs per SM, stream-K; short K -> flattened loops, warp specialisation, split epilogue; large -> 128x256
tiles and their variants), split-K where few 128x128 tiles meet a long K (SPLIT_K_CANDIDATES), stream-K
where 128x256 tiles leave a partial wave among one to three (STREAM_K_CANDIDATES), the current table's
choice and the hand heuristic; `--candidates` replaces the classes' lists.

Phases, all inside the wall-time bound `--time-budget-s`:

1. Compile: every (candidate, layout) runs once on a small shape in `--jobs` child processes at a time
   (launch/measure/canary.py; at most half the budget): compilation, not timing, dominates the run, and the
   compiled kernels land in Triton's cache, shared by every shape (all dimensions are multiples of 16, so
   they specialise alike). One that fails to compile, computes wrong numbers, crashes or hangs is dropped.
2. Sweep: points in launch/measure/tune.py's `tune_order` -- M = 1024 for every shape and layout, then 16384,
   4096, 2048, 8192 -- so that a run cut short has measured both ends of every shape first (the table
   answers an unmeasured M with the entry nearest in log2 M). Per point each candidate is checked against
   cuBLAS (`torch.mm`, same operands and layout; NaN-poisoned output, relative error <= 1e-2), then timed
   interleaved with cuBLAS: device time (the stream is held busy before each call), L2 flushed, median of
   `--reps`. A point whose estimated cost no longer fits the budget is skipped (listed in the JSON).
3. After every point the table (merged over `--merge-table`, by default the GPU's current table: points
   not measured keep their entries) and the results JSON are rewritten. `--resume` first reads both back
   (from `--out-table` and `--out`) and measures only the points they lack.

Progress lines go to stderr; the last lines give the median and minimum Triton/cuBLAS speed.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from tp_overlap.launch.cli.common import ArgumentParser, int_list, parse_shapes, require, run_dir, run_launcher

from .measure.canary import CANARY_SHAPE, DEFAULT_JOBS, operands, precompile
from .measure.tune import write_table

REL_TOLERANCE = 1e-2       # bf16 output against cuBLAS's (docs/MEASUREMENT.md)
COMPILE_SHARE = 0.5        # at most this share of the budget goes to compiling (running every configuration once)
PLAIN_PREFERENCE = 1.01    # the plain configuration wins unless the fastest is more than 1 % faster


def tune_points(tps, ms, shapes=()) -> list[tuple[int, int, int, list[str]]]:
    """Unique (m, n, k) over the AG and RS tables at each TP size (or the given `shapes`), in measuring
    order (launch/measure/tune.py tune_order), with their layer names."""
    from tp_overlap.launch.measure.tune import tune_order
    from tp_overlap.launch.cli.shapes import ag_points, rs_points

    layers: dict[tuple[int, int, int], list[str]] = {}
    for m, n, k in shapes:
        layers.setdefault((m, n, k), []).append("given")
    for world in tps if not shapes else ():
        for p in ag_points(world, ms=ms) + rs_points(world, ms=ms):
            layers.setdefault((p.m, p.n, p.k), []).append(f"{p.layer}@tp{world}")
    return tune_order([(m, n, k, names) for (m, n, k), names in layers.items()])


def make_parser() -> ArgumentParser:
    from tp_overlap.gemm import LAYOUTS

    p = ArgumentParser("python -m tp_overlap.launch.gemm_tune", description=__doc__)
    p.add_argument("--tp", type=int_list, default=(2, 4, 8), help="TP sizes whose local shapes are tuned")
    p.add_argument("--m", type=int_list, default=(1024, 2048, 4096, 8192, 16384), help="M values (rows)")
    p.add_argument("--layouts", type=lambda s: tuple(s.split(",")), default=LAYOUTS, help="B layouts, of kn,nk")
    p.add_argument("--candidates", type=lambda s: tuple(s.split(",")), default=None,
                   help="block configurations tried at every point (default: the shape class's list, "
                   "launch/measure/tune.py GEMM_CLASSES)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per variant and point (median)")
    p.add_argument("--hold-us", type=float, default=300.0, help="device hold before each timed call (0: none)")
    p.add_argument("--time-budget-s", type=float, default=240.0, help="wall-clock bound of the whole run")
    p.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help=f"child processes compiling at once (default: CPU cores - 2, 1 to 12: {DEFAULT_JOBS} here)")
    p.add_argument("--resume", action="store_true", help="keep the points already in --out and --out-table")
    p.add_argument("--out-table", default=None, help="default: runs/gemm_tune-<time>/<gpu>.yaml (copy it to "
                   "configs/gemm_blocks/<gpu>.yaml to use it)")
    p.add_argument("--merge-table", default=None, help="entries kept unless re-measured (default: the GPU's table)")
    p.add_argument("--out", default=None, help="results JSON (default: runs/gemm_tune-<time>/gemm_tune_<gpu>.json)")
    p.add_argument("--shapes", type=parse_shapes, default=(), help="MxNxK,... instead of the TP tables (default: the TP tables)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (the Triton interpreter: a smoke test)")
    p.add_argument("--canary-shape", type=lambda s: parse_shapes(s)[0], default=CANARY_SHAPE,
                   help="MxNxK of the compile phase's runs (default: %s)" % "x".join(map(str, CANARY_SHAPE)))
    return p


def _parse(argv):
    from tp_overlap.gemm import LAYOUTS, GemmBlocks

    args = make_parser().parse_args(argv)
    require(all(w >= 1 for w in args.tp), f"--tp: TP sizes must be >= 1, got {args.tp}")
    require(all(m >= 1 for m in args.m), f"--m: M values must be >= 1, got {args.m}")
    require(set(args.layouts) <= set(LAYOUTS), f"--layouts: got {args.layouts}; allowed: {', '.join(LAYOUTS)}")
    require(args.reps >= 1, f"--reps: got {args.reps}; allowed: >= 1")
    require(args.hold_us >= 0, f"--hold-us: got {args.hold_us}; allowed: >= 0")
    require(args.time_budget_s >= 0, f"--time-budget-s: got {args.time_budget_s}; allowed: >= 0")
    require(args.jobs >= 1, f"--jobs: got {args.jobs}; allowed: >= 1")
    require(args.device in ("cuda", "cpu"), f"--device: got {args.device!r}; allowed: cuda, cpu")
    require(args.device == "cuda" or bool(args.out_table and args.out), "--device cpu needs --out-table and --out")
    require(not args.resume or bool(args.out_table and args.out), "--resume needs --out-table and --out")
    for name in args.candidates or ():
        try:
            problems = GemmBlocks.parse(name).problems()
        except ValueError as exc:
            problems = [str(exc)]
        require(not problems, f"--candidates: {name}: {'; '.join(problems)}")
    return args


def main(argv=None) -> int:
    return run_launcher("tp_overlap.launch.gemm_tune", _parse, _run, argv)


def _run(args) -> int:
    import torch

    from tp_overlap.launch.cli.common import UsageError
    from tp_overlap.launch.output.report import device_slug
    from tp_overlap.launch.measure.timing import progress
    from tp_overlap.gemm import BlockTable, gpu_name, load_block_table, num_sms

    started = time.monotonic()
    deadline = started + args.time_budget_s
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("needs a CUDA GPU (or --device cpu with the Triton interpreter)")
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    gpu, sms = gpu_name(dev) or "cpu", num_sms(dev)
    folder = None if (args.out_table and args.out) else run_dir("gemm_tune")
    out_table = args.out_table or str(folder / f"{gpu}.yaml")
    out_json = args.out or str(folder / f"gemm_tune_{device_slug(device_name)}.json")
    base = load_block_table(path=args.merge_table) if args.merge_table else load_block_table(gpu)
    entries = {(e.layout, e.m, e.n, e.k): e for e in (base.entries if isinstance(base, BlockTable) else ())}
    rows, done = _resumed_state(out_table, out_json, entries) if args.resume else ([], set())
    sweep = _Sweep(args, dev, device_name, gpu, sms, out_table, out_json, entries, rows, started, deadline)
    sweep.source.update(torch=str(torch.__version__), triton=str(__import__("triton").__version__))
    work = [(m, n, k, names, layout) for (m, n, k, names) in tune_points(args.tp, args.m, args.shapes)
            for layout in args.layouts if (layout, m, n, k) not in done]
    progress(f"gemm_tune: {len(work)} points ({len(done)} kept from --resume), budget {args.time_budget_s:.0f} s, "
             f"table -> {out_table}")
    items = sorted({(name, layout) for m, n, k, _, layout in work for name in sweep.candidates(m, n, k, layout)})
    verdicts = precompile("bf16", items, started + COMPILE_SHARE * args.time_budget_s, jobs=args.jobs,
                          device=dev.type, shape=args.canary_shape)
    if not verdicts and items:  # the children themselves failed (see their tracebacks above): sweep without them
        progress("compile phase: no verdict at all, sweeping every configuration without it")
        verdicts = {key: "" for key in items}
    for key in items:
        reason = verdicts.get(key, "not reached within its share of the budget")
        if reason:
            sweep.failed[key] = "compile phase: " + reason
            progress(f"  {key[0]} ({key[1]}) dropped: {sweep.failed[key]}")
    progress(f"compile phase: {len(items) - len(sweep.failed)} of {len(items)} configurations ran correctly, "
             f"{time.monotonic() - started:.0f} s")
    for index, point in enumerate(work):
        sweep.run_point(*point, label=f"{index + 1}/{len(work)}")
    sweep.write()
    ratios = [r["best_over_cublas"] for r in sweep.rows]
    if ratios:
        print(f"gemm_tune: {len(sweep.rows)} points measured, {len(sweep.skipped)} skipped; Triton/cuBLAS speed "
              f"median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, >= 0.85 on "
              f"{sum(r >= 0.85 for r in ratios)}, {time.monotonic() - started:.0f} s")
    print(f"table: {out_table}\nresults: {out_json}")
    return 0 if sweep.rows else 1


def _resumed_state(out_table: str, out_json: str, entries: dict) -> tuple[list[dict], set]:
    """(rows, measured points) of an earlier run with the same outputs; its table's entries go into `entries`."""
    import json

    import yaml

    from tp_overlap.gemm import parse_block_table

    rows = json.loads(Path(out_json).read_text())["rows"] if Path(out_json).is_file() else []
    if Path(out_table).is_file():  # parsed here: load_block_table caches by path, and this file keeps changing
        table = parse_block_table(yaml.safe_load(Path(out_table).read_text()), Path(out_table).name)
        entries.update({(e.layout, e.m, e.n, e.k): e for e in table.entries})
    return rows, {(r["layout"], r["M"], r["N"], r["K"]) for r in rows}


class _Sweep:
    """The measuring phase: one point at a time, the table and the JSON rewritten after each."""

    def __init__(self, args, dev, device_name, gpu, sms, out_table, out_json, entries, rows, started, deadline):
        self.args, self.dev, self.device_name, self.gpu, self.sms = args, dev, device_name, gpu, sms
        self.out_table, self.out_json, self.entries, self.rows = out_table, out_json, entries, rows
        self.started, self.deadline = started, deadline
        self.failed: dict[tuple[str, str], str] = {}
        self.compile_s: dict[tuple[str, str], float] = {}
        self.skipped: list[dict] = []
        self.source = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d")}

    def candidates(self, m, n, k, layout) -> tuple[str, ...]:
        """The point's class list (or --candidates), the hand heuristic and the current table's choices."""
        from tp_overlap.launch.measure.tune import gemm_candidates
        from tp_overlap.gemm import heuristic_blocks

        current = self.entries.get((layout, m, n, k))
        extra = [heuristic_blocks(m, n, k).name] + ([current.blocks.name, current.plain.name] if current else [])
        if self.args.candidates:
            return tuple(dict.fromkeys(self.args.candidates + tuple(extra)))
        return gemm_candidates(m, n, k, self.sms, extra)

    def run_point(self, m, n, k, names, layout, *, label: str) -> None:
        from tp_overlap.launch.measure.tune import point_seconds, shape_class
        from tp_overlap.launch.measure.timing import progress
        from tp_overlap.gemm import PLAIN_BLOCK_M, BlockTableEntry, GemmBlocks, heuristic_blocks

        tried = [c for c in self.candidates(m, n, k, layout) if (c, layout) not in self.failed]
        point = {"layout": layout, "M": m, "N": n, "K": k}
        estimate = point_seconds(m, n, k, len(tried) + 1, self.args.reps)
        if not tried or time.monotonic() + estimate > self.deadline:
            self.skipped.append({**point, "estimate_s": round(estimate, 2),
                                 "reason": "no candidate left" if not tried else "budget"})
            return
        times = self._measure(m, n, k, layout, tried)
        if times is None:
            self.skipped.append({**point, "reason": "no candidate ran correctly"})
            return
        t_cublas = times.pop("cublas")
        best = min(times, key=times.get)
        # what flag-waiting callers can run: plain, 128-row tiles, one program per SM
        plains = [nm for nm, b in ((nm, GemmBlocks.parse(nm)) for nm in times)
                  if b.plain and b.block_m == PLAIN_BLOCK_M and b.programs_per_sm == 1]
        plain = min(plains, key=times.get) if plains else None
        if plain is not None and times[plain] <= times[best] * PLAIN_PREFERENCE:
            best = plain
        plain_blocks = GemmBlocks.parse(plain) if plain else heuristic_blocks(m, n, k, warp_specialize=False)
        self.entries[(layout, m, n, k)] = BlockTableEntry(
            layout, m, n, k, GemmBlocks.parse(best), plain_blocks, t_cublas / times[best],
            t_cublas / times[plain] if plain else None)
        heuristic = heuristic_blocks(m, n, k).name
        self.rows.append({"layers": names, **point, "class": shape_class(m, n, k, self.sms), "t_cublas_ms": t_cublas,
                          "best": best, "t_best_ms": times[best], "best_over_cublas": t_cublas / times[best],
                          "plain": plain, "t_plain_ms": times.get(plain), "heuristic": heuristic,
                          "heuristic_over_cublas": t_cublas / times[heuristic] if heuristic in times else None,
                          "tflops_best": 2 * m * n * k / times[best] / 1e9, "times_ms": times})
        self.write()
        progress(f"gemm_tune {label} {layout} M={m} N={n} K={k}: cuBLAS {t_cublas:.4f} ms, {best} "
                 f"{times[best]:.4f} ms ({t_cublas / times[best]:.3f}x), {time.monotonic() - self.started:.0f} s")

    def _measure(self, m, n, k, layout, names) -> dict[str, float] | None:
        """Median times (ms) of cuBLAS and of every candidate that computes the right numbers."""
        import torch

        from tp_overlap.launch.measure.timing import bench_interleaved, progress
        from tp_overlap.gemm import GemmBlocks, release_workspaces, triton_mm

        a, b = operands(m, n, k, layout, self.dev, seed=m + n + k)
        ref = torch.mm(a, b)
        outs, usable = {}, {}
        for name in names:
            blocks = GemmBlocks.parse(name)
            out = torch.full_like(ref, float("nan"))
            start = time.perf_counter()
            try:
                triton_mm(a, b, out, blocks=blocks)
                if self.dev.type == "cuda":
                    torch.cuda.synchronize(self.dev)
            except Exception as exc:  # a compile error or OutOfResources: drop it for this layout
                self.failed[(name, layout)] = f"{type(exc).__name__}: {str(exc).strip()[-160:]}"
                progress(f"  {name} ({layout}) dropped: {self.failed[(name, layout)]}")
                continue
            self.compile_s.setdefault((name, layout), time.perf_counter() - start)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err <= REL_TOLERANCE:
                self.failed[(name, layout)] = f"relative error {err:.3g} vs cuBLAS at M={m} N={n} K={k}"
                progress(f"  {name} ({layout}) dropped: {self.failed[(name, layout)]}")
                continue
            outs[name], usable[name] = out, blocks
        if not usable:
            return None
        out_c = torch.empty_like(ref)
        variants = {"cublas": lambda: torch.mm(a, b, out=out_c)}
        variants.update({name: (lambda blk=blk, o=outs[name]: triton_mm(a, b, o, blocks=blk))
                         for name, blk in usable.items()})
        stats = bench_interleaved(variants, group=None, device=self.dev, warmup=2, reps=self.args.reps,
                                  hold_device_us=self.args.hold_us)
        release_workspaces()  # one per (shape, configuration): a sweep would keep hundreds
        return {name: s.median_ms for name, s in stats.items()}

    def write(self) -> None:
        from tp_overlap.launch.output.report import write_results

        write_table(self.out_table, self.entries, gpu=self.gpu, num_sms_=self.sms, source=self.source)
        ratios = [r["best_over_cublas"] for r in self.rows]
        summary = {"measured": len(self.rows), "skipped": len(self.skipped),
                   "elapsed_s": round(time.monotonic() - self.started, 1),
                   "median_over_cublas": statistics.median(ratios) if ratios else None,
                   "min_over_cublas": min(ratios) if ratios else None}
        write_results(self.out_json, self.rows, device=self.device_name, tp=0, extra={
            "op": "gemm_tune", "tp_sizes": list(self.args.tp), "hold_device_us": self.args.hold_us,
            "reps": self.args.reps, "time_budget_s": self.args.time_budget_s, "summary": summary,
            "skipped": self.skipped,
            "first_call_s": {f"{n}/{layout}": round(s, 2) for (n, layout), s in self.compile_s.items()},
            "failed": {f"{n}/{layout}": why for (n, layout), why in self.failed.items()}})


if __name__ == "__main__":
    sys.exit(main())
