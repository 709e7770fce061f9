"""GEMM+RS `epilogue_reduce` on 2 GPUs (marker `gpu`): eager steps with fresh inputs and a scrambled workspace,
the `fused` fallback for M/W not a multiple of 128, and CUDA-graph replays, all against a float64 reference
of the summed partials."""

import torch
import torch.distributed as dist

from overlap.config import OpConfig
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


def _epilogue_reduce(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    errors = {}
    with SymmetricPool(256 << 20, group=group) as pool:
        # (M, K_local, N): tiles of 128 rows per owner with N and K tails; then M/W = 300 (the fallback)
        for i, (m, k, n) in enumerate([(2 * 512, 1000, 1064), (2 * 300, 264, 520)]):
            for graphs in (False, True):
                op = GemmRs(group=group, pool=pool, max_m=m, k_local=k, n=n, dtype=torch.bfloat16,
                            config=OpConfig(op="gemm_rs", method="epilogue_reduce"), name=f"er{i}{graphs}",
                            timeout_s=20, cuda_graphs=graphs)
                a = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
                w = torch.empty(k, n, dtype=torch.bfloat16, device=dev)
                worst = 0.0
                graph = out_graph = None
                for step in range(8):
                    gen = torch.Generator(device=dev).manual_seed(100 * step + rank)
                    a.copy_(torch.randn(m, k, generator=gen, device=dev))
                    w.copy_(torch.randn(k, n, generator=gen, device=dev) / k ** 0.5)
                    # scrambled workspace, before the barrier (peers write into it once the step starts):
                    # partials whose flag has not come must never be read
                    op.partials.random_(-100, 100)
                    torch.cuda.synchronize()
                    dist.barrier()
                    if graphs and step == 3:
                        torch.cuda.synchronize()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            out_graph = op(a, w)
                    if graph is not None:
                        graph.replay()
                        out = out_graph
                    else:
                        out = op(a, w)
                    torch.cuda.synchronize()
                    op.check_errors()
                    worst = max(worst, _rel(out, _reference(a, w, rank, world)))
                errors[(m, graphs)] = worst
                del graph
                op.close()
        pool.barrier()
    return errors


def test_gpu_gemm_rs_epilogue_reduce_matches_the_reference(num_gpus):
    for errors in run_ranks(_epilogue_reduce, 2, backend="nccl", timeout_s=300):
        for key, err in errors.items():
            assert err <= 1e-2, (key, err)
