"""Correctness smoke of every CUDA code path with W processes sharing ONE GPU (gloo, the ipc pool backend).

For a machine with a single GPU: NCCL refuses two ranks on one device, so references come from CPU copies
exchanged with gloo. Timing means nothing here (the contexts time-slice the GPU). Runs W = 2 (every check),
then W = 4 and W = 8 (the ops, the reliability checks and the construction refusals).

    python -m tests.gpu.smoke_one_gpu [--worlds 2,4,8] [--json FILE]   (one line per check; exit 1 on a failure)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch
import torch.distributed as dist

from tests.gpu.smoke_failures import call_failures
from tests.gpu.smoke_refusals import refusals
from tests.multiproc import run_ranks

TOL = 1e-2
FP8_TOL = 6e-2       # e4m3 with 1x128 / 128x128 scales: ~3.7e-2 per GEMM on Gaussian data (overlap/gemm/fp8.py)
FP8_MLP_TOL = 0.15   # up to three quantised GEMMs chained per gradient (tests/mp/test_fp8_ops.py)


def _rel(out, ref) -> float:
    return ((out.double().cpu() - ref.double()).norm() / ref.double().norm()).item()


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.detach().cpu())
    return out


def _fresh(shape, seed, dev, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(dev)


class Checks:
    def __init__(self, rank, world, dev):
        self.rank, self.world, self.dev, self.lines = rank, world, dev, []

    def run(self, name, fn):
        start = time.monotonic()
        try:
            result = fn()
            torch.cuda.synchronize(self.dev)  # a fault of the case's kernels is reported as this case's
            self.lines.append(f"W={self.world} {name}: ok {result or ''} ({time.monotonic() - start:.1f} s)")
        except Exception as exc:  # noqa: BLE001 - every check reports, none stops the others
            self.lines.append(f"W={self.world} {name}: FAIL {type(exc).__name__}: {exc}\n"
                              f"{traceback.format_exc()[-1200:]}")
            # printed now too: a sticky CUDA error makes the world fail as a whole and its lines are lost
            print(f"rank {self.rank} {self.lines[-1]}", flush=True)


def _ag_case(c, pool, method, lead, chunks, rows, k, n, *, eager_graphs=True, fp8=False):
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.config.schema import AgGemmConfig
    group, world, rank, dev = dist.group.WORLD, c.world, c.rank, c.dev
    cfg = AgGemmConfig(method=method, lead_fraction=lead, chunks_per_rank=chunks)
    name = f"ag.{method}.{lead}.{chunks}.{rows}.{int(eager_graphs)}.{int(fp8)}"
    op = AgGemm(group=group, pool=pool, max_m=rows * world, k=k, n_local=n, dtype=torch.bfloat16, config=cfg,
                name=name, fp8=fp8)
    op.set_eager_graphs(eager_graphs)
    a_shard = torch.empty(rows, k, dtype=torch.bfloat16, device=dev)  # one tensor: replays engage from call 3
    worst = 0.0
    for step in range(6):
        a_shard.copy_(_fresh((rows, k), 100 * step + rank, dev))
        w = _fresh((n, k), 7 + step, dev).t() if step % 2 else _fresh((k, n), 7 + step, dev)
        if step == 4 and not fp8:  # zero copy: the shard written straight into the pool slot
            slot = op.input_slot(rows * world)
            slot.copy_(a_shard)
            out, gathered = op(slot, w, return_gathered=True)
        else:
            out, gathered = op(a_shard, w, return_gathered=True)
        full = torch.cat(_gather(a_shard))
        if fp8:  # the gathered e4m3 rows and scales are those of quantising the full input
            from tp_overlap.gemm import quantize_activation
            q8, qs = quantize_activation(full.to(dev))
            if not (torch.equal(gathered[0].view(torch.uint8), q8.view(torch.uint8))
                    and torch.equal(gathered[1], qs)):
                raise AssertionError(f"step {step}: the gathered e4m3 rows or scales are not bit-exact")
        elif not torch.equal(gathered.cpu(), full):
            raise AssertionError(f"step {step}: the gathered a is not bit-exact")
        worst = max(worst, _rel(out, full.double() @ w.double().cpu()))
    gathered = op.all_gather(a_shard)
    if not fp8:
        assert torch.equal(gathered.cpu(), torch.cat(_gather(a_shard))), "all_gather not bit-exact"
    # the k-factor's compute alone: the consumer of this plan over the rows all_gather left in the pool
    worst = max(worst, _rel(op.compute_alone(a_shard, w), torch.cat(_gather(a_shard)).double() @ w.double().cpu()))
    op.check_errors()
    op.close()
    assert worst < (FP8_TOL if fp8 else TOL), worst
    return f"rel={worst:.1e}"


def _rs_case(c, pool, method, rows, k, n, *, margin=0, comm=0, bulk=False, fp8=False):  # comm: num_comm_sms
    from tp_overlap.config.schema import GemmRsConfig
    from tp_overlap.ops.gemm_rs import GemmRs
    group, world, rank, dev = dist.group.WORLD, c.world, c.rank, c.dev
    cfg = GemmRsConfig(method=method, sm_margin=margin, num_comm_sms=comm)
    op = GemmRs(group=group, pool=pool, max_m=rows * world, k_local=k, n=n, dtype=torch.bfloat16, config=cfg,
                name=f"rs.{method}.{rows}.{int(bulk)}.{int(fp8)}", fp8=fp8)
    worst = 0.0
    for step in range(5):
        a = _fresh((rows * world, k), 300 * step + rank, dev)
        w = _fresh((n, k), 11 * step + rank, dev).t() if step % 2 else _fresh((k, n), 11 * step + rank, dev)
        if bulk:
            out, token = op.bulk(a, w, lambda: ("work", step))
            assert token == ("work", step), token
        else:
            out = op(a, w)
        total = sum(x.double() @ y.double() for x, y in zip(_gather(a), _gather(w)))
        worst = max(worst, _rel(out, total[rank * rows:(rank + 1) * rows]))
    worst = max(worst, _rel(op.compute_alone(a, w), a.double().cpu() @ w.double().cpu()))  # k's compute alone
    partials = _fresh((rows * world, n), 77 + rank, dev)
    shard = op.reduce_scatter(partials)
    total = sum(p.double() for p in _gather(partials))
    worst = max(worst, _rel(shard, total[rank * rows:(rank + 1) * rows]))
    op.check_errors()
    op.close()
    assert worst < (FP8_TOL if fp8 else TOL), worst
    return f"rel={worst:.1e}"


def _rs_boxes_case(c, pool):
    """M = 1024, N = 4096 (TP 8's llama8b fc2, shorter K) under sm_margin 16: the scatter GEMM's 128x144 tiles (two
    B boxes), both layouts."""
    from tp_overlap.gemm import num_sms
    from tp_overlap.gemm.blocks import gpu_slug
    from tp_overlap.ops.rs_scatter import scatter_gluon_blocks
    blocks = scatter_gluon_blocks(1024, 4096, 256, b_transposed=True, gpu=gpu_slug(torch.cuda.get_device_name()),
                                  programs=num_sms(c.dev) - 16)
    assert blocks.gluon_boxes, f"{blocks.name}: not two B boxes wide"
    return f"{blocks.name} " + _rs_case(c, pool, "fused", 1024 // c.world, 256, 4096, margin=16, comm=8)


def _captured(c, pool, kind, method, rows, k, n):
    """Calls captured in a CUDA graph, replayed with fresh inputs, eager calls in between."""
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
    from tp_overlap.ops.gemm_rs import GemmRs
    group, world, rank, dev = dist.group.WORLD, c.world, c.rank, c.dev
    ag = kind == "ag"
    if ag:
        op = AgGemm(group=group, pool=pool, max_m=rows * world, k=k, n_local=n, dtype=torch.bfloat16,
                    config=AgGemmConfig(method=method, chunks_per_rank=2), name=f"cap.ag.{method}")
        x = torch.empty(rows, k, dtype=torch.bfloat16, device=dev)
    else:
        extra = dict(sm_margin=16, num_comm_sms=8) if method == "fused" else \
            dict(num_comm_sms=4) if method == "decomposed" else dict(num_comm_sms=0)
        op = GemmRs(group=group, pool=pool, max_m=rows * world, k_local=k, n=n, dtype=torch.bfloat16,
                    config=GemmRsConfig(method=method, **extra), name=f"cap.rs.{method}")
        x = torch.empty(rows * world, k, dtype=torch.bfloat16, device=dev)
    w = _fresh((k, n), 5 + (0 if ag else rank), dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    worst = 0.0
    with torch.cuda.stream(side):
        for step in range(2):  # warm-up on the capture stream: every kernel compiled
            x.copy_(_fresh(x.shape, 900 + step + rank, dev))
            op(x, w)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            y = op(x, w)
        for step in range(12):
            x.copy_(_fresh(x.shape, 1000 * step + rank, dev))
            if step % 4 == 3:
                got = op(x, w)  # an eager call between replays, same stream
            else:
                graph.replay()
                got = y
            ws = _gather(w)
            if ag:
                ref = torch.cat(_gather(x)).double() @ ws[rank].double()
            else:
                ref = sum(a.double() @ b.double() for a, b in zip(_gather(x), ws))[rank * rows:(rank + 1) * rows]
            worst = max(worst, _rel(got, ref))
    torch.cuda.synchronize()
    op.check_errors()
    op.close()
    assert worst < TOL, worst
    return f"rel={worst:.1e} over 12 calls (9 replays)"


def _ag_ref(x, w, rank):
    return torch.cat(_gather(x)).double() @ w.double().cpu()


def _capture_idioms(c, pool, method):
    """The torch docs' idiom (warm up on a side stream, `with torch.cuda.graph(g)` on its own stream), eager
    calls on the default and on another stream after it, a capture after eager calls on another stream,
    two graphs of one op at different M, replays interleaved with eager calls."""
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.config.schema import AgGemmConfig
    group, world, rank, dev = dist.group.WORLD, c.world, c.rank, c.dev
    op = AgGemm(group=group, pool=pool, max_m=128 * world, k=264, n_local=136, dtype=torch.bfloat16,
                config=AgGemmConfig(method=method, chunks_per_rank=2), name=f"idioms.{method}")
    w = _fresh((264, 136), 3, dev)
    small, large = torch.empty(40, 264, dtype=torch.bfloat16, device=dev), torch.empty(128, 264,
                                                                                         dtype=torch.bfloat16, device=dev)
    worst, calls = 0.0, 0

    def check(got, x):
        nonlocal worst, calls
        torch.cuda.synchronize()
        worst, calls = max(worst, _rel(got, _ag_ref(x, w, rank))), calls + 1

    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the docs' warm-up
        for x in (small, large, small):
            x.copy_(_fresh(x.shape, 7 + calls + rank, dev))
            check(op(x, w), x)
    torch.cuda.current_stream().wait_stream(side)
    graphs = {}
    for name, x in (("small", small), ("large", large)):  # two graphs of one op at different M
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            out = op(x, w)
        graphs[name] = (graphs[name], out)
    for step in range(8):
        x = small if step % 2 else large
        x.copy_(_fresh(x.shape, 100 * step + rank, dev))
        if step % 4 == 3:            # an eager call on the default stream after a capture
            check(op(x, w), x)
        elif step % 4 == 1:          # an eager call on another stream
            other.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(other):
                got = op(x, w)
            torch.cuda.current_stream().wait_stream(other)
            check(got, x)
        else:                        # a replay
            graph, out = graphs["small" if step % 2 else "large"]
            graph.replay()
            check(out, x)
    with torch.cuda.stream(other):   # eager calls on another stream, then a capture with stream=
        small.copy_(_fresh(small.shape, 999 + rank, dev))
        check(op(small, w), small)
    late = torch.cuda.CUDAGraph()
    with torch.cuda.graph(late, stream=side):
        out = op(large, w)
    large.copy_(_fresh(large.shape, 555 + rank, dev))
    late.replay()
    check(out, large)
    op.check_errors()
    op.close()
    assert worst < TOL, worst
    return f"rel={worst:.1e} over {calls} calls (eager, 2 graphs at 2 Ms, a late capture)"


def _replays(c, pool, kind, method):
    """Eager calls replayed from recorded graphs (the default path): the same tensors refilled every step,
    so from the second call on each call is one replay; right rows every call, the graph recorded once."""
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
    from tp_overlap.ops.gemm_rs import GemmRs
    group, world, rank, dev = dist.group.WORLD, c.world, c.rank, c.dev
    rows, k, n = (256 if method == "epilogue_reduce" else 100), 264, 136
    if kind == "ag":
        op = AgGemm(group=group, pool=pool, max_m=rows * world, k=k, n_local=n, dtype=torch.bfloat16,
                    config=AgGemmConfig(method=method, chunks_per_rank=2), name=f"replay.ag.{method}")
        x, wgrad_of = torch.empty(rows, k, dtype=torch.bfloat16, device=dev), torch.empty(rows * world, 48,
                                                                                            dtype=torch.bfloat16, device=dev)
    else:
        extra = dict(sm_margin=16, num_comm_sms=8) if method == "fused" else \
            dict(num_comm_sms=4) if method == "decomposed" else dict(num_comm_sms=0)
        op = GemmRs(group=group, pool=pool, max_m=rows * world, k_local=k, n=n, dtype=torch.bfloat16,
                    config=GemmRsConfig(method=method, **extra), name=f"replay.rs.{method}",
                    bulk=method == "decomposed")
        x, wgrad_of = torch.empty(rows * world, k, dtype=torch.bfloat16, device=dev), torch.empty(rows * world, 48,
                                                                                                   dtype=torch.bfloat16, device=dev)
    w = torch.empty(k, n, dtype=torch.bfloat16, device=dev)
    worst = 0.0
    for step in range(6):
        x.copy_(_fresh(x.shape, 31 * step + rank, dev))
        w.copy_(_fresh(w.shape, step + (0 if kind == "ag" else rank), dev))
        wgrad_of.copy_(_fresh(wgrad_of.shape, 17 * step + rank, dev))
        if kind == "ag":
            out, grad = op(x, w, wgrad_of=wgrad_of, lead_wgrad=step % 2 == 1 and method == "decomposed")
            gathered = torch.cat(_gather(x)).double()
            ref, ref_grad = gathered @ w.double().cpu(), wgrad_of.double().cpu().t() @ gathered
        else:
            out, grad = op.bulk(x, w, wgrad_of=wgrad_of) if method == "decomposed" else op(x, w, wgrad_of=wgrad_of)
            total = sum(a.double() @ b.double() for a, b in zip(_gather(x), _gather(w)))
            ref, ref_grad = total[rank * rows:(rank + 1) * rows], wgrad_of.double().cpu().t() @ x.double().cpu()
        worst = max(worst, _rel(out, ref), _rel(grad, ref_grad))
        del out, grad
    op.check_errors()
    graphs = op.num_graphs
    op.close()
    assert worst < TOL, worst
    assert graphs >= 1, "no call was replayed from a recorded graph"
    return f"rel={worst:.1e}, {graphs} graph(s)"


def _replay_keys(c, pool, kind, method):
    """Eager calls alternating between two sets of tensors of one shape: each set's calls replay only the graph
    recorded from that set's tensors. A key without the tensors' addresses would replay the other set's graph
    from the third call on (reading the other inputs, writing the other call's output): wrong rows."""
    from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.ops.gemm_rs import GemmRs
    group, world, rank, dev, rows, k, n = dist.group.WORLD, c.world, c.rank, c.dev, 256, 264, 136
    if kind == "ag":
        op = AgGemm(group=group, pool=pool, max_m=rows * world, k=k, n_local=n, dtype=torch.bfloat16,
                    config=AgGemmConfig(method=method), name=f"keys.ag.{method}")
    else:
        op = GemmRs(group=group, pool=pool, max_m=rows * world, k_local=k, n=n, dtype=torch.bfloat16,
                    config=GemmRsConfig(method=method, sm_margin=16 * (method == "fused"), num_comm_sms=4),
                    name=f"keys.rs.{method}")
    a_rows = rows if kind == "ag" else rows * world
    sets = [(torch.empty(a_rows, k, dtype=torch.bfloat16, device=dev), torch.empty(k, n, dtype=torch.bfloat16,
                                                                                  device=dev)) for _ in range(2)]
    worst = 0.0
    for step in range(8):
        a, w = sets[step % 2]
        a.copy_(_fresh(a.shape, 100 * step + rank, dev))
        w.copy_(_fresh(w.shape, step + (0 if kind == "ag" else 7 * rank), dev))
        out = op(a, w)
        if kind == "ag":
            ref = torch.cat(_gather(a)).double() @ w.double().cpu()
        else:
            ref = sum(x.double() @ y.double() for x, y in zip(_gather(a), _gather(w)))[rank * rows:(rank + 1) * rows]
        worst = max(worst, _rel(out, ref))
        del out
    op.check_errors()
    graphs = op.num_graphs
    op.close()
    assert worst < TOL, worst
    assert graphs >= 2, f"{graphs} graph(s): the calls were not replayed, so the key was not tested"
    return f"rel={worst:.1e}, {graphs} graphs"


def _mlp(c, pool_bytes_per_mlp, compiled=False, graphed=False, ag_method="decomposed", rs_method="pair", fp8=False):
    """TPMLP forward + backward against the fp64 oracle; optionally a whole step captured and replayed."""
    import dataclasses

    from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig, OpPreset, RoleConfig
    from tp_overlap.ops.layers import TPMLP, MLPReference, pool_requirements, shard_fc1, shard_fc2, shard_rows
    from tp_overlap.config.presets import load_preset
    from tp_overlap.symm_mem.pool import SymmetricPool
    group, world, rank, dev = dist.group.WORLD, c.world, c.rank, c.dev
    hidden, ffn, rows = 256, 384, 128
    rs_extra = dict(sm_margin=16, num_comm_sms=8) if rs_method == "fused" else \
        dict(num_comm_sms=4) if rs_method == "decomposed" else dict(num_comm_sms=0)
    base = load_preset("NVIDIA H200", 2) if world == 2 else load_preset("NVIDIA H200", world)
    cfg = dataclasses.replace(base, ag_gemm=OpPreset(default=AgGemmConfig(method=ag_method, lead_fraction=0.5
                                                                          if ag_method == "decomposed" else 0)),
                              gemm_rs=OpPreset(default=GemmRsConfig(method=rs_method, **rs_extra)),
                              roles={"fc2_dgrad": OpPreset(default=RoleConfig(lead_wgrad=ag_method == "decomposed")),
                                     "fc1_dgrad": OpPreset(default=RoleConfig(bulk_wgrad=True))})
    req = pool_requirements(hidden=hidden, max_m=rows * world, world_size=world, dtype=torch.bfloat16,
                            chunks_per_rank=1, fp8=fp8)
    with SymmetricPool(req.size_bytes, num_signal_words=req.num_signal_words, num_device_words=req.num_device_words,
                       group=group, backend="ipc", device=dev) as pool:
        mlp = TPMLP(hidden, ffn, group=group, max_m=rows * world, dtype=torch.bfloat16, pool=pool, config=cfg,
                    name=f"mlp.{ag_method}.{rs_method}.{compiled}.{int(graphed)}.{int(fp8)}", fp8=fp8)
        ref = MLPReference(hidden, ffn, seed=3, dtype=torch.float64)
        mlp.load_full_weights(ref.fc1_weight.detach().bfloat16().to(dev), ref.fc2_weight.detach().bfloat16().to(dev))
        skips_before = 0
        if compiled:
            from torch._dynamo.utils import counters
            mode, fullgraph = compiled if isinstance(compiled, tuple) else ("default", True)
            skips_before = counters["inductor"]["cudagraph_skips"]
            run = torch.compile(mlp, mode=mode, fullgraph=fullgraph)
        else:
            run = mlp
        worst = 0.0
        x = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
        dy = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev)
        steps = 8 if (compiled or graphed) else 3
        graph, side = None, torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for step in range(steps):
                gen = torch.Generator().manual_seed(50 + step)
                x_full = torch.randn(rows * world, hidden, generator=gen).bfloat16().double()
                dy_full = torch.randn(rows * world, hidden, generator=gen).bfloat16().double()
                with torch.no_grad():
                    x.copy_(shard_rows(x_full, rank, world).to(dev))
                    dy.copy_(shard_rows(dy_full, rank, world).to(dev))
                if graphed and step == 2:  # capture the whole step once it is warm, then replay it
                    torch.cuda.synchronize()
                    dist.barrier()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=side):
                        mlp.zero_grad(set_to_none=False)
                        x.grad = torch.zeros_like(x)
                        y = mlp(x)
                        y.backward(dy)
                if graph is not None:
                    graph.replay()
                else:
                    mlp.zero_grad(set_to_none=True)
                    x.grad = None
                    y = run(x)
                    y.backward(dy)
                torch.cuda.synchronize()
                xr = x_full.clone().requires_grad_(True)
                ref.zero_grad()
                yr = ref(xr)
                yr.backward(dy_full)
                worst = max(worst, _rel(y, shard_rows(yr.detach(), rank, world)),
                            _rel(x.grad, shard_rows(xr.grad, rank, world)),
                            _rel(mlp.fc1.weight.grad, shard_fc1(ref.fc1_weight.grad, rank, world)),
                            _rel(mlp.fc2.weight.grad, shard_fc2(ref.fc2_weight.grad, rank, world)))
        mlp.check_errors()
        mlp.close()
        pool.barrier()
    assert worst < (FP8_MLP_TOL if fp8 else 2e-2), worst
    note = ""
    if isinstance(compiled, tuple) and compiled[0] == "reduce-overhead":  # the CUDA-graph trees recorded the step, none skipped
        from torch._dynamo.utils import counters
        skipped = counters["inductor"]["cudagraph_skips"] - skips_before
        assert skipped == 0, f"inductor skipped CUDA graphs {skipped} time(s)"
        note = ", CUDA graphs recorded (no skip)"
    return f"rel={worst:.1e} over {steps} steps{note}"


def _reliability(c, dev):
    """On CUDA: disagreeing ranks (at construction, and on a call's M through the flags), use after close, a
    lost signal bounded by the watchdog."""
    from tp_overlap.ops.validate import OpInputError
    from tp_overlap.ops.ag_gemm import AgGemm
    from tp_overlap.config.schema import AgGemmConfig
    from tp_overlap.symm_mem.errors import PeerAbortError, PoolClosedError, SignalTimeout
    from tp_overlap.symm_mem.pool import SymmetricPool
    group, world, rank = dist.group.WORLD, c.world, c.rank
    cfg = AgGemmConfig(method="decomposed")
    notes = []
    w = _fresh((64, 32), 1, dev)
    with SymmetricPool(32 << 20, group=group, backend="ipc", device=dev, timeout_s=3) as pool:
        try:
            AgGemm(group=group, pool=pool, max_m=64 * world if rank else 32 * world, k=64, n_local=32,
                   dtype=torch.bfloat16, config=cfg, name="disagree")
            raise AssertionError("different max_m on the ranks was accepted")
        except OpInputError as exc:
            assert "max_m" in str(exc), exc
        op = AgGemm(group=group, pool=pool, max_m=64 * world, k=64, n_local=32, dtype=torch.bfloat16, config=cfg)
        op(_fresh((16, 64), rank, dev), w)
        torch.cuda.synchronize()
        dist.barrier()
        start = time.monotonic()
        try:  # the call is enqueued; the watchdog sees the peer's flag at the other M within milliseconds
            op(_fresh((32 if rank else 16, 64), rank, dev), w)
            op.check_errors()
            raise AssertionError("different M on the ranks was accepted")
        except OpInputError as exc:
            assert "different M" in str(exc) and f": {16 * world}" in str(exc) and f": {32 * world}" in str(exc), exc
        elapsed = time.monotonic() - start
        assert elapsed < 2.0, f"the disagreement took {elapsed:.1f} s to surface (bound 3 s)"
        notes.append(f"M mismatch raised on every rank after {elapsed:.2f} s")
        op.close()
        for call in (lambda: op(_fresh((16, 64), rank, dev), w), lambda: op.all_gather(_fresh((16, 64), rank, dev)),
                     lambda: op.input_slot(16 * world)):
            try:
                call()
                raise AssertionError("a closed op ran")
            except OpInputError as exc:
                assert "is closed" in str(exc), exc
    with SymmetricPool(32 << 20, group=group, backend="ipc", device=dev, timeout_s=3) as pool:
        op2 = AgGemm(group=group, pool=pool, max_m=64 * world, k=64, n_local=32, dtype=torch.bfloat16, config=cfg,
                     name="lossy")
        op2(_fresh((16, 64), rank, dev), w)  # warm: both ranks' plans built
        torch.cuda.synchronize()
        dist.barrier()
        import tp_overlap.ops.program as ops_program
        original = ops_program._memops_of
        if rank == world - 1:  # this rank's "ready" writes are lost from now on: the peers' streams wait
            ops_program._memops_of = lambda pool_, op_, step, m: [] if step.kind == "give" and \
                step.args[0].index < world else original(pool_, op_, step, m)
            op2._plans.clear()
            op2.set_eager_graphs(False)
        start = time.monotonic()
        seen = None
        try:  # every rank keeps calling: the one whose stream waits raises once the watchdog released it, the
            # others at their next call (the abort)
            while time.monotonic() - start < 20:
                op2(_fresh((16, 64), rank, dev), w)
                torch.cuda.synchronize()
                op2.check_errors()
        except (SignalTimeout, PeerAbortError) as exc:
            seen = f"{type(exc).__name__} after {time.monotonic() - start:.1f} s"
        finally:
            ops_program._memops_of = original
        assert seen is not None, "a lost signal passed silently"
        assert time.monotonic() - start < 3 + 15, seen
        notes.append(seen)
    for call in (lambda: op2(_fresh((16, 64), rank, dev), w), lambda: op2.all_gather(_fresh((16, 64), rank, dev)),
                 lambda: op2.input_slot(16 * world)):
        try:
            call()
            raise AssertionError("an op of a closed pool ran")
        except (PoolClosedError, OpInputError) as exc:
            assert "closed" in str(exc), exc
    notes.append("use after close refused")
    return "; ".join(notes)


def _checks(rank, world, full):
    from tp_overlap.symm_mem.pool import SymmetricPool
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    c = Checks(rank, world, dev)
    group = dist.group.WORLD
    with SymmetricPool(512 << 20, group=group, backend="ipc", device=dev) as pool:
        def flags():
            x = pool.reserve("x", (300, 77), torch.bfloat16, num_signals=world)
            right, left = (rank + 1) % world, (rank - 1) % world
            for step in range(1, 6):
                payload = _fresh((300, 77), step * 10 + rank, dev)
                pool.peer("x", right).copy_(payload)
                pool.signal("x", rank, step, rank=right)   # a fenced memory-operation write
                pool.wait("x", left, step, timeout_s=20)    # a memory-operation wait, bounded by the watchdog
                torch.cuda.synchronize()
                pool.check_errors()
                assert torch.equal(x.cpu(), _fresh((300, 77), step * 10 + left, "cpu")), f"step {step}"
                pool.barrier()
            return ""
        c.run("pool control flags (memops)", flags)
        cases = [("decomposed", 0.0, 1), ("decomposed", 0.5, 2), ("fused", 0.0, 2)]
        for method, lead, chunks in cases:
            for rows in (100, 256):
                c.run(f"ag_gemm {method} lead={lead} chunks={chunks} M/W={rows}",
                      lambda m=method, l=lead, ch=chunks, r=rows: _ag_case(c, pool, m, l, ch, r, 264, 136))
        # more tiles than SMs: ranks sharing the GPU pull by same-device copies, which need an SM the consumer left
        c.run("ag_gemm fused filling every SM", lambda: _ag_case(c, pool, "fused", 0.0, 2, 2048 // world, 264, 4096))
        c.run("ag_gemm decomposed without eager graphs",
              lambda: _ag_case(c, pool, "decomposed", 0.5, 1, 100, 264, 136, eager_graphs=False))
        rs_cases = [("fused", 100, dict(margin=16, comm=8)), ("epilogue_reduce", 256, dict(comm=0)),
                    ("decomposed", 100, dict(comm=4))] + ([("pair", 100, dict(comm=0))] if world == 2 else [])
        for method, rows, kw in rs_cases:
            c.run(f"gemm_rs {method} M/W={rows}", lambda m=method, r=rows, kw=kw: _rs_case(c, pool, m, r, 136, 264, **kw))
        c.run("gemm_rs bulk", lambda: _rs_case(c, pool, "decomposed", 100, 136, 264, comm=4, bulk=True))
        c.run("gemm_rs fused on tiles two B boxes wide", lambda: _rs_boxes_case(c, pool))
        for method in ("decomposed", "fused"):
            c.run(f"ag_gemm fp8 {method}", lambda m=method: _ag_case(c, pool, m, 0.0, 2, 100, 264, 136, fp8=True))
        fp8_rs = "pair" if world == 2 else "decomposed"
        c.run(f"gemm_rs fp8 {fp8_rs}", lambda: _rs_case(c, pool, fp8_rs, 100, 264, 136, comm=4 * (world != 2),
                                                        fp8=True))
        for kind, method in [("ag", "decomposed"), ("ag", "fused"), ("rs", "fused"),
                             ("rs", "pair" if world == 2 else "decomposed"), ("rs", "epilogue_reduce")]:
            rows = 256 if method == "epilogue_reduce" else 100
            c.run(f"captured {kind} {method}", lambda k=kind, m=method, r=rows: _captured(c, pool, k, m, r, 264, 136))
        for method in ("decomposed", "fused"):
            c.run(f"capture idioms ag {method}", lambda m=method: _capture_idioms(c, pool, m))
        for kind, method in [("ag", "decomposed"), ("ag", "fused"), ("rs", "fused"), ("rs", "epilogue_reduce"),
                             ("rs", "decomposed")] + ([("rs", "pair")] if world == 2 else []):
            c.run(f"eager replays {kind} {method}", lambda k=kind, m=method: _replays(c, pool, k, m))
        for kind, method in (("ag", "decomposed"), ("rs", "fused")):
            c.run(f"eager replays keyed by tensors {kind} {method}",
                  lambda k=kind, m=method: _replay_keys(c, pool, k, m))
        pool.barrier()
    if full:
        c.run("TPMLP fwd+bwd decomposed/pair", lambda: _mlp(c, 0, rs_method="pair" if world == 2 else "decomposed"))
        c.run("TPMLP fwd+bwd fused/fused", lambda: _mlp(c, 0, ag_method="fused", rs_method="fused"))
        c.run("TPMLP fp8 fwd+bwd", lambda: _mlp(c, 0, fp8=True, rs_method="pair" if world == 2 else "decomposed"))
        c.run("TPMLP fp8 whole step captured", lambda: _mlp(c, 0, fp8=True, graphed=True,
                                                            rs_method="pair" if world == 2 else "decomposed"))
        c.run("TPMLP whole step captured and replayed", lambda: _mlp(c, 0, graphed=True,
                                                                     rs_method="pair" if world == 2 else "decomposed"))
        pair = "pair" if world == 2 else "decomposed"
        for mode, fullgraph in (("default", True), ("reduce-overhead", True), ("reduce-overhead", False),
                                ("max-autotune", True)):
            c.run(f"TPMLP torch.compile(mode={mode}, fullgraph={fullgraph})",
                  lambda m=mode, f=fullgraph: _mlp(c, 0, compiled=(m, f), rs_method=pair))
    c.run("refusals (no GEMM program, pool layout)", lambda: refusals(c, dev))
    c.run("reliability (mismatch, use after close, lost signal)", lambda: _reliability(c, dev))
    c.run("a step that raises (bulk work, lead: completed; a pushed GEMM: aborted)", lambda: call_failures(c, dev))
    return c.lines


def run_worlds(prog: str, checks, default_worlds: str, argv=None, args_of=lambda world: ()) -> int:
    """`prog`'s command line (--worlds, --json): `checks(rank, world, *args_of(world))` on each world, one line
    per check (rank 0's, and every failure), the JSON report; 1 if anything failed."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}")
    parser.add_argument("--worlds", default=default_worlds)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    failed, report = False, {}
    for world in (int(w) for w in args.worlds.split(",")):
        start = time.monotonic()
        try:
            results = run_ranks(checks, world, *args_of(world), timeout_s=400, pg_timeout_s=300)
        except Exception as exc:  # noqa: BLE001 - a hung or crashed world is a failure, the next one still runs
            print(f"W={world}: FAIL {type(exc).__name__}: {str(exc)[:3000]}", flush=True)
            failed = True
            continue
        for rank, lines in enumerate(results):
            for line in lines:
                if rank == 0 or "FAIL" in line:
                    print(f"rank {rank} {line}", flush=True)
                failed |= "FAIL" in line
        report[world] = results[0]
        print(f"W={world}: {time.monotonic() - start:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            from tp_overlap.launch.output.report import command_line, git_commit
            json.dump({"commit": git_commit(), "command": command_line(), "device": torch.cuda.get_device_name(),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "failed": failed,
                       "lines": report}, f, indent=1)
    return 1 if failed else 0


def main(argv=None) -> int:
    return run_worlds("tests.gpu.smoke_one_gpu", _checks, "2,4,8", argv, args_of=lambda world: (world == 2,))


if __name__ == "__main__":
    sys.exit(main())
