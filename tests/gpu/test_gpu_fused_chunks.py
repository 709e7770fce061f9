"""The fused AllGather+GEMM on 2 GPUs (marker `gpu`) where its chunk geometry matters, and its in-kernel wait:

* odd rows per rank (1, 37, 301: the last chunk of an owner shorter, or empty) with 2-4 chunks per rank,
  bf16, gathered rows bit-exact and the output against float64, a scrambled workspace between settled steps;
* a stalled peer: rank 1's GPU is held by a long kernel when the call starts, so rank 0's fused GEMM waits
  for rank 1's chunks inside the kernel; that wait's bound (the op's `timeout_s`, shorter here than the
  pool's memory-operation bound) expires first: rank 0 raises SignalTimeout naming the chunk's device flag,
  rank 1 PeerAbortError, both long before the pool's bound.
"""

import time

import torch
import torch.distributed as dist

from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import AgGemmConfig
from tp_overlap.symm_mem.errors import PeerAbortError, SignalTimeout
from tp_overlap.symm_mem.pool import SymmetricPool
from tests.multiproc import run_ranks

TOL = 1e-2
K, N = 1000, 1064


def _rel(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _odd_rows(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    results = {}
    with SymmetricPool(128 << 20, group=group) as pool:
        for chunks in (2, 3, 4):
            op = AgGemm(group=group, pool=pool, max_m=301 * world, k=K, n_local=N, dtype=torch.bfloat16,
                        config=AgGemmConfig(method="fused", sm_margin=8, chunks_per_rank=chunks),
                        name=f"ag.fused.{chunks}")
            for rows in (1, 37, 301):
                worst, exact = 0.0, True
                for step in range(3):
                    gen = torch.Generator(device=dev).manual_seed(1000 * chunks + 100 * step + rank)
                    a_shard = torch.randn(rows, K, generator=gen, device=dev).to(torch.bfloat16)
                    w = (torch.randn(K, N, generator=gen, device=dev) / K ** 0.5).to(torch.bfloat16)
                    dist.broadcast(w, 0)
                    torch.cuda.synchronize()
                    dist.barrier()
                    op.gathered.random_(-100, 100)   # settled: nobody reads it now
                    torch.cuda.synchronize()
                    dist.barrier()
                    out, gathered = op(a_shard, w, return_gathered=True)
                    torch.cuda.synchronize()
                    op.check_errors()
                    shards = [torch.empty_like(a_shard) for _ in range(world)]
                    dist.all_gather(shards, a_shard)
                    full = torch.cat(shards)
                    exact &= torch.equal(gathered, full)
                    worst = max(worst, _rel(out, full.double() @ w.double()))
                results[(chunks, rows)] = (exact, worst)
            op.close()
        pool.barrier()
    return results


def test_gpu_fused_ag_gemm_with_odd_rows_per_rank_and_2_to_4_chunks(num_gpus):
    for results in run_ranks(_odd_rows, 2, backend="nccl", timeout_s=420):
        assert len(results) == 9
        for key, (exact, err) in results.items():
            assert exact and err <= TOL, (key, exact, err)


POOL_TIMEOUT_S, KERNEL_TIMEOUT_S = 8.0, 1.0


def _stalled_peer(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    pool = SymmetricPool(64 << 20, group=group, timeout_s=POOL_TIMEOUT_S)
    op = AgGemm(group=group, pool=pool, max_m=256 * world, k=K, n_local=N, dtype=torch.bfloat16,
                config=AgGemmConfig(method="fused", chunks_per_rank=2), name="ag.stall")
    op.timeout_s = KERNEL_TIMEOUT_S   # the fused kernel's wait bound, read when the call's program is built
    a_shard = torch.randn(256, K, device=dev).to(torch.bfloat16)
    w = torch.randn(K, N, device=dev).to(torch.bfloat16)
    try:
        op(a_shard, w)                # warm-up: the kernel compiled, the program built, the protocol healthy
        torch.cuda.synchronize()
        op.check_errors()
        dist.barrier()
        start = time.monotonic()
        if rank == 1:                 # this GPU is busy (~2-3 s) when the call is issued: it publishes late
            torch.cuda._sleep(5_000_000_000)
        op(a_shard, w)
        torch.cuda.synchronize()
        op.check_errors()
        return "no error", "", time.monotonic() - start
    except (SignalTimeout, PeerAbortError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    finally:
        pool.close()


def test_gpu_a_stalled_peer_times_out_the_fused_kernels_chunk_wait(num_gpus):
    (kind0, msg0, t0), (kind1, msg1, t1) = run_ranks(_stalled_peer, 2, backend="nccl", timeout_s=180)
    # rank 0's kernel waited for a chunk of rank 1's rows: its device flag (owner 1's chunks are 2 and 3)
    assert kind0 == "SignalTimeout" and "from peer rank 1 for flag ag.stall.a (device)[" in msg0, msg0
    assert msg0.split("(device)[")[1][0] in "23", msg0
    assert kind1 == "PeerAbortError" and "rank 0 aborted the group: a bounded wait timed out" in msg1, msg1
    assert t0 < POOL_TIMEOUT_S and t1 < POOL_TIMEOUT_S + 5, (t0, t1)   # the kernel's bound, not the pool's


def main() -> int:
    """One GPU: both cases with 2 processes sharing it (gloo, the ipc pool), printed; exit 1 on a failure.
    `python -m tests.gpu.test_gpu_fused_chunks`"""
    failed = False
    for results in run_ranks(_odd_rows, 2, backend="gloo", timeout_s=420):
        for key, (exact, err) in sorted(results.items()):
            ok = exact and err <= TOL
            failed |= not ok
            print(f"odd rows (chunks, rows per rank) {key}: {'ok' if ok else 'FAIL'} exact={exact} rel={err:.1e}")
    stalled = run_ranks(_stalled_peer, 2, backend="gloo", timeout_s=180)
    for rank, (kind, message, seconds) in enumerate(stalled):
        print(f"stalled peer, rank {rank}: {kind} after {seconds:.1f} s: {message[:200]}")
    failed |= stalled[0][0] != "SignalTimeout" or stalled[1][0] != "PeerAbortError"
    return 1 if failed else 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
