"""k-factor sweeps under torchrun: measure every overlap, sweep the SM partition, gate, plot, write a preset.

    torchrun --standalone --nproc-per-node 2 -m launch.kfactor [--ops ag_gemm,gemm_rs,regimes]
        [--shapes 4096x4096x3072,...] [--tokens 1024,4096] [--layers llama8b.qkv,...]
        [--sweep method=decomposed,fused --sweep sm_margin=0,8,16 --sweep chunks_per_rank=1,2]
        [--max-k 1.15] [--gate all|best] [--write-config tuned.yaml] [--out-dir DIR]

Ops: `ag_gemm` and `gemm_rs` are swept over the grid (one row per shape x config, definitions of solo and
overlapped in launch/k_factor.py); `regimes` measures the seed's two regimes on the AG shapes: our
copy-engine AllGather ("ce") and the collective ("nccl", gloo on CPU) each next to the shape's GEMM
("gemm", compute-bound) and next to an RMSNorm over the gathered [M, H] repeated to last about as long
as the CE gather ("membound").

--sweep KEY=V1,V2 (repeatable; keys method, sm_margin, chunks_per_rank, num_comm_sms, lead_fraction (AG decomposed only); a token holding '='
starts a new key, so `--sweep sm_margin=0,8,chunks_per_rank=1,2` also works). A method applies only to
the ops that have it (`method=decomposed,fused,epilogue_reduce` sweeps epilogue_reduce for gemm_rs only). Keys not swept keep the
preset's value; for gemm_rs num_comm_sms follows sm_margin (the reduction runs on the reserved SMs) and
chunks_per_rank is not used. Shapes: the table of launch/shapes.py at the job's TP size on GPUs, tiny ones on CPU
(M = 256, 512; K = N = 64), or --shapes MxKxN (K, N local to a rank; applies to every op).

Gate: exit status 1, naming op, shape, config and k, when a k_comm or k_comp of an op row exceeds --max-k
(`--gate best`: only the configs written to the preset). The default gate is 1.15 on GPUs; on CPU there is
none unless --max-k is given (CPU k values are host-scheduling noise: GIL hand-overs, 1 ms wait back-off).
--inject-comm-delay-ms is a test aid: the comm path sleeps (CPU) or spins (CUDA) that long, only during
overlapped steps.

Writes (rank 0) into --out-dir (default: a new run folder runs/kfactor-<UTC time>/; results of record:
--out-dir results): kfactor_<gpu>_tp<W>.json, .png (k_comm, k_comp, E vs sm_margin per shape),
_timeline.png (per-stream Gantt of one overlapped step per op) and _<op>.trace.json (Chrome trace of that
step). On CPU (gloo + host pool, comm on a thread next to torch.mm) the numbers only exercise the path: a
functional check, labelled so in the table (`run_kind`) and above it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import threading
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from overlap import envs
from overlap.ag_gemm import AgGemm
from overlap.config import METHODS, ConfigError, OverlapConfig
from overlap.presets import dump_config, load_config, load_preset, to_dict
from overlap.gemm_rs import GemmRs
from launch.k_factor import (LATE_START_MS, inject_comm_delay, k_from_trace, measure, measure_pair, op_pair,
                             trace_op)
from launch._timeline import step_timeline
from overlap.reference import ag_gemm_reference, gemm_rs_reference
from launch.report import device_slug, format_table, run_labels, write_results
from launch.shapes import CPU_K, CPU_M_VALUES, CPU_N, M_VALUES, ShapePoint, ag_points, rs_points
from launch.timing import bench_interleaved, progress
from symm_mem import SymmetricPool

from . import _dist
from ._cli import ArgumentParser, UsageError, int_list, require, run_dir, run_launcher
from ._tune import best_configs, config_row, gate_failures, tuned_config

PROG = "launch.kfactor"
OPS = ("ag_gemm", "gemm_rs", "regimes")
SWEEP_KEYS = {"method": str, "sm_margin": int, "chunks_per_rank": int, "num_comm_sms": int, "lead_fraction": float}
GPU_GRID = {"method": ("decomposed", "fused"), "sm_margin": (0, 8, 16, 32), "chunks_per_rank": (1, 2)}
CPU_GRID = {"sm_margin": (0, 8), "chunks_per_rank": (1, 2)}
GPU_MAX_K = 1.15
MAX_MEMBOUND_PASSES = 256
COLUMNS = ["run_kind", "op", "layer", "M", "K", "N", "method", "sm_margin", "chunks_per_rank", "comm", "comp",
           "t_comm_solo_ms", "t_comp_solo_ms", "k_comm", "k_comp", "E", "hidden_comm", "t_op_ms", "E_op"]


def parse_sweep(items: list[str] | None) -> dict[str, tuple]:
    """['sm_margin=0,8', 'chunks_per_rank=1,2'] (or one item 'sm_margin=0,8,chunks_per_rank=1,2') -> grid."""
    grid: dict[str, list] = {}
    key = None
    for token in (t.strip() for item in items or [] for t in item.split(",")):
        if "=" in token:
            key, token = (s.strip() for s in token.split("=", 1))
            if key not in SWEEP_KEYS:
                raise ValueError(f"--sweep: unknown key {key!r}; allowed: {', '.join(SWEEP_KEYS)}")
            if key in grid:
                raise ValueError(f"--sweep: key {key!r} given twice")
            grid[key] = []
        if key is None:
            raise ValueError(f"--sweep: {token!r} has no KEY= in front (write KEY=V1,V2)")
        if token:
            try:
                grid[key].append(SWEEP_KEYS[key](token))
            except ValueError:
                kind = "an int" if SWEEP_KEYS[key] is int else "a number"
                raise ValueError(f"--sweep: {key}={token!r} is not {kind}") from None
    for k, values in grid.items():
        if not values:
            raise ValueError(f"--sweep: {k}= has no values")
    return {k: tuple(dict.fromkeys(v)) for k, v in grid.items()}


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--config", default=None, help="base YAML preset (default: auto-selected by GPU and TP)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--shapes", default=None, help="MxKxN,... (K, N local) instead of the shape table")
    p.add_argument("--tokens", dest="m", type=int_list, default=None, metavar="M[,M...]",
                   help="M values of the shape table (default: 1024,4096,16384 on GPU; 256,512 on CPU)")
    p.add_argument("--m", dest="m", type=int_list, default=None, help=argparse.SUPPRESS)  # the old name
    p.add_argument("--layers", default=None, help="layer names of the shape table (comma-separated; default: all)")
    p.add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2",
                   help="grid axis, repeatable (default: GPU method=decomposed,fused sm_margin=0,8,16,32 "
                        "chunks_per_rank=1,2; CPU sm_margin=0,8 chunks_per_rank=1,2)")
    p.add_argument("--max-k", type=float, default=None,
                   help=f"gate: largest allowed k_comm and k_comp (default: {GPU_MAX_K} on GPU, no gate on CPU)")
    p.add_argument("--gate", choices=("all", "best"), default="all", help="op rows the gate checks")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement")
    p.add_argument("--warmup", type=int, default=3, help="warm-up repetitions per measurement")
    p.add_argument("--out-dir", default=None, help="where JSON, PNGs and the Chrome traces go (default: a new "
                   "run folder runs/kfactor-<UTC time>/; results of record only with --out-dir results)")
    p.add_argument("--write-config", default=None, metavar="PATH", help="write the tuned YAML preset here")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs and the Chrome trace")
    p.add_argument("--inject-comm-delay-ms", type=float, default=0.0,
                   help="test aid: slow the comm path by this much, only while compute runs")
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo even if GPUs are present")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = make_parser()
    args = p.parse_args(argv)
    try:
        args.grid = parse_sweep(args.sweep)
    except ValueError as exc:
        p.error(str(exc))
    args.ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in args.ops if o not in OPS]
    if bad or not args.ops:
        p.error(f"--ops: unknown {bad}; allowed: {', '.join(OPS)}")
    if args.reps < 1 or args.warmup < 0:
        p.error(f"--reps must be > 0 and --warmup >= 0, got {args.reps} and {args.warmup}")
    if args.max_k is not None and not args.max_k > 0:
        p.error(f"--max-k must be > 0, got {args.max_k}")
    return args


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(x) for x in text.split("x"))
    except ValueError:
        raise UsageError(f"--shapes: expected MxKxN (three integers), got {text!r}") from None
    return m, k, n


def points_for(args, op: str, world: int, cuda: bool) -> list[ShapePoint]:
    shape_op = "gemm_rs" if op == "gemm_rs" else "ag_gemm"
    if args.shapes:
        pts = [ShapePoint("custom", shape_op, *_shape(s)) for s in args.shapes.split(",") if s]
    elif cuda:
        layers = args.layers.split(",") if args.layers else None
        table = rs_points if op == "gemm_rs" else ag_points
        pts = table(world, ms=args.m or M_VALUES, layers=layers)
    else:
        pts = [ShapePoint("cpu.tiny", shape_op, m, CPU_K, CPU_N) for m in args.m or CPU_M_VALUES]
    require(pts, f"no {op} shape selected (--layers / --shapes)")
    for pt in pts:
        require(min(pt.m, pt.k, pt.n) > 0, f"M, K and N must be > 0, got {pt.m}x{pt.k}x{pt.n}")
        require(pt.m % world == 0, f"M={pt.m} is not divisible by the TP size {world}")
    return pts


def configs_for(op: str, base_cfg: OverlapConfig, grid: dict, cuda: bool, num_sms: int | None) -> list:
    base = getattr(base_cfg, op).default
    axes = dict(grid)
    out = []
    for values in itertools.product(*axes.values()):
        fields = dict(zip(axes, values))
        if fields.get("method", base.method) not in METHODS[op]:
            continue   # a method of the other op (e.g. epilogue_reduce in a sweep over both ops)
        if fields.get("lead_fraction") and (op, fields.get("method", base.method)) != ("ag_gemm", "decomposed"):
            continue   # a lead GEMM exists only for the decomposed AG consumer
        fields = {k: v for k, v in fields.items() if hasattr(base, k)}  # e.g. chunks_per_rank: AG only
        method = fields.pop("method", base.method)
        if op == "gemm_rs" and method == "fused" and "sm_margin" in fields:
            if fields["sm_margin"] < 1:
                continue   # fused runs its reduction on reserved SMs
            fields.setdefault("num_comm_sms", fields["sm_margin"])
        try:
            cfg = base.with_method(method, **fields)
            cfg.validate(num_sms=num_sms)
        except ConfigError:
            continue   # a combination the method cannot run (e.g. pair at W != 2 is dropped by the op)
        if cfg not in out:
            out.append(cfg)
    if not out:
        raise UsageError(f"no swept method applies to {op} (allowed: {', '.join(METHODS[op])})")
    return out


class _Bar:
    def __init__(self, total: int, rank: int):
        self.total, self.done, self.rank = total, 0, rank

    def step(self, label: str) -> None:
        self.done += 1
        filled = round(20 * self.done / max(self.total, 1))
        progress(f"[{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} {label}", rank=self.rank)


def _randn(gen, *shape, scale=1.0, dtype, device):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def _rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def sweep_point(ctx, op_name: str, point: ShapePoint, configs: list, env: dict, *, capture: bool) -> tuple:
    """Rows of one shape point (one per config) and, if `capture`, the timeline of the best config."""
    world, dev, dtype = ctx.world_size, ctx.device, torch.bfloat16
    m, k, n = point.m, point.k, point.n
    gen = torch.Generator().manual_seed(31 + ctx.rank + m + k + n)
    ag = op_name == "ag_gemm"
    inputs = (_randn(gen, m // world if ag else m, k, dtype=dtype, device=dev),
              _randn(gen, k, n, scale=k ** -0.5, dtype=dtype, device=dev))
    region = 2 * m * (k if ag else n) * dtype.itemsize + 4096
    rows, timeline = [], None
    with SymmetricPool((len(configs) + 1) * region + (1 << 20), group=ctx.group, device=dev,
                       timeout_s=envs.timeout_s()) as pool:
        cls, dims = (AgGemm, {"k": k, "n_local": n}) if ag else (GemmRs, {"k_local": k, "n": n})
        ops = [cls(group=ctx.group, pool=pool, max_m=m, dtype=dtype, config=c, name=f"kf_{op_name}{i}", **dims)
               for i, c in enumerate(configs)]
        ref = ag_gemm_reference(*inputs, group=ctx.group)[1] if ag else gemm_rs_reference(*inputs, group=ctx.group)
        for cfg, op in zip(configs, ops):   # correctness before timing (and every kernel compiled on every rank)
            if ag:
                out, a = op(*inputs, return_gathered=True)
                if not torch.equal(a, ref):
                    raise RuntimeError(f"{op_name} {point.layer} M={m} {cfg}: the gathered a is not bit-exact")
                err = _rel_err(out, ref.float() @ inputs[1].float())
            else:
                err = _rel_err(op(*inputs), ref)
            if err > 1e-2:
                raise RuntimeError(f"{op_name} {point.layer} M={m} {cfg}: relative error {err:.3g} > 1e-2")
        for cfg, op in zip(configs, ops):
            kf = measure(op, inputs, reps=env["reps"], warmup=env["warmup"], overlap_flag=env["flag"],
                         wrap_comm=env["wrap"])
            row = {"op": op_name, "layer": point.layer, "M": m, "K": k, "N": n,
                   **config_row(cfg), **kf.as_row()}
            # the op's own call: its lane spans (the same definition as launch.bench and launch.tp_mlp)
            own = k_from_trace(trace_op(op, inputs, reps=min(env["reps"], 10)), t_comm_solo=kf.t_comm_solo,
                               t_comp_solo=kf.t_comp_solo)
            row.update(k_comm_op=own.k_comm, k_comp_op=own.k_comp)
            rows.append(row)
            late = "" if (kf.start_late_ms or 0) <= LATE_START_MS else \
                f" (a side started {kf.start_late_ms:.3f} ms late: launch-bound, not contention)"
            env["bar"].step(f"{op_name} {point.layer} M={m} {cfg.method} sm_margin={cfg.sm_margin} "
                            f"chunks={getattr(cfg, 'chunks_per_rank', '-')}: k_comm {kf.k_comm:.3f} k_comp {kf.k_comp:.3f}{late}")
        if capture:
            best = min(range(len(ops)), key=lambda i: rows[i]["t_op_ms"])
            pair = op_pair(ops[best], inputs)
            path = env["trace_path"](op_name) if ctx.rank == 0 else None
            lanes = step_timeline(pair.comm, pair.comp, device=dev, group=ctx.group, lanes=pair.lanes,
                                  profile_path=path)
            timeline = (f"{op_name} {point.layer} M={m} K={k} N={n} ({configs[best].method}, sm_margin="
                        f"{configs[best].sm_margin}, chunks_per_rank={getattr(configs[best], 'chunks_per_rank', '-')})", lanes)
        for op in ops:
            op.close()
        pool.barrier()
    return rows, timeline


def _rmsnorm_passes(x, weight, passes: int) -> None:
    for _ in range(passes):
        torch.nn.functional.rms_norm(x, (x.shape[1],), weight=weight, eps=1e-6)


def regimes_point(ctx, point: ShapePoint, base_cfg: OverlapConfig, env: dict) -> list[dict]:
    """CE AllGather and the collective, each next to the GEMM and next to a memory-bound pass."""
    world, dev, dtype = ctx.world_size, ctx.device, torch.bfloat16
    m, k, n = point.m, point.k, point.n
    gen = torch.Generator().manual_seed(53 + ctx.rank + m)
    a_shard = _randn(gen, m // world, k, dtype=dtype, device=dev)
    w = _randn(gen, k, n, scale=k ** -0.5, dtype=dtype, device=dev)
    cfg = dataclasses.replace(base_cfg.ag_gemm.default, method="decomposed", chunks_per_rank=1)
    rows = []
    with SymmetricPool(2 * m * k * dtype.itemsize + (1 << 20), group=ctx.group, device=dev,
                       timeout_s=envs.timeout_s()) as pool:
        op = AgGemm(group=ctx.group, pool=pool, max_m=m, k=k, n_local=n, dtype=dtype, config=cfg, name="kf_regime")
        gathered = op.all_gather(a_shard).clone()
        out, gather_buf = torch.empty(m, n, dtype=dtype, device=dev), torch.empty_like(gathered)
        norm_w = torch.ones(k, dtype=dtype, device=dev)
        coll = dist.get_backend(ctx.group)
        comms = {"ce": lambda: op.all_gather(a_shard),
                 coll: lambda: dist.all_gather_into_tensor(gather_buf, a_shard, group=ctx.group)}
        # One norm pass is far shorter than the gather: repeat it so that it covers the CE gather.
        calib = bench_interleaved({"ce": comms["ce"], "norm": partial(_rmsnorm_passes, gathered, norm_w, 1)},
                                  group=ctx.group, device=dev, warmup=2, reps=5)
        passes = max(1, min(MAX_MEMBOUND_PASSES, round(calib["ce"].median_ms / calib["norm"].median_ms)))
        comps = {"gemm": lambda: torch.mm(gathered, w, out=out),
                 "membound": partial(_rmsnorm_passes, gathered, norm_w, passes)}
        for (comm_name, comm), (comp_name, comp) in itertools.product(comms.items(), comps.items()):
            comm = env["wrap"](comm) if env["wrap"] else comm
            kf = measure_pair(comm, comp, device=dev, group=ctx.group, reps=env["reps"], warmup=env["warmup"],
                              overlap_flag=env["flag"])
            rows.append({"op": "ag_regime", "layer": point.layer, "M": m, "K": k, "N": n, "comm": comm_name,
                         "comp": comp_name, "membound_passes": passes if comp_name == "membound" else None,
                         **kf.as_row()})
            env["bar"].step(f"regimes {point.layer} M={m} {comm_name} + {comp_name}: k_comm {kf.k_comm:.3f} "
                            f"k_comp {kf.k_comp:.3f}")
        op.close()
        pool.barrier()
    return rows


def _write_outputs(args, ctx, rows, timelines, failures, best, base_cfg, stem: Path, num_sms, labels) -> None:
    files = {}
    if not args.no_plots:
        from . import _plots
        files["plot"] = str(_plots.plot_sweep([r for r in rows if r["op"] != "ag_regime"], stem.with_suffix(".png"),
                                              max_k=args.max_k, title=stem.name))
        files["timeline"] = str(_plots.plot_timeline([t for _, t in timelines],
                                                     stem.parent / f"{stem.name}_timeline.png"))
        files["traces"] = [str(stem.parent / f"{stem.name}_{op}.trace.json") for op, _ in timelines]
    if args.write_config:
        cfg = tuned_config(base_cfg, best, device_name=ctx.device_name, world=ctx.world_size, num_sms=num_sms)
        header = (f"Tuned by launch.kfactor on {ctx.device_name}, TP{ctx.world_size}: per op and M bucket the\n"
                  f"(method, sm_margin, chunks_per_rank) with the lowest measured op time; data {stem.name}.json")
        dump_config(cfg, args.write_config, header=header)
        loaded = load_config(args.write_config)
        if to_dict(loaded) != to_dict(cfg):
            raise RuntimeError(f"{args.write_config}: the written preset does not load back identically")
        files["config"] = args.write_config
    extra = {"kind": "kfactor", "max_k": args.max_k, "gate": args.gate, "gate_failures": failures,
             "grid": {k: list(v) for k, v in args.effective_grid.items()}, "reps": args.reps, "warmup": args.warmup,
             "inject_comm_delay_ms": args.inject_comm_delay_ms, "best": best, "files": files,
             "run_kind": labels.kind, "run_notes": labels.header}
    write_results(stem.with_suffix(".json"), rows, device=ctx.device_name, tp=ctx.world_size, extra=extra)
    print(format_table(rows, COLUMNS))
    print(f"wrote {stem.with_suffix('.json')}" + "".join(f", {v}" for v in files.values() if isinstance(v, str)))


def _run(args) -> int:
    where = _dist.placement(force_cpu=args.cpu)
    cuda = where.device.type == "cuda"
    _dist.check_ranks(PROG, where, 2)
    base_cfg = load_config(args.config) if args.config else load_preset(where.device_name, where.world_size)
    base_cfg.check_world_size(where.world_size)
    num_sms = torch.cuda.get_device_properties(where.device).multi_processor_count if cuda else None
    plan = [(op, points_for(args, op, where.world_size, cuda)) for op in args.ops]
    args.effective_grid = dict(args.grid or (GPU_GRID if cuda else CPU_GRID))
    configs = {op: configs_for(op, base_cfg, args.effective_grid, cuda, num_sms)
               for op in args.ops if op != "regimes"}
    if args.max_k is None and cuda:
        args.max_k = GPU_MAX_K
    labels = run_labels(where.device.type, where.world_size)
    gate_note = None if args.max_k is not None else (
        "k-factor gate: off (CPU k values are host-scheduling noise, not contention; --max-k K applies one)")
    for line in labels.header + ([gate_note] if gate_note else []):
        progress(line, rank=where.rank)
    with _dist.job(PROG, where=where) as ctx:
        if not cuda:
            torch.set_num_threads(1)   # 2+ ranks x 2 threads each already fill a small CI machine
        stem = None
        if ctx.rank == 0:  # only rank 0 writes
            out_dir = Path(args.out_dir) if args.out_dir else run_dir("kfactor")
            out_dir.mkdir(parents=True, exist_ok=True)
            stem = out_dir / f"kfactor_{device_slug(ctx.device_name)}_tp{ctx.world_size}"
        flag = threading.Event()
        wrap = (partial(inject_comm_delay, delay_ms=args.inject_comm_delay_ms, active=flag, device=ctx.device)
                if args.inject_comm_delay_ms > 0 else None)
        total = sum(len(pts) * (4 if op == "regimes" else len(configs[op])) for op, pts in plan)
        env = {"reps": args.reps, "warmup": args.warmup, "flag": flag, "wrap": wrap, "bar": _Bar(total, ctx.rank),
               "trace_path": lambda op: str(stem.parent / f"{stem.name}_{op}.trace.json")}
        rows, timelines = [], []
        for op, pts in plan:
            for i, point in enumerate(pts):
                if op == "regimes":
                    rows += regimes_point(ctx, point, base_cfg, env)
                    continue
                new, timeline = sweep_point(ctx, op, point, configs[op], env,
                                            capture=not args.no_plots and i == len(pts) - 1)
                rows += new
                if timeline:
                    timelines.append((op, timeline))
        rows = [{"run_kind": labels.kind} | row for row in rows]
        best = best_configs(rows)
        failures = gate_failures(rows, args.max_k, best if args.gate == "best" else None) \
            if args.max_k is not None else []
        if ctx.rank == 0:
            for line in labels.header + ([gate_note] if gate_note else []):
                print(line)
            _write_outputs(args, ctx, rows, timelines, failures, best, base_cfg, stem, num_sms, labels)
            for message in failures:
                print(f"k-factor gate: {message}", file=sys.stderr)
        dist.barrier(group=ctx.group)   # torchrun stops every rank once one exits non-zero: rank 0 writes first
        return 1 if failures else 0


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
