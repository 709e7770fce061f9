"""IpcPool on CPU: memfd-backed tensors opened by peers through /proc, real processes and gloo."""

import os

import pytest
import torch
import torch.distributed as dist

from tp_overlap.ipc.errors import IpcError
from tp_overlap.ipc.handles import host_allocation_count, host_empty, host_free
from tp_overlap.ipc.pool import IpcPool, live_ipc_pool_count
from tests.multiproc import run_ranks


def _exchange_and_read(rank, world):
    group = dist.group.WORLD
    x = host_empty((37, 11), torch.float32)   # odd sizes on purpose
    big = host_empty((4096,), torch.int32)
    y, z = big[:100], big[1000:1300].view(20, 15)   # two tensors of one allocation: one handle
    x.copy_(torch.randn(37, 11) + 100 * rank)
    y.copy_(torch.arange(100, dtype=torch.int32) * (rank + 1))
    z.fill_(-rank)
    expected = [None] * world
    dist.all_gather_object(expected, x.clone(), group=group)
    with IpcPool(group=group) as ipc:
        ipc.exchange({"x": x, "y": y, "z": z})
        dist.barrier(group=group)
        for r in range(world):
            assert torch.equal(ipc.peer("x", r), expected[r])
            assert torch.equal(ipc.peer("y", r), torch.arange(100, dtype=torch.int32) * (r + 1))
            assert torch.equal(ipc.peer("z", r), torch.full((20, 15), -r, dtype=torch.int32))
            # offset + shape + dtype view into the peer allocation
            sub = ipc.peer("y", r, offset_bytes=40, shape=(5,), dtype=torch.int32)
            assert sub.tolist() == [(10 + i) * (r + 1) for i in range(5)]
        dist.barrier(group=group)  # every rank has checked before anyone writes
        # Writes through a peer view land in the peer's memory.
        right = (rank + 1) % world
        ipc.peer("z", right)[0, 0] = 1000 + rank
        for _ in range(100):  # reuse adds no opens
            ipc.peer("x", right)
        dist.barrier(group=group)
        assert int(z[0, 0]) == 1000 + (rank - 1) % world
        stats = ipc.stats()
        dist.barrier(group=group)
    after = ipc.stats()
    host_free(x)
    host_free(big)
    return stats, after, host_allocation_count(), live_ipc_pool_count()


@pytest.mark.parametrize("world", [2, 4])
def test_peer_tensors_are_exact_and_opened_once(world):
    for stats, after, allocations, live in run_ranks(_exchange_and_read, world):
        # two allocation bases exported; each peer's two bases opened exactly once
        assert stats.exported == 2 and stats.exchanges == 1
        assert stats.opened == 2 * (world - 1) and stats.handles_open == 2 * (world - 1)
        assert after.closed == after.opened and after.handles_open == 0
        assert allocations == 0 and live == 0


def _self_open(rank, world):
    x = host_empty((8,), torch.float32)
    with IpcPool(group=dist.group.WORLD) as ipc:
        ipc.exchange({"x": x})
        own = ipc._records["x"][rank].handle
        with pytest.raises(IpcError, match="exported by this process"):
            ipc.open(rank, own)
        assert ipc.peer("x", rank).data_ptr() == x.data_ptr()  # local: no open
        assert ipc.stats().opened == 0
        with pytest.raises(IpcError, match="rank 5 is not in the group"):
            ipc.peer("x", 5)
        with pytest.raises(IpcError, match="exceed the allocation"):
            ipc.peer("x", rank, offset_bytes=1 << 20)
    host_free(x)
    return True


def test_opening_own_handle_is_a_clear_error():
    assert run_ranks(_self_open, 2) == [True, True]


def _one_rank_bad(rank, world):
    good = host_empty((8,), torch.float32)
    tensor = torch.zeros(8) if rank == 1 else good  # rank 1 passes private memory
    with IpcPool(group=dist.group.WORLD) as ipc:
        with pytest.raises(IpcError) as info:
            ipc.exchange({"x": tensor})
    host_free(good)
    return str(info.value)


def test_a_bad_tensor_on_one_rank_raises_the_same_error_on_every_rank():
    msgs = run_ranks(_one_rank_bad, 2, timeout_s=60)
    assert msgs[0] == msgs[1]
    assert "rank 1:" in msgs[0] and "not in shareable memory" in msgs[0] and "host_empty" in msgs[0]


def _cycles(rank, world, n):
    fds_before = len(os.listdir("/proc/self/fd"))
    x = host_empty((1024,), torch.float32)
    for _ in range(n):
        with IpcPool(group=dist.group.WORLD) as ipc:
            ipc.exchange({"x": x})
            ipc.peer("x", 1 - rank).sum()
    dist.barrier()  # the peer has opened our memfd for the last time before we free it
    host_free(x)
    return fds_before, len(os.listdir("/proc/self/fd")), live_ipc_pool_count()


def test_create_close_cycles_leave_no_fds_or_pools():
    for before, after, live in run_ranks(_cycles, 2, 200):
        assert after == before and live == 0
