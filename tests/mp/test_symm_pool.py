"""SymmetricPool on the host backend: real processes, gloo, POSIX shared memory."""

import dataclasses
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tp_overlap.symm_mem.errors import PeerAbortError, PoolCapacityError, PoolClosedError, PoolError, SignalTimeout
from tp_overlap.symm_mem.pool import SymmetricPool
from tp_overlap.symm_mem.host import SHM_DIR, SHM_PREFIX
from tests.multiproc import run_ranks


def our_shm_entries(pids):
    """/dev/shm segments of host pools created by `pids` (other test runs may share the machine)."""
    return sorted(n for n in os.listdir(SHM_DIR)
                  if n.startswith(SHM_PREFIX) and int(n[len(SHM_PREFIX):].split("-")[0]) in pids)


def _peer_reads(rank, world, rows, cols):
    group = dist.group.WORLD
    with SymmetricPool(1 << 20, group=group) as pool:
        created = pool.stats()
        buf = pool.reserve("x", (rows, cols), torch.float32)
        buf.copy_(torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + 1000.0 * rank)
        pool.barrier()
        for peer in range(world):
            expect = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + 1000.0 * peer
            got = pool.peer("x", peer).clone()
            assert torch.equal(got, expect), f"rank {rank} read wrong data from {peer}"
        pool.barrier()
        return created, pool.stats(), pool.peer_pids


@pytest.mark.parametrize("world", [2, 4])
def test_rank_encoded_peer_reads_are_exact(world):
    results = run_ranks(_peer_reads, world, 33, 17)
    for created, final, _ in results:
        # the counters count: the two barriers are two collective steps; a region and its views allocate
        # nothing (the pool's control page and symmetric allocation were made at creation)
        assert created.rendezvous_count >= 1 and final.rendezvous_count == created.rendezvous_count + 2
        assert created.allocations == final.allocations == 2 and final.handles_open == world
    assert len(set(results[0][2])) == world and our_shm_entries(set(results[0][2])) == []


def _epoch_flags(rank, world, steps):
    group = dist.group.WORLD
    with SymmetricPool(1 << 16, group=group) as pool:
        data = pool.reserve("slot", (64,), torch.int64, num_signals=world)
        warm = pool.stats()
        right = (rank + 1) % world
        for step in range(1, steps + 1):
            # Scramble the workspace every step: a reader that does not wait for the flag sees garbage.
            data.copy_(torch.randint(-2**40, 2**40, (64,)))
            payload = torch.arange(64, dtype=torch.int64) * 7 + rank * 10_000 + step
            pool.barrier()  # every slot is scrambled before anyone writes
            # Each rank writes into its right neighbour's slot, then signals it with the step number.
            pool.peer("slot", right).copy_(payload)
            pool.signal("slot", rank, step, rank=right)
            left = (rank - 1) % world
            pool.wait("slot", left, step, timeout_s=10, peer=left)
            expect = torch.arange(64, dtype=torch.int64) * 7 + left * 10_000 + step
            assert torch.equal(data, expect), f"step {step}: stale or torn data from rank {left}"
            assert int(pool.signals("slot")[left]) == step
            pool.barrier()  # nobody scrambles a slot that is still being checked
        after = pool.stats()
        return warm, after


@pytest.mark.parametrize("world", [2, 4])
def test_epoch_flags_across_100_steps(world):
    for warm, after in run_ranks(_epoch_flags, world, 100):
        # flag writes and waits allocate nothing and meet no peer through the store; the 2 barriers per
        # step are the test's own
        assert after == dataclasses.replace(warm, rendezvous_count=warm.rendezvous_count + 2 * 100), (warm, after)


def _reuse_adds_nothing(rank, world):
    pool = SymmetricPool(1 << 20, group=dist.group.WORLD)
    pool.reserve("a", (128,), torch.bfloat16, num_signals=2)
    pool.ptr_table("a")
    for r in range(world):
        pool.peer("a", r)
    before = pool.stats()
    for step in range(1000):
        pool.reserve("a", (128,), torch.bfloat16, num_signals=2)
        pool.peer("a", step % world)
        pool.ptr_table("a")
    after = pool.stats()
    pool.close()
    return before, after


def test_1000_steps_of_reuse_add_no_rendezvous_and_no_allocation():
    for before, after in run_ranks(_reuse_adds_nothing, 2):
        assert before == after


def _two_tp_groups(rank, world):
    # Two TP groups of 2 inside a world of 4; each pool only sees its own group.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    with SymmetricPool(1 << 16, group=group) as pool:
        assert (pool.rank, pool.world_size) == (rank % 2, 2)
        buf = pool.reserve("x", (8,), torch.int32)
        buf.fill_(rank)
        pool.barrier()
        seen = [int(pool.peer("x", r)[0]) for r in range(2)]
        pool.barrier()
    return seen


def test_two_tp_groups_in_a_world_of_four():
    assert run_ranks(_two_tp_groups, 4) == [[0, 1], [0, 1], [2, 3], [2, 3]]


def _errors(rank, world):
    pool = SymmetricPool(8192, group=dist.group.WORLD, num_signal_words=32)
    pool.reserve("a", (1000,), torch.float32)
    pool.reserve("c2", (0,), torch.float32, num_signals=1)
    msgs = []
    for bad in [lambda: pool.reserve("b", (2000,), torch.float32),
                lambda: pool.reserve("a", (10,), torch.float32),
                lambda: pool.reserve("c", (1,), torch.float32, num_signals=100),
                lambda: pool.peer("nope", 0),
                lambda: pool.peer("a", world),
                lambda: pool.signal("a", 0, 1, rank=0)]:
        with pytest.raises(PoolError) as info:
            bad()
        msgs.append(str(info.value))
    pool.reserve("d", (4,), torch.float32, num_signals=1)
    # Only rank 0 times out: if both ranks waited with the same short bound, whichever expired first
    # would abort the group and the other would see PeerAbortError instead of its own timeout.
    expected = SignalTimeout if rank == 0 else PeerAbortError
    with pytest.raises(expected) as info:
        pool.wait("d", 0, 5, timeout_s=0.2 if rank == 0 else 30.0, peer=1 - rank)
    msgs.append(str(info.value))
    pool.close()
    pool.close()
    with pytest.raises(PoolClosedError):
        pool.reserve("a", (1000,), torch.float32)
    return msgs


def test_errors_name_region_bytes_and_flag():
    msgs, msgs_rank1 = run_ranks(_errors, 2)
    assert "rank 0 aborted the group" in msgs_rank1[6], msgs_rank1[6]
    cap = msgs[0]
    assert "'b'" in cap and "8000 bytes" in cap and "4096 of 8192 bytes left" in cap, cap
    assert "already reserved" in msgs[1]
    assert "signals" in msgs[2]
    assert "no region 'nope'" in msgs[3]
    assert "rank 2 is not in the group" in msgs[4]
    assert "flag index 0 out of range" in msgs[5]
    assert "flag d[0] >= 5" in msgs[6] and "peer rank" in msgs[6] and "last value 0" in msgs[6]


def test_capacity_error_is_a_pool_error():
    assert issubclass(PoolCapacityError, PoolError)


def _killed(rank, world):
    pool = SymmetricPool(1 << 16, group=dist.group.WORLD)
    pool.reserve("x", (16,), torch.float32)
    pool.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    pool.close()
    return "survived", pool.peer_pids


def test_killed_rank_leaves_no_shm_entries():
    values = run_ranks(_killed, 2, allow_exit=frozenset({1}))
    status, pids = values[0]
    assert status == "survived" and len(set(pids)) == 2
    assert our_shm_entries(set(pids)) == []  # the killed rank's segment too (unlinked after the creation barrier)


def test_wrong_backend_for_device_is_refused():
    def make():
        return SymmetricPool(1024, group=object(), backend="torch", device="cpu")
    with pytest.raises(PoolError, match="does not serve device cpu"):
        make()
    with pytest.raises(PoolError, match="backend='mpi' is not one of"):
        SymmetricPool(1024, group=object(), backend="mpi", device="cpu")
    with pytest.raises(PoolError, match="group= is required"):
        SymmetricPool(1024, group=None, device="cpu")
