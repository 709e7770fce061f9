"""A pool used wrongly or losing a rank fails at once with an error that names the cause (CPU ranks, gloo, the
host pool, real processes, so that a crash fails the test instead of the test process): a rank that dies in
`barrier()`, a flag value no int32 word can hold, views read after `close()`."""

import gc
import os
import signal
import time

import torch
import torch.distributed as dist

from tp_overlap.ops.ag_gemm import AgGemm
from tp_overlap.config.schema import AgGemmConfig
from tp_overlap.symm_mem.errors import PeerLostError, PoolError
from tp_overlap.symm_mem.pool import SymmetricPool, live_pool_count
from tp_overlap.symm_mem.host import SHM_DIR, SHM_PREFIX
from tests.multiproc import run_ranks

TIMEOUT_S = 15.0   # the pools' bound: the failures below must come far sooner


def _mapped_segments() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if SHM_PREFIX in line)


# ----- a rank that dies in barrier() is named by every survivor ------------------------------------------
def _dies_in_barrier(rank, world, victim):
    pool = SymmetricPool(1 << 16, group=dist.group.WORLD, timeout_s=TIMEOUT_S)
    pool.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        pool.barrier()
        message = "no error"
    except (PeerLostError, PoolError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - start
    pool.close()
    return message, elapsed, live_pool_count(), pool.peer_pids


def test_a_rank_that_dies_in_barrier_is_named_by_every_survivor_at_once():
    results = run_ranks(_dies_in_barrier, 3, 2, timeout_s=120, allow_exit=frozenset({2}))
    for message, elapsed, live, pids in results[:2]:
        assert message.startswith(f"PeerLostError: lost rank 2 (pid {pids[2]}): its process exited while waiting "
                                  f"for pool barrier"), message
        assert elapsed < 5, elapsed   # not the pool's 15 s bound
        assert live == 0
    names = [n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)]
    assert not [n for n in names if any(str(p) in n for p in results[0][3])], names


# ----- flag values outside int32 --------------------------------------------------------------------------
def _int32(rank, world):
    group = dist.group.WORLD
    out = []
    with SymmetricPool(1 << 16, group=group, timeout_s=TIMEOUT_S) as pool:
        pool.reserve("x", (4,), torch.int32, num_signals=world)
        for call in (lambda: pool.wait("x", 0, 2 ** 31), lambda: pool.wait("x", 0, -2 ** 31 - 1),
                     lambda: pool.wait("x", 0, True), lambda: pool.signal("x", 0, 2 ** 31, rank=0),
                     lambda: pool.wait("x", 0, 1, timeout_s=float("nan"))):
            start = time.monotonic()
            try:
                call()
                out.append(("no error", 0.0))
            except Exception as exc:  # noqa: BLE001 - the type is asserted
                out.append((f"{type(exc).__name__}: {exc}", time.monotonic() - start))
        # the pool still works: every rank signals its right neighbour the largest int32
        right, left = (rank + 1) % world, (rank - 1) % world
        pool.signal("x", rank, 2 ** 31 - 1, rank=right)
        pool.wait("x", left, 2 ** 31 - 1)
        pool.barrier()
    return out


def test_a_flag_value_outside_int32_is_refused_before_any_wait():
    results = run_ranks(_int32, 2, timeout_s=90)
    assert [m for m, _ in results[0]] == [m for m, _ in results[1]], results   # the same on every rank
    for out in results:
        messages = [m for m, _ in out]
        assert messages[0] == ("PoolError: pool.wait: value 2147483648 is not an int32 (a flag word holds "
                               "-2147483648 .. 2147483647)"), messages[0]
        assert "value -2147483649 is not an int32" in messages[1] and "value True is not an int32" in messages[2]
        assert messages[3].startswith("PoolError: pool.signal: value 2147483648 is not an int32"), messages[3]
        assert messages[4] == "PoolError: timeout_s must be a finite number > 0, got nan", messages[4]
        assert max(elapsed for _, elapsed in out) < 1, out   # at once, not after the 15 s bound


# ----- views read after close -----------------------------------------------------------------------------
def _views_after_close(rank, world):
    group = dist.group.WORLD
    before = _mapped_segments()
    pool = SymmetricPool(1 << 20, group=group, timeout_s=TIMEOUT_S)
    region = pool.reserve("user", (64,), torch.float32)
    region.fill_(rank + 0.5)
    peer = pool.peer("user", (rank + 1) % world)
    op = AgGemm(group=group, pool=pool, max_m=4 * world, k=8, n_local=4, dtype=torch.float32,
                config=AgGemmConfig(comm_stream_priority=0))
    a_shard = torch.full((4, 8), float(rank))
    _, gathered = op(a_shard, torch.ones(8, 4), return_gathered=True)
    flags = pool.signals(op.flags.region)   # a numpy view of this rank's control page
    pool.barrier()
    want = (gathered.clone(), peer.clone(), flags.copy())
    pool.close()
    mapped_after_close = _mapped_segments() - before
    # read after close: the memory stays mapped while a view exists (stale data, never a fault)
    read = (torch.equal(gathered, want[0]), torch.equal(peer, want[1]), bool((flags == want[2]).all()),
            float(region.sum()))
    gathered.add_(1)   # writes land in memory only this process still maps: harmless
    op.close()
    del region, peer, gathered, flags, want, op
    gc.collect()
    return read, mapped_after_close, _mapped_segments() - before, live_pool_count()


def test_views_read_after_close_read_stale_data_and_are_unmapped_once_dropped():
    for read, mapped_after_close, left, live in run_ranks(_views_after_close, 2, timeout_s=90):
        rank_value_sum = read[3]
        assert read[:3] == (True, True, True) and rank_value_sum in (32.0, 96.0), read
        assert mapped_after_close > 0   # kept for the views
        assert left == 0 and live == 0  # and nothing left once they are gone
