"""Host time of one eager call of each op and method, and of a TP MLP training step, against their references.

    torchrun --standalone --nproc-per-node 2 -m tp_overlap.launch.host_cost [--out FILE] [--reps 30]   (needs a GPU)

Needs a CUDA GPU and at least 2 ranks (two processes may share one GPU).

Every call is timed on the host (perf_counter around the call, no synchronisation) while the device is held
busy by a spin kernel, so the number is the enqueue cost alone. Median of `--reps` per rank, max over ranks.

* ops: each op and method with the eager-call graphs (the default: a call is one replay of a CUDA graph
  recorded from its plan) and without them (OVERLAP_EAGER_GRAPHS=0: the plan enqueued step by step),
  against one `torch.mm` of the op's whole GEMM in the same process; `py_calls` is the number of Python
  function calls of one eager call (cProfile, builtins included, mean over `--reps` calls).
* the MLP step (forward + backward of `TPMLP` with the preset) against the same step with `overlap=False`
  on NCCL, and the same for one transformers Llama decoder block (llama8b shapes) converted by
  `tp_overlap.parallelize` (attention and MLP; `--no-block` skips it, as does a machine without transformers). Ranks sharing one GPU cannot form an NCCL group (NCCL refuses two ranks on one device), so the
  NCCL step runs on a one-rank NCCL group per process: the same calls (collectives, GEMMs, autograd) with
  the same host path; its enqueue cost does not depend on the number of ranks.

Several processes may share one GPU (pool backend ipc): host time stays meaningful (the other process does
slow every CUDA call a little: the ratios within one process are what to read).
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

from tp_overlap.launch.output.report import format_table, write_results
from tp_overlap.launch.measure.timing import progress

from tp_overlap.symm_mem.layout import BACKENDS

from .cli import dist as _dist
from .cli.common import ArgumentParser, output_file, require, run_dir, run_launcher
from .cli.limits import require_fits

PROG = "tp_overlap.launch.host_cost"
HOLD_CYCLES = 40_000_000  # ~20 ms: the device stays busy through the timed call
POOL_BYTES = 2 << 30
HIDDEN, FFN = 4096, 14336  # llama8b: the MLP step's shapes, and K of the op calls
COLUMNS = ["op", "method", "eager_graphs", "host_us", "ref", "ref_host_us", "ratio", "py_calls", "host_min_us",
           "host_max_us"]


def _host_us(fn, group, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        torch.cuda._sleep(HOLD_CYCLES)
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return samples


def _py_calls(fn, group, reps: int) -> float:
    """Python function calls per call of `fn` (cProfile counts builtins too), mean over `reps` calls."""
    torch.cuda.synchronize()
    dist.barrier(group=group)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(reps):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    return pstats.Stats(profile).total_calls / reps


def _max_median(samples, group) -> tuple[float, float, float]:
    t = torch.tensor([statistics.median(samples), min(samples), max(samples)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # CPU tensor: gloo when processes share a GPU
    return tuple(t.tolist())


def _op_calls(ctx, pool, m, k, n):
    """{(op, method): (op, call, the op's whole GEMM as one torch.mm)} on llama8b.qkv / o_proj-like shapes."""
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
    from tp_overlap.ops.gemm_rs import GemmRs
    dev, world, bf16 = ctx.device, ctx.world_size, torch.bfloat16
    a_shard = torch.randn(m // world, k, device=dev, dtype=bf16)
    w = torch.randn(n, k, device=dev, dtype=bf16).t()
    a_full = torch.randn(m, k, device=dev, dtype=bf16)
    a_rs = torch.randn(m, n, device=dev, dtype=bf16)
    w_rs = torch.randn(k, n, device=dev, dtype=bf16).t()
    calls = {}
    for method, lead in (("decomposed", 0.5), ("decomposed", 0.0), ("fused", 0.0)):
        op = AgGemm(group=ctx.group, pool=pool, max_m=m, k=k, n_local=n, dtype=bf16,
                    config=AgGemmConfig(method=method, lead_fraction=lead), name=f"hc.ag.{method}.{lead}")
        calls[("ag_gemm", f"{method}" + (f" lead={lead}" if lead else ""))] = (
            op, lambda op=op: op(a_shard, w), lambda: torch.mm(a_full, w))
    rs_methods = [("fused", dict(sm_margin=16, num_comm_sms=16)), ("epilogue_reduce", dict(num_comm_sms=0)),
                  ("decomposed", dict(num_comm_sms=8))] + ([("pair", dict(num_comm_sms=0))] if world == 2 else [])
    for method, extra in rs_methods:
        op = GemmRs(group=ctx.group, pool=pool, max_m=m, k_local=n, n=k, dtype=bf16,
                    config=GemmRsConfig(method=method, **extra), name=f"hc.rs.{method}")
        calls[("gemm_rs", method)] = (op, lambda op=op: op(a_rs, w_rs), lambda: torch.mm(a_rs, w_rs))
    return calls


def _step(mlp, x, dy):
    def step():
        mlp(x).backward(dy)
    return step


def _mlp_steps(ctx, pool, m, hidden, ffn, nccl_self):
    """(our step, the overlap=False step on NCCL, our MLP): forward + backward of a TPMLP with the preset."""
    from tp_overlap.ops.layers import TPMLP
    dev, world, bf16 = ctx.device, ctx.world_size, torch.bfloat16
    ours = TPMLP(hidden, ffn, group=ctx.group, max_m=m, dtype=bf16, pool=pool, name="hc.mlp")
    x = torch.randn(m // world, hidden, device=dev, dtype=bf16, requires_grad=True)
    dy = torch.randn(m // world, hidden, device=dev, dtype=bf16)
    nccl = TPMLP(hidden, ffn, group=nccl_self, max_m=m, dtype=bf16, overlap=False, baseline="nccl",
                 device=dev, name="hc.nccl")
    x1 = torch.randn(m, hidden, device=dev, dtype=bf16, requires_grad=True)
    dy1 = torch.randn(m, hidden, device=dev, dtype=bf16)
    return _step(ours, x, dy), _step(nccl, x1, dy1), ours


def _block_steps(ctx, m, nccl_self):
    """(our step, the overlap=False step on NCCL, the handles to close): forward + backward of one converted
    transformers Llama decoder block (llama8b shapes, the embedding skipped: inputs_embeds)."""
    import tp_overlap
    from transformers import LlamaConfig, LlamaModel
    config = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                         num_attention_heads=32, num_key_value_heads=8, attn_implementation="sdpa")
    dev, bf16, seq = ctx.device, torch.bfloat16, m // 2
    steps, handles = [], []
    for group, overlap, name in ((ctx.group, True, "hc.block"), (nccl_self, False, "hc.block.nccl")):
        torch.manual_seed(0)
        model = LlamaModel(config).to(dev, bf16)
        handles.append(tp_overlap.parallelize(model, group=group, max_tokens=m, overlap=overlap, name=name))
        x = torch.randn(2, seq, HIDDEN, device=dev, dtype=bf16, requires_grad=True)
        dy = torch.randn(2, seq, HIDDEN, device=dev, dtype=bf16)
        steps.append(lambda model=model, x=x, dy=dy: model(inputs_embeds=x).last_hidden_state.backward(dy))
    return steps[0], steps[1], handles


def _measure(rows, op, method, graphs, call, ref_name, ref, ctx, args):
    label, start = f"{op} {method} graphs={graphs}", time.perf_counter()
    progress(f"{label}: warm-up ({args.warmup} calls of each: compiles, and with eager graphs records)", rank=ctx.rank)
    for _ in range(args.warmup):
        call()
        ref()
    torch.cuda.synchronize()
    progress(f"{label}: warm-up took {time.perf_counter() - start:.1f} s; timing {args.reps} calls of each",
             rank=ctx.rank)
    ours = _max_median(_host_us(call, ctx.group, args.reps), ctx.group)
    base = _max_median(_host_us(ref, ctx.group, args.reps), ctx.group)
    py = _py_calls(call, ctx.group, args.reps)
    rows.append({"op": op, "method": method, "eager_graphs": graphs, "host_us": ours[0], "ref": ref_name,
                 "ref_host_us": base[0], "ratio": ours[0] / base[0], "py_calls": py, "host_min_us": ours[1],
                 "host_max_us": ours[2]})
    progress(f"{label}: {ours[0]:.0f} us = {ours[0] / base[0]:.2f} x {ref_name} ({base[0]:.0f} us), {py:.0f} Python "
             f"calls ({time.perf_counter() - start:.1f} s in all)", rank=ctx.rank)


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--tokens", type=int, default=4096, help="M of the op calls and of the MLP step")
    p.add_argument("--reps", type=int, default=30, help="timed calls per variant (median reported)")
    p.add_argument("--warmup", type=int, default=8, help="untimed calls per variant first")
    p.add_argument("--no-block", action="store_true", help="skip the converted decoder block's step")
    p.add_argument("--backend", default="ipc", choices=BACKENDS,
                   help="pool backend (ipc: several processes may share a GPU)")
    p.add_argument("--out", type=output_file, default=None,
                   help="results JSON (default: runs/host_cost-<time>/host_cost.json)")
    return p


def parse_args(argv=None):
    return make_parser().parse_args(argv)


def _check(args, where) -> None:
    """Every argument against the placement, before any process group, pool or GPU allocation."""
    require(where.device.type == "cuda", "needs a CUDA GPU (it measures the host cost of CUDA calls with the "
                                         "device held busy); run it on a GPU machine")
    _dist.check_ranks(PROG, where, 2)
    require(args.tokens > 0 and args.tokens % (2 * where.world_size) == 0,
            f"--tokens must be > 0 and a multiple of 2 x the TP size {2 * where.world_size} (the block step runs 2 "
            f"sequences of tokens / 2), got {args.tokens}")
    require(args.reps >= 3, f"--reps must be >= 3, got {args.reps}")
    require(args.warmup >= 2, f"--warmup must be >= 2 (a call's graph is recorded on its second call), got "
                              f"{args.warmup}")
    # the pool, what the calls allocate (bf16: three [M, 4096] operands, the MLP's fc1 output and its gradient,
    # 3 x 14336 / W columns) and the one-rank NCCL MLP of the reference step (full weights and activations)
    need = POOL_BYTES + args.tokens * (3 * HIDDEN + 3 * FFN // where.world_size) * 2
    need += (3 * HIDDEN * FFN + args.tokens * (3 * HIDDEN + 3 * FFN)) * 2
    need *= 1 if args.no_block else 2   # the decoder block: about as much again (attention weights, its NCCL twin)
    require_fits(f"--tokens {args.tokens}", need, where, "give a smaller --tokens")


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


def _has_transformers() -> bool:
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        progress("decoder block step skipped: transformers is not installed", rank=0)
        return False
    return True


def _run(args) -> int:
    where = _dist.placement()
    _check(args, where)
    from tp_overlap.symm_mem.pool import SymmetricPool
    with _dist.job(PROG, where=where) as ctx:
        rows = []
        nccl_groups = [dist.new_group([r], backend="nccl") for r in range(ctx.world_size)]
        with SymmetricPool(POOL_BYTES, group=ctx.group, device=ctx.device, backend=args.backend,
                           num_device_words=1 << 14) as pool:
            calls = _op_calls(ctx, pool, args.tokens, HIDDEN, 3072 // max(1, ctx.world_size // 2))
            for (op_name, method), (op, call, mm) in calls.items():
                for graphs in (True, False):
                    op.set_eager_graphs(graphs)
                    _measure(rows, op_name, method, graphs, call, "torch.mm", mm, ctx, args)
                op.close()
            step, nccl_step, mlp = _mlp_steps(ctx, pool, args.tokens, HIDDEN, FFN, nccl_groups[ctx.rank])
            _measure(rows, "tp_mlp step (fwd+bwd)", "preset", True, step, "overlap=False step (NCCL)", nccl_step,
                     ctx, args)
            mlp.check_errors()
            mlp.close()
            pool.barrier()
        if not args.no_block and _has_transformers():
            step, nccl_step, handles = _block_steps(ctx, args.tokens, nccl_groups[ctx.rank])
            _measure(rows, "decoder block step (fwd+bwd)", "parallelize", True, step, "overlap=False step (NCCL)",
                     nccl_step, ctx, args)
            for handle in handles:
                handle.check_errors()
                handle.close()
        if ctx.rank == 0:
            out = args.out or str(run_dir("host_cost") / "host_cost.json")
            write_results(out, rows, device=ctx.device_name, tp=ctx.world_size,
                          extra={"op": "host_cost", "tokens": args.tokens, "reps": args.reps,
                                 "definitions": "host_us: perf_counter around one eager call with the device held "
                                                "busy, median over reps per rank, max over ranks; ref_host_us: the "
                                                "reference the same way in the same process (an op: its whole GEMM "
                                                "as one torch.mm; the MLP step: the same step with overlap=False on "
                                                "a one-rank NCCL group); ratio = host_us / ref_host_us; py_calls: "
                                                "Python function calls per eager call (cProfile, builtins "
                                                "included)"})
            print(format_table(rows, COLUMNS))
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
