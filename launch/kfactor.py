"""k-factor sweeps under torchrun: measure every overlap, sweep the SM partition, gate, plot, write a preset.

    torchrun --standalone --nproc-per-node 2 -m tp_overlap.launch.kfactor [--ops ag_gemm,gemm_rs,regimes]
        [--shapes 4096x4096x3072,...] [--tokens 1024,4096] [--layers llama8b.qkv,...]
        [--sweep method=decomposed,fused --sweep sm_margin=0,8,16 --sweep chunks_per_rank=1,2]
        [--max-k 1.15] [--gate all|best] [--write-config tuned.yaml] [--out-dir DIR]

Ops: `ag_gemm` and `gemm_rs` are swept over the grid (one row per shape x config, definitions of solo and
overlapped in launch/measure/k_factor.py); `regimes` puts the AllGather next to the two kinds of work it may overlap
with, on the AG shapes: our copy-engine AllGather ("ce") and the collective ("nccl", gloo on CPU) each
next to the shape's GEMM ("gemm", compute-bound) and next to an RMSNorm over the gathered [M, H] repeated
to last about as long as the CE gather ("membound").

--sweep KEY=V1,V2 (repeatable; keys method, sm_margin, chunks_per_rank, num_comm_sms, lead_fraction (AG decomposed only); a token holding '='
starts a new key, so `--sweep sm_margin=0,8,chunks_per_rank=1,2` also works). A method applies only to
the ops that have it (`method=decomposed,fused,epilogue_reduce` sweeps epilogue_reduce for gemm_rs only). Keys not swept keep the
preset's value; for gemm_rs num_comm_sms follows sm_margin (the reduction runs on the reserved SMs) and
chunks_per_rank is not used. Shapes: the table of launch/cli/shapes.py at the job's TP size on GPUs, tiny ones on CPU
(M = 256, 512; K = N = 64; with --layers, the table's), or --shapes MxKxN (K, N local to a rank; applies to
every op).

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

from tp_overlap.config import envs
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import OverlapConfig
from tp_overlap.config.presets import dump_config, load_config, to_dict
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.launch.measure.comm_delay import inject_comm_delay
from tp_overlap.launch.measure.k_factor import (LATE_START_MS, k_from_trace, measure, measure_pair, op_pair,
                             trace_op)
from tp_overlap.launch.measure.timeline import step_timeline
from tp_overlap.ops.reference import ag_gemm_reference, gemm_rs_reference
from tp_overlap.launch.output.report import device_slug, format_table, run_labels, write_results
from tp_overlap.launch.cli.shapes import ShapePoint
from tp_overlap.launch.measure.timing import bench_interleaved, progress
from tp_overlap.symm_mem.pool import SymmetricPool

from .measure.accuracy import rel_err as _rel_err
from .cli import dist as _dist, kfactor_args as _args
from .cli.common import ArgumentParser, run_dir, run_launcher
from .cli.kfactor_args import GPU_MAX_K, PROG, configs_for, parse_sweep, points_for  # noqa: F401 (the API)
from .measure.tune import best_configs, config_row, gate_failures, tuned_config

MAX_MEMBOUND_PASSES = 256
COLUMNS = ["run_kind", "op", "layer", "M", "K", "N", "method", "sm_margin", "chunks_per_rank", "comm", "comp",
           "t_comm_solo_ms", "t_comp_solo_ms", "k_comm", "k_comp", "E", "hidden_comm", "t_op_ms", "E_op"]


def make_parser() -> ArgumentParser:
    return _args.make_parser(__doc__)


def parse_args(argv=None) -> argparse.Namespace:
    return _args.parse_args(argv, __doc__)


class _Bar:
    def __init__(self, total: int, rank: int):
        self.total, self.done, self.rank = total, 0, rank

    def step(self, label: str) -> None:
        self.done += 1
        filled = round(20 * self.done / max(self.total, 1))
        progress(f"[{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} {label}", rank=self.rank)


def _randn(gen, *shape, scale=1.0, dtype, device):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


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
        from .output import plots as _plots
        files["plot"] = str(_plots.plot_sweep([r for r in rows if r["op"] != "ag_regime"], stem.with_suffix(".png"),
                                              max_k=args.max_k, title=stem.name))
        files["timeline"] = str(_plots.plot_timeline([t for _, t in timelines],
                                                     stem.parent / f"{stem.name}_timeline.png",
                                                     xlabel="ms from the start of the overlapped step"))
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
    checked = _args.check(args, where)
    cuda, base_cfg, num_sms, plan, configs = (checked.cuda, checked.base_cfg, checked.num_sms, checked.plan,
                                              checked.configs)
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
