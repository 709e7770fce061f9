"""The ops' Triton paths on 2 GPUs (marker `gpu`), against float64 references, with fresh inputs each step:

* GEMM+RS `epilogue_reduce`: eager steps with a scrambled workspace, the `fused` fallback for M/W not a
  multiple of 128, and CUDA-graph replays; the weight alternates between row-major [K, N] and the transpose
  view of a row-major [N, K] (what backward passes, read in place by the kernel);
* GEMM+RS `bulk` (the column-backward schedule with bulk_wgrad), eager and replayed, with its work's result,
  and `decomposed` at W = 2 with num_comm_sms = 0 (the pair schedule: push, own GEMM, one add);
* AG+GEMM `fused`, `decomposed` and `decomposed` with a lead GEMM, both weight layouts, gathered rows bit-exact;
  the lead schedule again inside CUDA-graph replays (the toggled ready flag).
"""

import torch
import torch.distributed as dist

from overlap.ag_gemm import AgGemm
from overlap.config import AgGemmConfig, GemmRsConfig
from overlap.gemm_rs import GemmRs
from symm_mem import SymmetricPool
from tests.multiproc import run_ranks


def _reference(a, w, rank, world):
    partial = (a.double() @ w.double()).contiguous()
    parts = [torch.empty_like(partial) for _ in range(world)]
    dist.all_gather(parts, partial)
    rows = a.shape[0] // world
    return sum(parts)[rank * rows:(rank + 1) * rows]


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


class _CaptureAt:
    """Eager calls of `fn` before step `capture_step`; at it one CUDA-graph capture, replayed from then on
    (a replay returns the captured call's static outputs). capture_step None: always eager."""

    def __init__(self, capture_step: int | None):
        self.capture_step, self.graph, self.static = capture_step, None, None

    def __call__(self, step: int, fn):
        if step == self.capture_step:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static = fn()
        if self.graph is None:
            return fn()
        self.graph.replay()
        return self.static


def _epilogue_reduce(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    errors = {}
    with SymmetricPool(256 << 20, group=group) as pool:
        # (M, K_local, N): tiles of 128 rows per owner with N and K tails; then M/W = 300 (the fallback)
        for i, (m, k, n) in enumerate([(2 * 512, 1000, 1064), (2 * 300, 264, 520)]):
            for method, graphs, bulk in (("epilogue_reduce", False, False), ("epilogue_reduce", True, False),
                                         ("epilogue_reduce", False, True), ("epilogue_reduce", True, True),
                                         ("decomposed", False, False), ("decomposed", True, False)):
                op = GemmRs(group=group, pool=pool, max_m=m, k_local=k, n=n, dtype=torch.bfloat16,
                            config=OpConfig(op="gemm_rs", method=method, bulk_wgrad=bulk),
                            name=f"er{i}{method}{graphs}{bulk}", timeout_s=20, cuda_graphs=graphs)
                # bulk: the column-backward schedule, with a weight-grad-like GEMM as the overlapped work
                call = (lambda a, w: op.bulk(a, w, lambda: torch.mm(a.t(), a))) if bulk else \
                    (lambda a, w: (op(a, w), None))
                a = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
                # graphs: one layout per op (a graph's pointers are fixed); eager: both, alternating
                w_rows = torch.empty(k, n, dtype=torch.bfloat16, device=dev)
                w_cols = torch.empty(n, k, dtype=torch.bfloat16, device=dev)
                worst = 0.0
                run = _CaptureAt(3 if graphs else None)
                for step in range(8):
                    gen = torch.Generator(device=dev).manual_seed(100 * step + rank)
                    a.copy_(torch.randn(m, k, generator=gen, device=dev))
                    w_rows.copy_(torch.randn(k, n, generator=gen, device=dev) / k ** 0.5)
                    w_cols.copy_(torch.randn(n, k, generator=gen, device=dev) / k ** 0.5)
                    w = w_cols.t() if (i == 0 if graphs else step % 2) else w_rows
                    # scrambled workspace, before the barrier (peers write into it once the step starts):
                    # partials whose flag has not come must never be read
                    op.partials.random_(-100, 100)
                    torch.cuda.synchronize()
                    dist.barrier()
                    out, work = run(step, lambda: call(a, w))
                    torch.cuda.synchronize()
                    op.check_errors()
                    worst = max(worst, _rel(out, _reference(a, w, rank, world)))
                    if bulk:
                        worst = max(worst, _rel(work, a.double().t() @ a.double()))
                errors[(m, method, graphs, bulk)] = worst
                del run
                op.close()
        pool.barrier()
    return errors


def test_gpu_gemm_rs_epilogue_reduce_matches_the_reference(num_gpus):
    for errors in run_ranks(_epilogue_reduce, 2, backend="nccl", timeout_s=300):
        for key, err in errors.items():
            assert err <= 1e-2, (key, err)


def _ag_error(op, a_shard, w, out, gathered, label) -> float:
    """After one AG+GEMM call: no expired wait, gathered rows bit-exact, out's error vs float64."""
    torch.cuda.synchronize()
    op.check_errors()
    shards = [torch.empty_like(a_shard) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, a_shard)
    if not torch.equal(gathered, torch.cat(shards)):
        raise AssertionError(f"{label}: gathered rows are not bit-exact")
    return _rel(out, torch.cat(shards).double() @ w.double())


def _ag_gemm(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    errors = {}
    with SymmetricPool(256 << 20, group=group) as pool:
        m, k, n = 2 * 300, 1000, 1064  # M/W, K and N tails
        # lead 0.25 of 300 rows: a 128-row lead GEMM from a_shard, then the other 472 rows in one GEMM
        for method, sm_margin, lead in (("fused", 8, 0), ("decomposed", 0, 0), ("decomposed", 0, 0.25)):
            op = AgGemm(group=group, pool=pool, max_m=m, k=k, n_local=n, dtype=torch.bfloat16,
                        config=OpConfig(op="ag_gemm", method=method, sm_margin=sm_margin, chunks_per_rank=2,
                                        lead_fraction=lead),
                        name=f"ag_{method}{lead}")
            worst = 0.0
            for step in range(6):
                gen = torch.Generator(device=dev).manual_seed(100 * step + rank)
                a_shard = torch.randn(m // world, k, generator=gen, device=dev).to(torch.bfloat16)
                w_full = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16)
                w = w_full.t() if step % 2 else w_full.t().contiguous()
                op.gathered.random_(-100, 100)  # scrambled before the barrier: peers pull from it after
                torch.cuda.synchronize()
                dist.barrier()
                out, gathered = op(a_shard, w, return_gathered=True)
                worst = max(worst, _ag_error(op, a_shard, w, out, gathered, f"{method} lead {lead} step {step}"))
            errors[(method, lead)] = worst
            op.close()
        pool.barrier()
    return errors


def test_gpu_ag_gemm_both_methods_and_weight_layouts_match_the_reference(num_gpus):
    for errors in run_ranks(_ag_gemm, 2, backend="nccl", timeout_s=300):
        for key, err in errors.items():
            assert err <= 1e-2, (key, err)


def _ag_gemm_lead_replayed(rank, world):
    """The lead schedule (128 of 300 local rows) and the toggled ready flag inside CUDA-graph replays."""
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    m, k, n = 2 * 300, 1000, 1064
    worst = 0.0
    with SymmetricPool(64 << 20, group=group) as pool:
        op = AgGemm(group=group, pool=pool, max_m=m, k=k, n_local=n, dtype=torch.bfloat16,
                    config=OpConfig(op="ag_gemm", method="decomposed", lead_fraction=0.25),
                    name="ag_lead_graph", cuda_graphs=True)
        a_shard = torch.empty(m // world, k, dtype=torch.bfloat16, device=dev)
        w = torch.empty(k, n, dtype=torch.bfloat16, device=dev)
        run = _CaptureAt(2)  # two eager calls first (warm-up, and the same op outside a graph)
        for step in range(6):
            gen = torch.Generator(device=dev).manual_seed(300 * step + rank)
            a_shard.copy_(torch.randn(m // world, k, generator=gen, device=dev))
            w.copy_(torch.randn(k, n, generator=gen, device=dev) / k ** 0.5)
            op.gathered.random_(-100, 100)  # scrambled before the barrier: peers pull from it after
            torch.cuda.synchronize()
            dist.barrier()
            out, gathered = run(step, lambda: op(a_shard, w, return_gathered=True))
            worst = max(worst, _ag_error(op, a_shard, w, out, gathered, f"replayed lead step {step}"))
        del run
        op.close()
        pool.barrier()
    return worst


def test_gpu_ag_gemm_lead_schedule_in_cuda_graph_replays(num_gpus):
    for worst in run_ranks(_ag_gemm_lead_replayed, 2, backend="nccl", timeout_s=300):
        assert worst <= 1e-2, worst


def _ag_gemm_lead_work(rank, world):
    """`lead` work (what a row layer's backward passes): run once per call, eager (both methods) and
    replayed, its result valid on return, and the consumer GEMM still exact."""
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    m, k, n = 2 * 300, 1000, 1064
    results = []
    with SymmetricPool(256 << 20, group=group) as pool:
        for method, sm_margin, graphs in (("fused", 8, False), ("decomposed", 0, False), ("decomposed", 0, True)):
            op = AgGemm(group=group, pool=pool, max_m=m, k=k, n_local=n, dtype=torch.bfloat16,
                        config=OpConfig(op="ag_gemm", method=method, sm_margin=sm_margin),
                        name=f"ag_leadwork_{method}{graphs}", cuda_graphs=graphs)
            a_shard = torch.empty(m // world, k, dtype=torch.bfloat16, device=dev)
            w = torch.empty(k, n, dtype=torch.bfloat16, device=dev)
            lead_out = torch.empty(k, k, dtype=torch.float32, device=dev)
            calls, run = [], _CaptureAt(2 if graphs else None)

            def lead():
                calls.append(1)
                torch.mm(a_shard.t().float(), a_shard.float(), out=lead_out)

            for step in range(4):
                gen = torch.Generator(device=dev).manual_seed(500 * step + rank)
                a_shard.copy_(torch.randn(m // world, k, generator=gen, device=dev))
                w.copy_(torch.randn(k, n, generator=gen, device=dev) / k ** 0.5)
                lead_out.fill_(float("nan"))
                torch.cuda.synchronize()
                dist.barrier()
                before = len(calls)
                out, gathered = run(step, lambda: op(a_shard, w, return_gathered=True, lead=lead))
                err = _ag_error(op, a_shard, w, out, gathered, f"{method} lead work step {step}")
                lead_err = _rel(lead_out, a_shard.t().double() @ a_shard.double())
                results.append((method, graphs, step, len(calls) - before, err, lead_err))
            del run
            op.close()
        pool.barrier()
    return results


def test_gpu_ag_gemm_lead_work_runs_once_per_call_eager_and_replayed(num_gpus):
    for results in run_ranks(_ag_gemm_lead_work, 2, backend="nccl", timeout_s=300):
        for method, graphs, step, calls, err, lead_err in results:
            # replayed steps run the captured work without calling it again
            assert calls == (0 if graphs and step == 3 else 1), (method, graphs, step, calls)
            assert err <= 1e-2 and lead_err <= 1e-4, (method, graphs, step, err, lead_err)
