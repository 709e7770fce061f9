"""Ctrl-C in a pool block (CPU ranks, gloo, the host pool, real processes). The interrupted rank aborts the
group as it leaves, naming the interrupt: a peer in a wait of the pool stops at once, and whatever the peer
raises in its block next (say a collective of another group whose peer is gone) leaves the block as that
interrupt's PeerAbortError, from the peer's own error. The launchers print it as Ctrl-C on that rank."""

import time

import torch.distributed as dist

from tp_overlap.symm_mem.errors import PeerAbortError
from tp_overlap.symm_mem.layout import INTERRUPTED_REASON
from tp_overlap.symm_mem.pool import SymmetricPool
from tests.multiproc import run_ranks

TIMEOUT_S = 30.0   # the pool's wait bound: the abort must reach the peer far sooner


def _interrupted_block(rank, world):
    out = {}
    try:
        with SymmetricPool(1 << 16, group=dist.group.WORLD, timeout_s=TIMEOUT_S) as pool:
            pool.barrier()
            if rank == 0:
                raise KeyboardInterrupt
            start = time.monotonic()
            try:
                pool.host_wait(lambda: False, waiting_for="a flag rank 0 never sets", peer=0,
                               on_timeout=lambda: TimeoutError("the wait ran to its bound"))
            except PeerAbortError as exc:
                out["wait"] = (exc.rank, exc.reason, time.monotonic() - start)
            raise RuntimeError("a collective of another group lost its peer")
    except KeyboardInterrupt:
        out["left"] = "KeyboardInterrupt"
    except PeerAbortError as exc:
        out["left"] = (exc.rank, exc.reason, repr(exc.__cause__), str(exc))
    out["closed"] = pool.closed
    dist.barrier()   # rank 0 stays alive until rank 1 is done: the abort, not a lost process, is what it meets
    return out


def test_ctrl_c_in_a_pool_block_stops_the_peers_as_an_interrupt():
    interrupted, peer = run_ranks(_interrupted_block, 2, timeout_s=120)
    assert interrupted == {"left": "KeyboardInterrupt", "closed": True}, interrupted
    rank, reason, waited_s = peer["wait"]
    assert (rank, reason) == (0, INTERRUPTED_REASON) and waited_s < TIMEOUT_S / 3, peer
    assert peer["left"][:3] == (0, INTERRUPTED_REASON, "RuntimeError('a collective of another group lost its peer')"), \
        peer
    assert peer["left"][3] == "rank 0 aborted the group: it was interrupted (Ctrl-C)", peer
    assert peer["closed"] is True, peer
