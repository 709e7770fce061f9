"""Failures on real GPUs: a rank that stops signalling, a rank killed mid-loop (2 GPUs, NCCL group)."""

import os
import signal
import time

import torch
import torch.distributed as dist

from overlap.ag_gemm import AgGemm
from overlap.config import AgGemmConfig, GemmRsConfig
from overlap.gemm_rs import GemmRs
from symm_mem import PeerAbortError, PeerLostError, SignalTimeout, SymmetricPool
from tests.multiproc import run_ranks


def _stops_signalling(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = SymmetricPool(64 << 20, group=dist.group.WORLD, timeout_s=2.0)
    op = AgGemm(group=dist.group.WORLD, pool=pool, max_m=512, k=64, n_local=32, dtype=torch.bfloat16,
                config=OpConfig(op="ag_gemm", method="decomposed"))
    if rank == 1:  # from step 3 on this rank's flag writes are lost
        publish = op._publish
        op._publish = lambda a_shard, a: publish(a_shard, a) if op.epoch < 3 else None
    t0 = time.monotonic()
    try:
        for _ in range(8):
            op(torch.randn(256, 64, device=dev, dtype=torch.bfloat16),
               torch.randn(64, 32, device=dev, dtype=torch.bfloat16))
            op.check_errors()   # a step boundary: synchronises and raises on every rank
    except (SignalTimeout, PeerAbortError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    finally:
        pool.close()
    return "no error", "", time.monotonic() - t0


def test_gpu_a_rank_that_stops_signalling_makes_every_rank_raise(num_gpus):
    results = run_ranks(_stops_signalling, 2, backend="nccl", timeout_s=180)
    assert all(kind != "no error" for kind, _, _ in results), results
    assert any(kind == "SignalTimeout" for kind, _, _ in results), results
    assert all(elapsed < 2.0 + 20 for _, _, elapsed in results), results  # timeout + JIT warm-up


def _killed(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = SymmetricPool(64 << 20, group=dist.group.WORLD, timeout_s=5.0)
    op = GemmRs(group=dist.group.WORLD, pool=pool, max_m=512, k_local=64, n=32, dtype=torch.bfloat16,
                config=OpConfig(op="gemm_rs", method="decomposed", sm_margin=8, num_comm_sms=8))
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
