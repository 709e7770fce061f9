"""Failures become clear errors on every rank, fast, with nothing left behind (host backend, real
processes). Each test has a hard timeout through run_ranks."""

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tp_overlap.ipc.handles import host_empty, host_free
from tp_overlap.ipc.pool import IpcPool, live_ipc_pool_count
from tp_overlap.ops.validate import OpInputError
from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import AgGemmConfig, GemmRsConfig
from tp_overlap.ops.gemm_rs import GemmRs
from tp_overlap.symm_mem.errors import PeerAbortError, PeerLostError, SignalTimeout
from tp_overlap.symm_mem.pool import SymmetricPool, live_pool_count
from tp_overlap.symm_mem.host import SHM_DIR, SHM_PREFIX
from tests.multiproc import run_ranks

AG = AgGemmConfig(method="decomposed", comm_stream_priority=0)
RS = GemmRsConfig(method="decomposed", comm_stream_priority=0)


def _shm(pids=None):
    """Our /dev/shm segments (of the given processes only: other test runs may share the machine)."""
    names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX))
    if pids is None:
        return names
    return [n for n in names if int(n[len(SHM_PREFIX):].split("-")[0]) in pids]


def _skip_signal(rank, world, bad_rank, timeout_s):
    group = dist.group.WORLD
    pool = SymmetricPool(1 << 20, group=group, timeout_s=timeout_s)
    op = AgGemm(group=group, pool=pool, max_m=8 * world, k=8, n_local=4, dtype=torch.float32, config=AG)
    if rank == bad_rank:
        # From call 3 on this rank's "ready" writes are lost (its data is written, the flag never arrives):
        # a signalling path that stops working
        from tp_overlap.ops import program
        deliver = program.HostDriver._execute

        def lossy(driver, step, *args):
            if step.kind == "give" and step.args[0].index < world and op.calls >= 3:
                return None
            return deliver(driver, step, *args)
        program.HostDriver._execute = lossy
    t0 = time.monotonic()
    try:
        for _ in range(8):
            op(torch.randn(8, 8), torch.randn(8, 4))
    except (SignalTimeout, PeerAbortError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0, op.calls, pool.peer_pids
    finally:
        pool.close()
    return "no error", "", time.monotonic() - t0, op.calls, pool.peer_pids


@pytest.mark.parametrize("world", [2, 4])
def test_a_skipped_signal_makes_every_rank_raise_within_the_timeout(world):
    results = run_ranks(_skip_signal, world, world - 1, 2.0, timeout_s=60)
    kinds = {r[0] for r in results}
    assert "no error" not in kinds, results
    assert "SignalTimeout" in kinds, results
    for kind, msg, elapsed, epoch, _ in results:
        # within the 2 s bound plus the abort broadcast and a loaded machine's slack: far below the pool's
        # 30 s default and run_ranks' 60 s
        assert elapsed < 2.0 + 10.0, (kind, elapsed)
        assert epoch <= 4
        if kind == "SignalTimeout":
            assert "ag_gemm: timed out after 2 s waiting from peer rank" in msg
        else:
            assert "aborted the group: a bounded wait timed out" in msg
    assert _shm(set(results[0][-1])) == []


def _killed_mid_loop(rank, world, victim):
    group = dist.group.WORLD
    pool = SymmetricPool(1 << 20, group=group, timeout_s=50)
    op = GemmRs(group=group, pool=pool, max_m=4 * world, k_local=8, n=4, dtype=torch.float32, config=RS)
    t0 = time.monotonic()
    try:
        for step in range(50):
            if rank == victim and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            op(torch.randn(4 * world, 8), torch.randn(8, 4))
    except (PeerLostError, PeerAbortError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0, pool.peer_pids
    finally:
        pool.close()
    return "no error", "", time.monotonic() - t0, pool.peer_pids


@pytest.mark.parametrize("world,victim", [(2, 1), (4, 2)])
def test_a_killed_rank_is_named_by_every_survivor_quickly(world, victim):
    results = run_ranks(_killed_mid_loop, world, victim, timeout_s=90, allow_exit=frozenset({victim}))
    survivors = [r for i, r in enumerate(results) if i != victim]
    for kind, msg, elapsed, _ in survivors:
        assert kind in ("PeerLostError", "PeerAbortError"), (kind, msg)
        assert elapsed < 60
    assert any(f"lost rank {victim}" in msg for _, msg, _, _ in survivors), survivors
    assert _shm(set(survivors[0][-1])) == []  # the victim's pid included


def _cycles(rank, world, n):
    group = dist.group.WORLD

    def counts():
        ours = sum(1 for line in open("/proc/self/maps") if SHM_PREFIX in line or "tpov-ipc" in line)
        return (len(os.listdir("/proc/self/fd")), ours, len(_shm({os.getpid()})),
                live_pool_count(), live_ipc_pool_count())

    x = host_empty((256,), torch.float32)
    before = counts()
    for i in range(n):
        with SymmetricPool(1 << 16, group=group) as pool:
            ag = AgGemm(group=group, pool=pool, max_m=4, k=4, n_local=2, dtype=torch.float32, config=AG)
            rs = GemmRs(group=group, pool=pool, max_m=4, k_local=4, n=2, dtype=torch.float32, config=RS)
            if i % 100 == 0:  # use them now and then: opening views must not leak either
                ag(torch.randn(2, 4), torch.randn(4, 2))
                rs(torch.randn(4, 4), torch.randn(4, 2))
            ag.close()
            rs.close()
        with IpcPool(group=group) as ipc:
            ipc.exchange({"x": x})
            ipc.peer("x", 1 - rank)[0].item()
    dist.barrier()
    after = counts()
    host_free(x)
    return before, after


def test_1000_create_close_cycles_leave_fds_mappings_shm_and_counters_unchanged():
    for before, after in run_ranks(_cycles, 2, 1000, timeout_s=300):
        assert after == before, (before, after)


def _two_ops_two_pools(rank, world):
    group = dist.group.WORLD
    with SymmetricPool(1 << 20, group=group) as p1, SymmetricPool(1 << 20, group=group) as p2:
        ag1 = AgGemm(group=group, pool=p1, max_m=16, k=8, n_local=4, dtype=torch.float32, config=AG)
        ag2 = AgGemm(group=group, pool=p2, max_m=16, k=8, n_local=4, dtype=torch.float32, config=AG)
        rs = GemmRs(group=group, pool=p1, max_m=16, k_local=8, n=4, dtype=torch.float32, config=RS)
        for step in range(10):
            gen = torch.Generator().manual_seed(step * 10 + rank)
            a, w = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            full = [None] * world
            dist.all_gather_object(full, a, group=group)
            want = torch.cat(full) @ w
            assert torch.allclose(ag1(a, w), want, atol=1e-5)
            assert torch.allclose(ag2(a, w), want, atol=1e-5)
            ws = [None] * world
            a_rs = torch.randn(16, 8, generator=gen)
            dist.all_gather_object(ws, (a_rs, w), group=group)
            total = sum(x @ y for x, y in ws)
            assert torch.allclose(rs(a_rs, w), total[rank * 8:(rank + 1) * 8], atol=1e-4)
        # a second thread calling an op while it is in flight is refused with a clear error
        slow = threading.Event()
        release = threading.Event()
        from tp_overlap.ops.program import HostDriver
        original = HostDriver.run

        def held(driver, ctx, compute=None):  # the worker's call is inside the op while this waits
            slow.set()
            release.wait(60)
            return original(driver, ctx, compute)

        HostDriver.run = held
        worker = threading.Thread(target=lambda: ag1(torch.randn(8, 8), torch.randn(8, 4)))
        worker.start()
        assert slow.wait(60), "the worker thread's call did not start"
        with pytest.raises(OpInputError, match="already running on another thread"):
            ag1(torch.randn(8, 8), torch.randn(8, 4))
        release.set()
        worker.join(60)
        HostDriver.run = original
        assert not worker.is_alive(), "the worker thread's call did not finish"  # before the pools close
        p1.barrier()
    return True


def test_two_ops_and_two_pools_in_one_process_and_concurrent_calls_refused():
    assert run_ranks(_two_ops_two_pools, 2) == [True, True]
