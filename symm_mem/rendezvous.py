"""Bounded exchanges and barriers of a pool's group, through the process group's key-value store.

A collective of the process group (gloo, NCCL) blocks until the process group's own timeout (30 minutes for
gloo) when a peer never arrives. A pool's creation and `barrier()` must honour the pool's `timeout_s` and say
which ranks are missing, so they go through the store: each rank sets its own key and waits, bounded, for
the others'; on expiry the keys that are absent name the missing ranks, and an abort key tells the ranks
that did arrive to stop at once.

Keys are namespaced by the group's global ranks and a per-process sequence number of pools on that group
(every rank creates its pools on a group in the same order, as it must for collectives anyway).
"""

from __future__ import annotations

import itertools
import pickle
import threading
import time

import torch.distributed as dist

from .errors import PoolError, PoolTimeoutError

__all__ = ["Rendezvous"]

_POLL_S = 0.05
_sequence: dict[tuple[int, ...], itertools.count] = {}
_sequence_lock = threading.Lock()


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError) as exc:
        raise PoolError(f"the process group has no key-value store ({exc}); init_process_group first") from None


class Rendezvous:
    """Exchanges and barriers of one pool over `group`, each bounded by `timeout_s`."""

    def __init__(self, group: dist.ProcessGroup, *, timeout_s: float, name: str = "pool"):
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        ranks = tuple(dist.get_process_group_ranks(group))
        with _sequence_lock:
            seq = next(_sequence.setdefault(ranks, itertools.count()))
        self.prefix = f"tpov/{'.'.join(map(str, ranks))}/{name}{seq}"
        self.timeout_s = float(timeout_s)
        self.store = _store()
        self._step = 0
        self._previous_key: str | None = None

    def exchange(self, payload, *, what: str) -> list:
        """Every rank's `payload` (picklable), in rank order; raises PoolTimeoutError naming the ranks that
        did not arrive within timeout_s (and makes the ranks that did arrive raise too)."""
        step = self._step
        self._step += 1
        key = f"{self.prefix}/{step}"
        self.store.set(f"{key}/{self.rank}", pickle.dumps(payload))
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        self._wait(keys, what)
        values = [pickle.loads(self.store.get(k)) for k in keys]
        if self._previous_key is not None:  # every rank has read the previous step by now
            self._delete(f"{self._previous_key}/{self.rank}")
        self._previous_key = key
        return values

    def barrier(self, *, what: str) -> None:
        self.exchange(None, what=what)

    def abort(self, reason: str, missing: list[int] | None = None) -> None:
        """Tell the ranks still waiting in an exchange of this pool to stop (best effort)."""
        try:
            if not self.store.check([f"{self.prefix}/abort"]):  # the first reason is the one every rank reports
                self.store.set(f"{self.prefix}/abort", pickle.dumps((self.rank, reason, missing)))
        except Exception:  # noqa: BLE001 - the store may already be gone; the peers' own bound still holds
            pass

    def _wait(self, keys: list[str], what: str) -> None:
        # store.check polls without blocking: a blocking store.wait with a short timeout logs a warning per
        # expiry, and one with the whole timeout could not notice an abort
        deadline = time.monotonic() + self.timeout_s
        abort_key = f"{self.prefix}/abort"
        pause = 1e-4
        while not self.store.check(keys):
            if self.store.check([abort_key]):
                rank, reason, missing = pickle.loads(self.store.get(abort_key))
                if missing is not None:  # a peer's bound expired first: the same error, from it
                    raise PoolTimeoutError(f"{what} (seen by rank {rank})", missing, self.timeout_s)
                raise PoolError(f"{what}: aborted by rank {rank}: {reason}")
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                self.abort(f"{what} timed out", missing)
                raise PoolTimeoutError(what, missing, self.timeout_s)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S)

    def _delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except (RuntimeError, AttributeError):  # a store without deletion keeps the key: harmless
            pass
