"""Failures on real GPUs: a rank that stops signalling, a rank killed mid-loop (2 GPUs, NCCL group)."""

import os
import signal
import time

import torch
import torch.distributed as dist

from tp_overlap.ops import program
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.symm_mem.errors import PeerAbortError, PeerLostError, SignalTimeout
from tp_overlap.symm_mem.pool import SymmetricPool
from tests.multiproc import run_ranks

TIMEOUT_S = 2.0  # the pool's bound on every wait


def _lose_ready_signals(op, world) -> None:
    """From now on this rank's "ready" writes of `op` are lost (its rows are still copied into its slot, the
    flag never arrives): a signalling path that stops working. The flag writes are memory operations built
    with the op's plans, so the plans are rebuilt and the eager calls no longer replay recorded graphs."""
    original = program._memops_of

    def lossy(pool, op_name, step, memops):
        flag = step.args[0] if step.kind == "give" else None
        if flag is not None and flag.region == op.flags.region and flag.index < world:  # ready[*]
            return []
        return original(pool, op_name, step, memops)

    program._memops_of = lossy
    op._plans.clear()
    op.set_eager_graphs(False)


def _stops_signalling(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = SymmetricPool(64 << 20, group=dist.group.WORLD, timeout_s=TIMEOUT_S)
    op = AgGemm(group=dist.group.WORLD, pool=pool, max_m=512, k=64, n_local=32, dtype=torch.bfloat16,
                config=AgGemmConfig(method="decomposed"))
    t0 = time.monotonic()
    try:
        for step in range(8):
            if step == 2:  # two healthy calls first: every kernel compiled, the protocol exercised
                torch.cuda.synchronize()
                dist.barrier()
                if rank == 1:
                    _lose_ready_signals(op, world)
            op(torch.randn(256, 64, device=dev, dtype=torch.bfloat16),
               torch.randn(64, 32, device=dev, dtype=torch.bfloat16))
            op.check_errors()   # a step boundary: synchronises and raises on every rank
    except (SignalTimeout, PeerAbortError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0, op.calls
    finally:
        pool.close()
    return "no error", "", time.monotonic() - t0, op.calls


def test_gpu_a_rank_that_stops_signalling_makes_every_rank_raise(num_gpus):
    results = run_ranks(_stops_signalling, 2, backend="nccl", timeout_s=180)
    assert all(kind != "no error" for kind, *_ in results), results
    assert any(kind == "SignalTimeout" for kind, *_ in results), results
    for kind, msg, elapsed, calls in results:
        assert elapsed < TIMEOUT_S + 20, (kind, elapsed)  # the bound + JIT warm-up, far below run_ranks' 180 s
        assert calls <= 4, (kind, calls)  # raised at the first lossy call or the next one, not later
        if kind == "SignalTimeout":
            # rank 0's stream waits for rank 1's ready flag; rank 1 may instead time out first in the next
            # call's entry check, waiting for rank 0 to issue it
            assert "ag_gemm: timed out after 2 s waiting from peer rank" in msg, msg
        else:
            assert "aborted the group: a bounded wait timed out" in msg, msg


def _killed(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = SymmetricPool(64 << 20, group=dist.group.WORLD, timeout_s=5.0)
    op = GemmRs(group=dist.group.WORLD, pool=pool, max_m=512, k_local=64, n=32, dtype=torch.bfloat16,
                config=GemmRsConfig(method="decomposed", sm_margin=8, num_comm_sms=8))
    t0 = time.monotonic()
    try:
        for step in range(50):
            if rank == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            op(torch.randn(512, 64, device=dev, dtype=torch.bfloat16),
               torch.randn(64, 32, device=dev, dtype=torch.bfloat16))
            op.check_errors()
    except (PeerLostError, PeerAbortError, SignalTimeout) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    finally:
        pool.close()
    return "no error", "", time.monotonic() - t0


def test_gpu_a_killed_rank_is_named_within_60_s(num_gpus):
    kind, msg, elapsed = run_ranks(_killed, 2, backend="nccl", timeout_s=180, allow_exit=frozenset({1}))[0]
    assert kind == "PeerLostError" and "lost rank 1" in msg, (kind, msg)
    assert elapsed < 60
