"""The ops on 2 GPUs (marker `gpu`), against float64 references, with fresh inputs each step:

* GEMM+RS, every method (`epilogue_reduce`, `fused`, `decomposed`, `pair`) and `bulk` (the column-backward
  schedule, with its work's result), eager with a scrambled workspace and as CUDA-graph replays; the weight
  alternates between row-major [K, N] and the transpose view of a row-major [N, K] (what backward passes,
  read in place); M/W = 300 (not a multiple of 128, N and K tails) runs the other methods, and
  `epilogue_reduce` refuses it with the same OpInputError on every rank (the old silent fallback to `fused`
  is gone: a preset picks another method for such M with a by_m bucket);
* AG+GEMM `fused`, `decomposed` and `decomposed` with a lead GEMM, both weight layouts, the zero-copy
  `input_slot` path, gathered rows bit-exact; the lead schedule inside CUDA-graph replays; `lead` work run
  once per call eager and not again by a replay.

Every call can be captured now (one protocol of toggled flags, no host epochs), so the ops take no
`cuda_graphs=` switch; a capture on another stream than the last eager call follows a synchronize
(overlap/ops/base.py).
"""

import torch
import torch.distributed as dist

from tp_overlap.ops.validate import OpInputError
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.symm_mem.pool import SymmetricPool
from tests.multiproc import run_ranks

TOL = 1e-2  # bf16 GEMMs: relative Frobenius error vs float64


def _reference(a, w, rank, world):
    """This rank's rows of sum over ranks of a @ w, in float64."""
    partial = (a.double() @ w.double()).contiguous()
    parts = [torch.empty_like(partial) for _ in range(world)]
    dist.all_gather(parts, partial)
    rows = a.shape[0] // world
    return sum(parts)[rank * rows:(rank + 1) * rows]


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _settle():
    """Every rank's earlier work done (its pulls and pushes too) before a workspace is scrambled or a step
    starts."""
    torch.cuda.synchronize()
    dist.barrier()


class _CaptureAt:
    """Eager calls of `fn` before step `capture_step`; at it one CUDA-graph capture on the current (side)
    stream, replayed from then on (a replay returns the captured call's static outputs). None: always eager."""

    def __init__(self, capture_step: int | None):
        self.capture_step, self.graph, self.static = capture_step, None, None

    def __call__(self, step: int, fn):
        if step == self.capture_step:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=torch.cuda.current_stream()):
                self.static = fn()
        if self.graph is None:
            return fn()
        self.graph.replay()
        return self.static


# ----- GEMM + ReduceScatter ---------------------------------------------------------------------------
RS_CASES = {  # (M/W, K_local, N) -> (method or "bulk", captured)
    (512, 1000, 1064): [("epilogue_reduce", False), ("epilogue_reduce", True), ("fused", False), ("fused", True),
                        ("decomposed", False), ("decomposed", True), ("pair", False), ("pair", True),
                        ("bulk", False), ("bulk", True)],
    (300, 264, 520): [("fused", False), ("fused", True), ("decomposed", False), ("pair", False), ("bulk", False)],
}


def _rs_config(method: str) -> GemmRsConfig:
    # bulk is a method of the op, not a config: it runs on any GemmRs (here a decomposed one)
    return GemmRsConfig().with_method("decomposed" if method == "bulk" else method)


def _gemm_rs(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    errors, refusals = {}, []
    side = torch.cuda.Stream()  # warm-up, eager calls and captures on one stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), SymmetricPool(256 << 20, group=group) as pool:
        for i, ((rows, k, n), cases) in enumerate(RS_CASES.items()):
            m = rows * world
            for method, graphs in cases:
                op = GemmRs(group=group, pool=pool, max_m=m, k_local=k, n=n, dtype=torch.bfloat16,
                            config=_rs_config(method), name=f"rs{i}.{method}.{int(graphs)}")
                # bulk: a weight-grad-like GEMM as the overlapped work
                call = (lambda a, w: op.bulk(a, w, lambda: torch.mm(a.t(), a))) if method == "bulk" else \
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
                    # scrambled workspace between settled steps: partials whose flag has not come must never
                    # be read
                    _settle()
                    op.partials.random_(-100, 100)
                    _settle()
                    out, work = run(step, lambda: call(a, w))
                    torch.cuda.synchronize()
                    op.check_errors()
                    worst = max(worst, _rel(out, _reference(a, w, rank, world)))
                    if method == "bulk":
                        worst = max(worst, _rel(work, a.double().t() @ a.double()))
                errors[(rows, method, graphs)] = worst
                del run
                op.close()
        # epilogue_reduce needs whole 128-row blocks per owner: refused before any communication
        m = 300 * world
        op = GemmRs(group=group, pool=pool, max_m=m, k_local=264, n=520, dtype=torch.bfloat16,
                    config=_rs_config("epilogue_reduce"), name="rs.refused")
        try:
            op(torch.randn(m, 264, device=dev).to(torch.bfloat16), torch.randn(264, 520, device=dev).to(torch.bfloat16))
        except OpInputError as exc:
            refusals.append(str(exc))
        op.close()
        pool.barrier()
    return errors, refusals


def test_gpu_gemm_rs_every_method_eager_and_replayed_matches_the_reference(num_gpus):
    results = run_ranks(_gemm_rs, 2, backend="nccl", timeout_s=420)
    for errors, _ in results:
        assert len(errors) == sum(len(cases) for cases in RS_CASES.values())
        for key, err in errors.items():
            assert err <= TOL, (key, err)
    assert results[0][1] == results[1][1] and len(results[0][1]) == 1, results  # the same error on both ranks
    assert "epilogue_reduce needs M/W % 128 == 0" in results[0][1][0], results[0][1]


# ----- AllGather + GEMM -------------------------------------------------------------------------------
def _ag_error(op, a_shard, w, out, gathered, label) -> float:
    """After one AG+GEMM call: no expired wait, gathered rows bit-exact, out's error vs float64."""
    torch.cuda.synchronize()
    op.check_errors()
    shards = [torch.empty_like(a_shard) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, a_shard)
    if not torch.equal(gathered, torch.cat(shards)):
        raise AssertionError(f"{label}: gathered rows are not bit-exact")
    return _rel(out, torch.cat(shards).double() @ w.double())


AG_M, AG_K, AG_N = 2 * 300, 1000, 1064  # M/W, K and N tails


def _ag_gemm(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    m, k, n = AG_M, AG_K, AG_N
    errors = {}
    with SymmetricPool(256 << 20, group=group) as pool:
        # lead 0.25 of 300 rows: a 128-row lead GEMM (rounded up) from a_shard, then the rest
        for method, sm_margin, lead in (("fused", 8, 0.0), ("decomposed", 0, 0.0), ("decomposed", 0, 0.25)):
            op = AgGemm(group=group, pool=pool, max_m=m, k=k, n_local=n, dtype=torch.bfloat16,
                        config=AgGemmConfig(method=method, sm_margin=sm_margin, chunks_per_rank=2,
                                            lead_fraction=lead),
                        name=f"ag_{method}{lead}")
            worst = 0.0
            for step in range(6):
                gen = torch.Generator(device=dev).manual_seed(100 * step + rank)
                a_shard = torch.randn(m // world, k, generator=gen, device=dev).to(torch.bfloat16)
                w_full = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16)
                w = w_full.t() if step % 2 else w_full.t().contiguous()
                _settle()
                op.gathered.random_(-100, 100)  # scrambled between settled steps: peers pull from it after
                _settle()
                if step == 4:  # zero copy: the shard written straight into this rank's pool slot
                    slot = op.input_slot(m)
                    slot.copy_(a_shard)
                    out, gathered = op(slot, w, return_gathered=True)
                else:
                    out, gathered = op(a_shard, w, return_gathered=True)
                worst = max(worst, _ag_error(op, a_shard, w, out, gathered, f"{method} lead {lead} step {step}"))
            errors[(method, lead)] = worst
            op.close()
        pool.barrier()
    return errors


def test_gpu_ag_gemm_both_methods_and_weight_layouts_match_the_reference(num_gpus):
    for errors in run_ranks(_ag_gemm, 2, backend="nccl", timeout_s=300):
        assert len(errors) == 3
        for key, err in errors.items():
            assert err <= TOL, (key, err)


def _ag_gemm_lead_replayed(rank, world):
    """The lead schedule (128 of 300 local rows first) inside CUDA-graph replays with fresh inputs."""
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    m, k, n = AG_M, AG_K, AG_N
    worst = 0.0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), SymmetricPool(64 << 20, group=group) as pool:
        op = AgGemm(group=group, pool=pool, max_m=m, k=k, n_local=n, dtype=torch.bfloat16,
                    config=AgGemmConfig(method="decomposed", lead_fraction=0.25), name="ag_lead_graph")
        a_shard = torch.empty(m // world, k, dtype=torch.bfloat16, device=dev)
        w = torch.empty(k, n, dtype=torch.bfloat16, device=dev)
        run = _CaptureAt(2)  # two eager calls first (warm-up, and the same op outside a graph)
        for step in range(6):
            gen = torch.Generator(device=dev).manual_seed(300 * step + rank)
            a_shard.copy_(torch.randn(m // world, k, generator=gen, device=dev))
            w.copy_(torch.randn(k, n, generator=gen, device=dev) / k ** 0.5)
            _settle()
            op.gathered.random_(-100, 100)  # scrambled between settled steps: peers pull from it after
            _settle()
            out, gathered = run(step, lambda: op(a_shard, w, return_gathered=True))
            worst = max(worst, _ag_error(op, a_shard, w, out, gathered, f"replayed lead step {step}"))
        del run
        op.close()
        pool.barrier()
    return worst


def test_gpu_ag_gemm_lead_schedule_in_cuda_graph_replays(num_gpus):
    for worst in run_ranks(_ag_gemm_lead_replayed, 2, backend="nccl", timeout_s=300):
        assert worst <= TOL, worst


def _ag_gemm_lead_work(rank, world):
    """`lead` work (what a row layer's backward passes): run once per call, eager (both methods) and
    replayed, its result valid on return, and the consumer GEMM still exact."""
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    m, k, n = AG_M, AG_K, AG_N
    results = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), SymmetricPool(256 << 20, group=group) as pool:
        for method, sm_margin, graphs in (("fused", 8, False), ("decomposed", 0, False), ("decomposed", 0, True)):
            op = AgGemm(group=group, pool=pool, max_m=m, k=k, n_local=n, dtype=torch.bfloat16,
                        config=AgGemmConfig(method=method, sm_margin=sm_margin),
                        name=f"ag_leadwork_{method}{graphs}")
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
                _settle()
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
        assert len(results) == 3 * 4
        for method, graphs, step, calls, err, lead_err in results:
            # the capture (step 2) calls the work once; a replay (step 3) runs it without calling it again
            assert calls == (0 if graphs and step == 3 else 1), (method, graphs, step, calls)
            assert err <= TOL and lead_err <= 1e-4, (method, graphs, step, err, lead_err)


# ----- the key of an eager call's recorded graph ---------------------------------------------------------
def _graph_keys(rank, world):
    """Eager calls alternating between two sets of input tensors at one M, refilled every step (each output
    freed after its check, so that the allocator hands its address back, as in a training loop): a call
    replays only a graph recorded from its own tensors. A key without the tensors' addresses replays the
    other set's graph from the third call on: it reads the other inputs and writes the other call's output."""
    dev = torch.device("cuda", torch.cuda.current_device())
    group, rows, k, n = dist.group.WORLD, 256, 264, 136
    worst = 0.0
    with SymmetricPool(64 << 20, group=group) as pool:
        rs = GemmRs(group=group, pool=pool, max_m=rows * world, k_local=k, n=n, dtype=torch.bfloat16,
                    config=GemmRsConfig(method="decomposed", num_comm_sms=4), name="keys.rs")
        ag = AgGemm(group=group, pool=pool, max_m=rows * world, k=k, n_local=n, dtype=torch.bfloat16,
                    config=AgGemmConfig(method="decomposed"), name="keys.ag")
        sets = [(torch.empty(rows * world, k, dtype=torch.bfloat16, device=dev),
                 torch.empty(rows, k, dtype=torch.bfloat16, device=dev),
                 torch.empty(k, n, dtype=torch.bfloat16, device=dev)) for _ in range(2)]
        for step in range(8):
            a_rs, a_ag, w = sets[step % 2]
            gen = torch.Generator(device=dev).manual_seed(100 * step + rank)
            for t in (a_rs, a_ag):
                t.copy_(torch.randn(t.shape, generator=gen, device=dev))
            w.copy_(torch.randn(k, n, generator=torch.Generator(device=dev).manual_seed(step), device=dev) / k ** 0.5)
            _settle()
            out_rs, out_ag = rs(a_rs, w), ag(a_ag, w)
            torch.cuda.synchronize()
            rs.check_errors()
            gathered = [torch.empty_like(a_ag) for _ in range(world)]
            dist.all_gather(gathered, a_ag)
            worst = max(worst, _rel(out_rs, _reference(a_rs, w, rank, world)),
                        _rel(out_ag, torch.cat(gathered).double() @ w.double()))
            del out_rs, out_ag, gathered
        graphs = (rs.num_graphs, ag.num_graphs)
        rs.close()
        ag.close()
        pool.barrier()
    return worst, graphs


def test_gpu_an_eager_call_replays_only_a_graph_recorded_from_its_own_tensors(num_gpus):
    for worst, graphs in run_ranks(_graph_keys, 2, backend="nccl", timeout_s=240):
        assert worst <= TOL, worst
        assert min(graphs) >= 1, graphs   # calls were replayed (else this test would not test the key)
