"""Exceptions raised by the pools (symmetric memory and IPC)."""

__all__ = ["PoolError", "PoolCapacityError", "PoolClosedError", "SignalTimeout", "PeerLostError",
           "PeerAbortError", "ABORT_REASONS"]


class PoolError(RuntimeError):
    """Misuse of a pool: wrong arguments, wrong backend for the device, double use."""


class PoolCapacityError(PoolError):
    """A region does not fit into what is left of the pool."""

    def __init__(self, region: str, bytes_asked: int, bytes_left: int, bytes_total: int):
        self.region, self.bytes_asked, self.bytes_left = region, bytes_asked, bytes_left
        super().__init__(
            f"region {region!r} needs {bytes_asked} bytes but the pool has {bytes_left} of "
            f"{bytes_total} bytes left; create the pool with a larger size_bytes"
        )


class PoolClosedError(PoolError):
    """The pool (or IPC pool) was used after close()."""


class SignalTimeout(TimeoutError):
    """A bounded wait for an epoch flag expired.

    Carries which region/flag was waited on, the epoch expected, the value seen and, where known, the
    peer rank expected to write it.
    """

    def __init__(self, *, region: str, index: int, epoch: int, observed: int, timeout_s: float,
                 peer: int | None = None, op: str | None = None):
        self.region, self.index, self.epoch, self.observed = region, index, epoch, observed
        self.timeout_s, self.peer, self.op = timeout_s, peer, op
        who = f" from peer rank {peer}" if peer is not None else ""
        what = f"{op}: " if op else ""
        super().__init__(
            f"{what}timed out after {timeout_s:.3g} s waiting{who} for flag {region}[{index}] >= {epoch} "
            f"(last value {observed})"
        )


ABORT_REASONS = {1: "a bounded wait timed out", 2: "a peer process was lost", 3: "the program aborted"}


class PeerLostError(RuntimeError):
    """A peer rank's process is gone (killed or crashed) while this rank depended on it."""

    def __init__(self, rank: int, pid: int, *, waiting_for: str = ""):
        self.rank, self.pid = rank, pid
        what = f" while waiting for {waiting_for}" if waiting_for else ""
        super().__init__(f"lost rank {rank} (pid {pid}): its process exited{what}")


class PeerAbortError(RuntimeError):
    """Another rank of the group gave up (timeout, lost peer) and told every rank to stop."""

    def __init__(self, rank: int, reason: int):
        self.rank, self.reason = rank, reason
        super().__init__(f"rank {rank} aborted the group: {ABORT_REASONS.get(reason, f'reason {reason}')}")
