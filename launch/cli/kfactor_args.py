"""`tp_overlap.launch.kfactor`'s command line: its options, the sweep grid, and the shapes and configs of a run, all checked
before any process group or pool exists (a UsageError: one line, the same on every rank)."""

from __future__ import annotations

import argparse
import itertools
from types import SimpleNamespace

import torch

from tp_overlap.config.schema import METHODS, ConfigError, OverlapConfig
from tp_overlap.config.presets import load_config, load_preset
from tp_overlap.launch.cli.shapes import (AG_LAYERS, CPU_K, CPU_M_VALUES, CPU_N, M_VALUES, RS_LAYERS, ShapePoint,
                                          ag_points, rs_points)

from . import dist as _dist
from .common import ArgumentParser, UsageError, distinct, input_file, int_list, output_dir, output_file, require
from .limits import require_fits

PROG = "tp_overlap.launch.kfactor"
OPS = ("ag_gemm", "gemm_rs", "regimes")
SWEEP_KEYS = {"method": str, "sm_margin": int, "chunks_per_rank": int, "num_comm_sms": int, "lead_fraction": float}
GPU_GRID = {"method": ("decomposed", "fused"), "sm_margin": (0, 8, 16, 32), "chunks_per_rank": (1, 2)}
CPU_GRID = {"sm_margin": (0, 8), "chunks_per_rank": (1, 2)}
GPU_MAX_K = 1.15


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


def make_parser(description: str | None = None) -> ArgumentParser:
    p = ArgumentParser(PROG, description=description)
    p.add_argument("--config", type=input_file, default=None,
                   help="base YAML preset (default: auto-selected by GPU and TP)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--shapes", default=None,
                   help="MxKxN,... (K, N local) instead of the shape table (default: the table)")
    p.add_argument("--tokens", dest="m", type=int_list, default=None, metavar="M[,M...]",
                   help="M values of the shape table (default: 1024,4096,16384 on GPU; 256,512 on CPU)")
    p.add_argument("--m", dest="m", type=int_list, default=None, help=argparse.SUPPRESS)  # the old name
    p.add_argument("--layers", default=None,
                   help="layer names of the shape table, comma-separated (default: every layer on GPU; on CPU "
                        "tiny shapes unless given)")
    p.add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2",
                   help="grid axis, repeatable (default: GPU method=decomposed,fused sm_margin=0,8,16,32 "
                        "chunks_per_rank=1,2; CPU sm_margin=0,8 chunks_per_rank=1,2)")
    p.add_argument("--max-k", type=float, default=None,
                   help=f"gate: largest allowed k_comm and k_comp (default: {GPU_MAX_K} on GPU, no gate on CPU)")
    p.add_argument("--gate", choices=("all", "best"), default="all", help="op rows the gate checks")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement")
    p.add_argument("--warmup", type=int, default=3, help="warm-up repetitions per measurement")
    p.add_argument("--out-dir", type=output_dir, default=None,
                   help="where JSON, PNGs and the Chrome traces go (default: a new run folder "
                        "runs/kfactor-<UTC time>/; results of record only with --out-dir results)")
    p.add_argument("--write-config", type=output_file, default=None, metavar="PATH",
                   help="write the tuned YAML preset here (default: none written)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs and the Chrome trace")
    p.add_argument("--inject-comm-delay-ms", type=float, default=0.0,
                   help="test aid: slow the comm path by this much, only while compute runs")
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo even if GPUs are present")
    return p


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    p = make_parser(description)
    args = p.parse_args(argv)
    try:
        args.grid = parse_sweep(args.sweep)
    except ValueError as exc:
        p.error(str(exc))
    args.ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in args.ops if o not in OPS]
    if bad or not args.ops:
        p.error(f"--ops: unknown {', '.join(map(repr, bad)) or 'empty list'}; allowed: {', '.join(OPS)}")
    distinct("--ops", args.ops, "op")
    if args.reps < 1 or args.warmup < 0:
        p.error(f"--reps must be > 0 and --warmup >= 0, got {args.reps} and {args.warmup}")
    if args.max_k is not None and not args.max_k > 0:
        p.error(f"--max-k must be > 0, got {args.max_k}")
    if not args.inject_comm_delay_ms >= 0:
        p.error(f"--inject-comm-delay-ms must be >= 0, got {args.inject_comm_delay_ms}")
    return args


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(x) for x in text.split("x"))
    except ValueError:
        raise UsageError(f"--shapes: expected MxKxN (three integers), got {text!r}") from None
    return m, k, n


def _layers(args) -> list[str] | None:
    if not args.layers:
        return None
    layers = [name for name in args.layers.split(",") if name]
    known = sorted({*AG_LAYERS, *RS_LAYERS})
    unknown = [name for name in layers if name not in known]
    require(not unknown, f"--layers: unknown {', '.join(unknown)}; the shape table has {', '.join(known)}")
    distinct("--layers", layers, "layer")
    return layers


def points_for(args, op: str, world: int, cuda: bool) -> list[ShapePoint]:
    shape_op = "gemm_rs" if op == "gemm_rs" else "ag_gemm"
    layers = _layers(args)
    if args.shapes:
        pts = [ShapePoint("custom", shape_op, *_shape(s)) for s in args.shapes.split(",") if s]
        require(pts, f"--shapes: expected MxKxN[,MxKxN...], got {args.shapes!r}")
        distinct("--shapes", [f"{p.m}x{p.k}x{p.n}" for p in pts], "shape")
    elif cuda or layers:
        table = rs_points if op == "gemm_rs" else ag_points
        pts = table(world, ms=args.m or M_VALUES, layers=layers)
    else:   # CPU: tiny shapes (the table's take minutes per point on a CPU)
        pts = [ShapePoint("cpu.tiny", shape_op, m, CPU_K, CPU_N) for m in args.m or CPU_M_VALUES]
    table_layers = ", ".join(RS_LAYERS if op == "gemm_rs" else AG_LAYERS)
    require(pts, f"no {op} shape selected: --layers names none of its table ({table_layers})")
    for pt in pts:
        require(min(pt.m, pt.k, pt.n) > 0, f"M, K and N must be > 0, got {pt.m}x{pt.k}x{pt.n}")
        require(pt.m % world == 0, f"M={pt.m} is not divisible by the TP size {world}; give multiples of {world}, "
                                   f"e.g. --tokens {-(-pt.m // world) * world}")
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


def _point_bytes(op: str, pt: ShapePoint, world: int, num_configs: int) -> int:
    """Lower bound of one point's bytes per rank (launch/kfactor.py): the pool (a region per config and one
    more; regimes: one) and the operands (bf16)."""
    if op == "regimes":
        return 2 * pt.m * pt.k * 2 + (2 * pt.m * pt.k + pt.m * pt.n + pt.k * pt.n) * 2
    rows = pt.m // world if op == "ag_gemm" else pt.m
    region = 2 * pt.m * (pt.k if op == "ag_gemm" else pt.n) * 2
    return (num_configs + 1) * region + (rows * pt.k + pt.k * pt.n) * 2


def check(args, where) -> SimpleNamespace:
    """The run's preset, shapes and configs from the arguments and the placement (a `_dist.Placement`)."""
    cuda = where.device.type == "cuda"
    _dist.check_ranks(PROG, where, 2)
    distinct("--tokens", args.m or (), "M")
    base_cfg = load_config(args.config) if args.config else load_preset(where.device_name, where.world_size)
    base_cfg.check_world_size(where.world_size)
    num_sms = torch.cuda.get_device_properties(where.device).multi_processor_count if cuda else None
    plan = [(op, points_for(args, op, where.world_size, cuda)) for op in args.ops]
    args.effective_grid = dict(args.grid or (GPU_GRID if cuda else CPU_GRID))
    configs = {op: configs_for(op, base_cfg, args.effective_grid, cuda, num_sms)
               for op in args.ops if op != "regimes"}
    op, pt = max(((op, pt) for op, pts in plan for pt in pts),
                 key=lambda item: _point_bytes(item[0], item[1], where.world_size, len(configs.get(item[0], ()))))
    require_fits(f"{op} {pt.layer} M={pt.m} K={pt.k} N={pt.n}",
                 _point_bytes(op, pt, where.world_size, len(configs.get(op, ()))), where,
                 "give a smaller --tokens or --shapes")
    return SimpleNamespace(cuda=cuda, base_cfg=base_cfg, num_sms=num_sms, plan=plan, configs=configs)
