"""Bounded exchanges and barriers of a pool's group, through the process group's key-value store.

A collective of the process group (gloo, NCCL) blocks until the process group's own timeout (30 minutes for
gloo) when a peer never arrives. A pool's creation and `barrier()` must honour the pool's `timeout_s` and say
which ranks are missing, so they go through the store: each rank sets its own key and waits, bounded, for
the others'; on expiry the keys that are absent name the missing ranks, and an abort key tells the ranks
that did arrive to stop at once.

Keys are namespaced by the group's global ranks and a per-process sequence number of pools on that group
(every rank creates its pools on a group in the same order, as it must for collectives anyway).

Every exchange is tagged with its kind (`creation`, `agree`, `barrier`, `close`): steps are matched by
number, so a rank that closes its pool while a peer checks an op's arguments would otherwise hand its close
to the peer's check. A step whose kinds differ raises `PoolStepMismatch` on every rank of it at once, naming
what each rank was doing, and the rendezvous refuses every later step (the ranks are out of step for good).
Once the peers' pids are known (`peer_pids`), a wait also notices a peer whose process is gone and raises
`PeerLostError` naming it, on every rank still waiting.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import time

import torch.distributed as dist

from .errors import PeerLostError, PoolError, PoolStepMismatch, PoolTimeoutError
from .liveness import process_alive

__all__ = ["Rendezvous"]

_POLL_S = 0.05
LIVENESS_PERIOD_S = 0.05
KINDS = ("creation", "agree", "barrier", "close")
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
        self.peer_pids: tuple[int, ...] | None = None   # set by the pool once exchanged: liveness checks
        self.out_of_step: str | None = None

    @property
    def steps(self) -> int:
        """Collective steps (exchanges and barriers) this rank has entered so far."""
        return self._step

    def exchange(self, payload, *, what: str, kind: str = "creation", note: str | None = None) -> list:
        """Every rank's `payload` (picklable), in rank order; raises PoolTimeoutError naming the ranks that
        did not arrive within timeout_s (and makes the ranks that did arrive raise too), PeerLostError if a
        missing rank's process is gone, PoolStepMismatch if the ranks' steps are of different kinds (`note`
        says why this rank is at its step, for the peers' message)."""
        if kind not in KINDS:
            raise PoolError(f"exchange kind {kind!r} is not one of {KINDS}")
        if self.out_of_step is not None:
            raise PoolStepMismatch(f"{what}: {self.out_of_step}")
        step = self._step
        self._step += 1
        key = f"{self.prefix}/{step}"
        self.store.set(f"{key}/{self.rank}", pickle.dumps((kind, what, note, payload)))
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        self._wait(keys, what)
        entries = [pickle.loads(self.store.get(k)) for k in keys]
        if self._previous_key is not None:  # every rank has read the previous step by now
            self._delete(f"{self._previous_key}/{self.rank}")
        self._previous_key = key
        if len({entry[0] for entry in entries}) > 1:
            self.out_of_step = _out_of_step(step, entries)
            raise PoolStepMismatch(f"{what}: {self.out_of_step}")
        return [entry[3] for entry in entries]

    def barrier(self, *, what: str, kind: str = "creation", note: str | None = None) -> None:
        self.exchange(None, what=what, kind=kind, note=note)

    def abort(self, reason: str, missing: list[int] | None = None, lost: int | None = None) -> None:
        """Tell the ranks still waiting in an exchange of this pool to stop (best effort)."""
        try:
            if not self.store.check([f"{self.prefix}/abort"]):  # the first reason is the one every rank reports
                self.store.set(f"{self.prefix}/abort", pickle.dumps((self.rank, reason, missing, lost)))
        except Exception:  # noqa: BLE001 - the store may already be gone; the peers' own bound still holds
            pass

    def _wait(self, keys: list[str], what: str) -> None:
        # store.check polls without blocking: a blocking store.wait with a short timeout logs a warning per
        # expiry, and one with the whole timeout could not notice an abort
        deadline = time.monotonic() + self.timeout_s
        abort_key = f"{self.prefix}/abort"
        pause = 1e-4
        next_liveness = time.monotonic() + LIVENESS_PERIOD_S
        while not self.store.check(keys):
            if self.store.check([abort_key]):
                rank, reason, missing, lost = pickle.loads(self.store.get(abort_key))
                if lost is not None:
                    raise PeerLostError(lost, self._pid(lost), waiting_for=what, reported_by=rank)
                if missing is not None:  # a peer's bound expired first: the same error, from it
                    raise PoolTimeoutError(f"{what} (seen by rank {rank})", missing, self.timeout_s)
                raise PoolError(f"{what}: aborted by rank {rank}: {reason}")
            now = time.monotonic()
            if self.peer_pids is not None and now >= next_liveness:
                next_liveness = now + LIVENESS_PERIOD_S
                lost = next((r for r, k in enumerate(keys) if not process_alive(self.peer_pids[r])
                             and not self.store.check([k])), None)
                if lost is not None:
                    self.abort(f"{what}: rank {lost} was lost", lost=lost)
                    raise PeerLostError(lost, self._pid(lost), waiting_for=what)
            if now > deadline:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                self.abort(f"{what} timed out", missing)
                raise PoolTimeoutError(what, missing, self.timeout_s)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S)

    def _pid(self, rank: int) -> int | None:
        return self.peer_pids[rank] if self.peer_pids is not None and 0 <= rank < len(self.peer_pids) else None

    def _delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except (RuntimeError, AttributeError):  # a store without deletion keeps the key: harmless
            pass


def _out_of_step(step: int, entries: list) -> str:
    ranks = "; ".join(f"rank {r} at {what!r}" + (f" ({note})" if note else "")
                      for r, (_, what, note, _) in enumerate(entries))
    return (f"the ranks reached different collective steps of this pool (step {step}: {ranks}); every rank must "
            f"create its pools, build its ops on them, call barrier() and close them in the same order")
