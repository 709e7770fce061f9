"""Correctness smoke of every CUDA code path with 2 processes sharing ONE GPU (gloo between them).

For a machine with a single GPU: no NCCL (it refuses two ranks on one device), so references are built
from CPU copies exchanged with gloo. Timing means nothing here (the two contexts time-slice the GPU).
Run: python -m tests.gpu.smoke_one_gpu  (prints one line per check, exits non-zero on failure)
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

from tests.multiproc import run_ranks


def _gather_cpu(t: torch.Tensor) -> list[torch.Tensor]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.cpu())
    return out


def _rel(out, ref) -> float:
    return ((out.double().cpu() - ref.double()).norm() / ref.double().norm()).item()


def _checks(rank, world):
    from ipc import IpcPool
    from overlap.ag_gemm import AgGemm
    from overlap.config import AgGemmConfig, GemmRsConfig
    from overlap.gemm_rs import GemmRs
    from overlap.triton_gemm import triton_mm
    from symm_mem import PeerAbortError, SignalTimeout, SymmetricPool

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    group = dist.group.WORLD
    report = []

    def check(name, fn):
        try:
            report.append(f"{name}: {fn()}")
        except Exception as exc:
            report.append(f"{name}: FAIL {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")

    def triton_alone():
        gen = torch.Generator().manual_seed(5)
        a = torch.randn(1000, 264, generator=gen).bfloat16().to(dev)
        b = torch.randn(264, 520, generator=gen).bfloat16().to(dev)
        out = torch.full((1000, 520), float("nan"), dtype=torch.bfloat16, device=dev)
        triton_mm(a, b, out, num_programs=100)
        err = _rel(out, a.double().cpu() @ b.double().cpu())
        assert err < 1e-2, err
        return f"ok rel={err:.2e}"

    check("triton_mm", triton_alone)

    pool = SymmetricPool(256 << 20, group=group, backend="ipc", device=dev)

    def pool_flags():
        x = pool.reserve("x", (300, 77), torch.bfloat16, num_signals=world)
        for step in range(1, 6):
            payload = torch.randn(300, 77, generator=torch.Generator().manual_seed(step * 10 + rank))
            pool.peer("x", 1 - rank).copy_(payload.bfloat16().to(dev))
            pool.signal("x", rank, step, rank=1 - rank)
            pool.wait("x", 1 - rank, step, timeout_s=20)
            torch.cuda.synchronize()
            pool.check_errors()
            want = torch.randn(300, 77, generator=torch.Generator().manual_seed(step * 10 + 1 - rank)).bfloat16()
            assert torch.equal(x.cpu(), want), f"step {step}"
            pool.barrier()
            torch.cuda.synchronize()
        return "ok"

    check("pool signal/wait", pool_flags)

    def ipc():
        t = torch.randn(999, device=dev)
        with IpcPool(group=group) as p:
            p.exchange({"t": t})
            peer = p.peer("t", 1 - rank).cpu()
            assert torch.equal(peer, _gather_cpu(t)[1 - rank])
            dist.barrier()
            return f"ok opened={p.stats().opened}"

    check("ipc", ipc)

    for method, chunks in (("decomposed", 1), ("decomposed", 3), ("fused", 1), ("fused", 2)):
        def ag(method=method, chunks=chunks):
            m, k, n = 2 * 333, 200, 136
            op = AgGemm(group=group, pool=pool, max_m=m, k=k, n_local=n, dtype=torch.bfloat16,
                        config=OpConfig(op="ag_gemm", method=method, chunks_per_rank=chunks),
                        name=f"ag_{method}_{chunks}")
            errs = []
            for step in range(3):
                gen = torch.Generator().manual_seed(100 * step + rank)
                a_shard = torch.randn(m // world, k, generator=gen).bfloat16().to(dev)
                w = torch.randn(k, n, generator=torch.Generator().manual_seed(7 + step)).bfloat16().to(dev)
                out, a = op(a_shard, w, return_gathered=True)
                torch.cuda.synchronize()
                full = torch.cat(_gather_cpu(a_shard))
                assert torch.equal(a.cpu(), full), "gathered a not bit-exact"
                errs.append(_rel(out, full.double() @ w.double().cpu()))
                pool.check_errors()
                dist.barrier()
            assert max(errs) < 1e-2, errs
            return f"ok rel={max(errs):.2e}"
        check(f"ag_gemm {method} chunks={chunks}", ag)

    # epilogue_reduce needs M/W % 128 == 0 (2 * 256 rows); at 2 * 300 it runs as fused
    for method, margin, rows in (("decomposed", 8, 300), ("fused", 16, 300), ("fused", 0, 300),
                                 ("epilogue_reduce", 0, 256)):
        def rs(method=method, margin=margin, rows=rows):
            m, k, n = 2 * rows, 264, 520
            op = GemmRs(group=group, pool=pool, max_m=m, k_local=k, n=n, dtype=torch.bfloat16,
                        config=OpConfig(op="gemm_rs", method=method, sm_margin=margin, num_comm_sms=max(8, margin)),
                        name=f"rs_{method}_{margin}_{rows}", timeout_s=20)
            errs = []
            for step in range(3):
                gen = torch.Generator().manual_seed(200 * step + rank)
                a = torch.randn(m, k, generator=gen).bfloat16().to(dev)
                w = torch.randn(k, n, generator=gen).bfloat16().to(dev)
                out = op(a, w)
                torch.cuda.synchronize()
                op.check_errors()
                parts = _gather_cpu(torch.mm(a.float(), w.float()))
                ref = sum(p.double() for p in parts)[rank * (m // world):(rank + 1) * (m // world)]
                errs.append(_rel(out, ref))
                dist.barrier()
            assert max(errs) < 1e-2, errs
            return f"ok rel={max(errs):.2e}"
        check(f"gemm_rs {method} margin={margin} M={2 * rows}", rs)

    for ag_method, rs_method in (("decomposed", "decomposed"), ("fused", "fused")):
        def mlp_check(ag_method=ag_method, rs_method=rs_method):
            import dataclasses

            from overlap.config import OpPreset
            from overlap.presets import load_preset
            from overlap.layers import TPMLP, MLPReference, pool_requirements, shard_fc1, shard_fc2, shard_rows
            hidden, ffn, m = 264, 344, 2 * 300
            cfg = load_preset("NVIDIA H200", 2)
            cfg = dataclasses.replace(
                cfg, ag_gemm=OpPreset(default=dataclasses.replace(cfg.ag_gemm.default, method=ag_method)),
                gemm_rs=OpPreset(default=dataclasses.replace(cfg.gemm_rs.default, method=rs_method)))
            nbytes, words = pool_requirements(hidden=hidden, max_m=m, world_size=world, dtype=torch.bfloat16)
            with SymmetricPool(nbytes, group=group, backend="ipc", device=dev, num_signal_words=words + 64) as lp:
                mlp = TPMLP(hidden, ffn, group=group, max_m=m, dtype=torch.bfloat16, pool=lp, config=cfg,
                            overlap=True, device=dev, name=f"mlp_{ag_method}")
                ref = MLPReference(hidden, ffn, seed=3, dtype=torch.bfloat16).double()
                mlp.load_full_weights(ref.fc1_weight.detach().bfloat16().to(dev),
                                      ref.fc2_weight.detach().bfloat16().to(dev))
                errs = []
                for step in range(3):
                    gen = torch.Generator().manual_seed(step)
                    x = torch.randn(m, hidden, generator=gen).bfloat16().double()
                    dy = torch.randn(m, hidden, generator=gen).bfloat16().double()
                    xf = x.clone().requires_grad_(True)
                    ref.zero_grad()
                    ref(xf).backward(dy)
                    xs = shard_rows(x, rank, world).bfloat16().to(dev).requires_grad_(True)
                    mlp.zero_grad()
                    y = mlp(xs)
                    y.backward(shard_rows(dy, rank, world).bfloat16().to(dev))
                    torch.cuda.synchronize()
                    mlp.check_errors()
                    with torch.no_grad():
                        y_ref = ref(x)
                    errs += [_rel(y, shard_rows(y_ref, rank, world)),
                             _rel(xs.grad, shard_rows(xf.grad, rank, world)),
                             _rel(mlp.fc1.weight.grad, shard_fc1(ref.fc1_weight.grad, rank, world, "swiglu")),
                             _rel(mlp.fc2.weight.grad, shard_fc2(ref.fc2_weight.grad, rank, world))]
                    dist.barrier()
                mlp.close()
                torch.cuda.synchronize()
                dist.barrier()
            assert max(errs) < 2e-2, errs
            return f"ok max rel={max(errs):.2e} (output, dx, dW1, dW2; 3 steps)"
        check(f"TPMLP swiglu fwd+bwd ag={ag_method} rs={rs_method}", mlp_check)

    def graphed(make_op, static, fill, run, expect, replays=30):
        """Warm up, capture one call on a side stream, replay with fresh inputs in `static` (every 7th step
        an eager call instead: it shares the device epoch counter); returns the worst error of all steps."""
        op = make_op()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        worst = 0.0
        with torch.cuda.stream(side):
            for step in range(3):  # warm-up: every kernel is compiled before the capture
                fill(static, step)
                worst = max(worst, expect(run(op, static), step))
            torch.cuda.synchronize()
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                captured = run(op, static)
            for step in range(3, 3 + replays):
                fill(static, step)
                if step % 7 == 3:
                    got = run(op, static)
                else:
                    graph.replay()
                    got = captured
                worst = max(worst, expect(got, step))
        torch.cuda.synchronize()
        op.check_errors()
        dist.barrier()
        del graph
        op.close()
        return f"ok worst={worst:.2e} ({replays} steps, {replays - replays // 7} replays)"

    def fresh(step, rows, cols, salt):
        gen = torch.Generator().manual_seed(salt + 1000 * step + rank)
        return torch.randn(rows, cols, generator=gen).bfloat16()

    for method in ("decomposed", "fused"):
        m, k, n = 2 * 333, 200, 136
        w_ag = torch.randn(k, n, generator=torch.Generator().manual_seed(9)).bfloat16().to(dev)

        def ag_expect(got, step, m=m, k=k, w=w_ag):
            out, a = got
            full = torch.cat(_gather_cpu(fresh(step, m // world, k, 1)))
            assert torch.equal(a.cpu(), full), f"gathered a not bit-exact at step {step}"
            err = _rel(out, full.double() @ w.double().cpu())
            assert err < 1e-2, (step, err)
            return err

        check(f"CUDA graph AgGemm {method} chunks=2", lambda method=method, m=m, k=k, n=n, w=w_ag, e=ag_expect: graphed(
            lambda: AgGemm(group=group, pool=pool, max_m=m, k=k, n_local=n, dtype=torch.bfloat16,
                           config=OpConfig(op="ag_gemm", method=method, chunks_per_rank=2),
                           name=f"agg_{method}", cuda_graphs=True),
            torch.empty(m // world, k, dtype=torch.bfloat16, device=dev),
            lambda static, step: static.copy_(fresh(step, m // world, k, 1).to(dev)),
            lambda op, static: op(static, w, return_gathered=True), e))

    for method, margin in (("decomposed", 8), ("fused", 16)):
        m, k, n = 2 * 300, 264, 520
        w_rs = torch.randn(k, n, generator=torch.Generator().manual_seed(10 + rank)).bfloat16().to(dev)

        def rs_expect(out, step, m=m, k=k, w=w_rs):
            parts = _gather_cpu(fresh(step, m, k, 2).float() @ w.float().cpu())
            ref = sum(p.double() for p in parts)[rank * (m // world):(rank + 1) * (m // world)]
            err = _rel(out, ref)
            assert err < 1e-2, (step, err)
            return err

        check(f"CUDA graph GemmRs {method} margin={margin}",
              lambda method=method, margin=margin, m=m, k=k, n=n, w=w_rs, e=rs_expect: graphed(
                  lambda: GemmRs(group=group, pool=pool, max_m=m, k_local=k, n=n, dtype=torch.bfloat16,
                                 config=OpConfig(op="gemm_rs", method=method, sm_margin=margin,
                                                 num_comm_sms=max(8, margin)),
                                 name=f"rsg_{method}", timeout_s=20, cuda_graphs=True),
                  torch.empty(m, k, dtype=torch.bfloat16, device=dev),
                  lambda static, step: static.copy_(fresh(step, m, k, 2).to(dev)),
                  lambda op, static: op(static, w), e))

    def mlp_graph():
        from overlap.presets import load_preset
        from overlap.layers import TPMLP, MLPReference, pool_requirements
        hidden, ffn, m = 264, 344, 2 * 300
        nbytes, words = pool_requirements(hidden=hidden, max_m=m, world_size=world, dtype=torch.bfloat16,
                                          cuda_graphs=True)
        with SymmetricPool(nbytes, group=group, backend="ipc", device=dev, num_signal_words=words + 64) as lp:
            mlp = TPMLP(hidden, ffn, group=group, max_m=m, dtype=torch.bfloat16, pool=lp,
                        config=load_preset("NVIDIA H200", 2), overlap=True, device=dev, name="mlp_graph",
                        cuda_graphs=True)
            ref = MLPReference(hidden, ffn, seed=4, dtype=torch.bfloat16)
            mlp.load_full_weights(ref.fc1_weight.detach().to(dev), ref.fc2_weight.detach().to(dev))
            inputs = [(torch.randn(m // world, hidden, generator=torch.Generator().manual_seed(50 + 2 * i + rank)),
                       torch.randn(m // world, hidden, generator=torch.Generator().manual_seed(51 + 2 * i + rank)))
                      for i in range(4)]
            inputs = [(x.bfloat16().to(dev), dy.bfloat16().to(dev)) for x, dy in inputs]

            def step_eager(x, dy):
                x = x.clone().requires_grad_(True)
                mlp.zero_grad(set_to_none=True)
                y = mlp(x)
                y.backward(dy)
                return y.detach().clone(), x.grad.clone(), mlp.fc1.weight.grad.clone(), mlp.fc2.weight.grad.clone()

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in range(3):
                    step_eager(*inputs[i % 4])
                expected = [step_eager(x, dy) for x, dy in inputs]
                torch.cuda.synchronize()
                dist.barrier()
                static_x = torch.empty_like(inputs[0][0]).requires_grad_(True)
                static_dy = torch.empty_like(inputs[0][1])
                mlp.zero_grad(set_to_none=True)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    static_y = mlp(static_x)
                    static_y.backward(static_dy)
                mismatches, worst = 0, 0.0
                for replay in range(40):
                    x, dy = inputs[replay % 4]
                    with torch.no_grad():
                        static_x.copy_(x)
                        static_dy.copy_(dy)
                    graph.replay()
                    got = (static_y, static_x.grad, mlp.fc1.weight.grad, mlp.fc2.weight.grad)
                    errs = [_rel(a, b.cpu()) for a, b in zip(got, expected[replay % 4])]
                    worst = max([worst] + errs)
                    mismatches += max(errs) > 0
            torch.cuda.synchronize()
            mlp.check_errors()
            dist.barrier()
            del graph
            mlp.close()
        assert mismatches == 0, (mismatches, worst)
        return "ok 40 replays of forward+backward bit-equal to eager (output, dx, dW1, dW2)"

    check("CUDA graph TPMLP fwd+bwd", mlp_graph)

    torch.cuda.synchronize()
    dist.barrier()
    pool.close()
    # last: an expired wait aborts its pool for every rank (by design), so it gets a pool of its own
    def wait_timeout():
        tpool = SymmetricPool(1 << 20, group=group, backend="ipc", device=dev)
        tpool.reserve("t", (4,), torch.float32, num_signals=1)
        tpool.wait("t", 0, 99, timeout_s=0.2)
        torch.cuda.synchronize()
        try:
            tpool.check_errors()
        except (SignalTimeout, PeerAbortError) as exc:
            return f"ok ({type(exc).__name__}: {exc})"
        finally:
            dist.barrier()
            tpool.close()
        raise AssertionError("no timeout reported")

    check("device wait timeout", wait_timeout)
    return report


def main() -> int:
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"})
    reports = run_ranks(_checks, 2, backend="gloo", timeout_s=500)
    failed = False
    for rank, report in enumerate(reports):
        for line in report:
            print(f"rank {rank} | {line}")
            failed |= ": FAIL" in line
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
