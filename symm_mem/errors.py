"""Exceptions raised by the symmetric pools (the bases come from `tp_overlap.ipc.errors`)."""

from tp_overlap.ipc.errors import OverlapError, PoolClosedError, PoolError

__all__ = ["ArgumentMismatch", "PoolError", "PoolCapacityError", "PoolClosedError", "PoolTimeoutError",
           "PoolStepMismatch", "SignalTimeout", "PeerLostError", "PeerAbortError", "PeerMismatchError",
           "DeviceCheckError", "ABORT_REASONS"]


class PoolCapacityError(PoolError):
    """A region does not fit into what is left of the pool; `knob` names the constructor argument to raise."""

    def __init__(self, region: str, asked: int, left: int, total: int, *, unit: str = "bytes",
                 knob: str = "size_bytes"):
        self.region, self.asked, self.left, self.total, self.knob = region, asked, left, total, knob
        super().__init__(f"region {region!r} needs {asked} {unit} but the pool has {left} of {total} {unit} "
                         f"left; create the pool with a larger {knob} (see overlap.ops.layers.pool_requirements)")


class PoolTimeoutError(PoolError, TimeoutError):
    """A collective step of a pool (creation, barrier) did not complete within timeout_s; names who is missing."""

    def __init__(self, what: str, missing: list[int], timeout_s: float):
        self.what, self.missing, self.timeout_s = what, list(missing), timeout_s
        super().__init__(f"{what}: ranks {self.missing} of the group did not arrive within {timeout_s:.3g} s")


class ArgumentMismatch(PoolError, ValueError):
    """The ranks of a group passed different arguments to a collective step (see `SymmetricPool.agree`)."""


class PoolStepMismatch(ArgumentMismatch):
    """The ranks reached collective steps of different kinds of one pool (one closes, another checks an op's
    arguments): raised at once on every rank of the step, naming what each rank was doing."""


class SignalTimeout(OverlapError, TimeoutError):
    """A bounded wait for a flag expired: names the region/flag, the value awaited, the value seen and,
    where known, the peer rank expected to write it and the op."""

    def __init__(self, *, region: str, index: int, expected: int, observed: int, timeout_s: float,
                 peer: int | None = None, op: str | None = None, detail: str = ""):
        self.region, self.index, self.expected, self.observed = region, index, expected, observed
        self.timeout_s, self.peer, self.op = timeout_s, peer, op
        who = f" from peer rank {peer}" if peer is not None else ""
        what = f"{op}: " if op else ""
        # a device wait's flag is read once the kernel has ended: a value that meets the wait came too late
        late = ", set after the wait gave up: the writer was late" if observed >= expected > 0 else ""
        super().__init__(f"{what}timed out after {timeout_s:.3g} s waiting{who} for flag {region}[{index}] "
                         f">= {expected} (last value {observed}{late}){': ' + detail if detail else ''}")


ABORT_REASONS = {1: "a bounded wait timed out", 2: "a peer process was lost", 3: "the program aborted",
                 4: "a call's arguments differed between ranks", 5: "a device-side check of an op failed",
                 6: "a step of an op call raised there part-way through the call (that rank raises its own "
                    "error); build a new pool to go on",
                 7: "it was interrupted (Ctrl-C)"}


class PeerLostError(OverlapError, RuntimeError):
    """A peer rank's process is gone (killed or crashed) while this rank depended on it."""

    def __init__(self, rank: int, pid: int | None, *, waiting_for: str = "", reported_by: int | None = None):
        self.rank, self.pid = rank, pid
        what = f" while waiting for {waiting_for}" if waiting_for else ""
        pid_text = f" (pid {pid})" if pid is not None else ""
        by = f" (reported by rank {reported_by})" if reported_by is not None else ""
        super().__init__(f"lost rank {rank}{pid_text}: its process exited{what}{by}")


class PeerAbortError(OverlapError, RuntimeError):
    """Another rank of the group gave up (timeout, bad arguments) and told every rank to stop."""

    def __init__(self, rank: int, reason: int, detail: str = ""):
        self.rank, self.reason = rank, reason
        text = ABORT_REASONS.get(reason, f"reason {reason}")
        super().__init__(f"rank {rank} aborted the group: {text}{': ' + detail if detail else ''}")


class PeerMismatchError(PeerAbortError):
    """The ranks of the group issued one call of an op with different M: seen in the flags that carry M
    (a rank found a peer's flag at another nonzero value than its own M) and raised on every rank."""

    def __init__(self, *, op: str | None, mine: int, seen: int, rank: int, peer: int | None):
        self.op, self.mine, self.seen, self.peer = op, mine, seen, peer
        what = f"{op}: " if op else ""
        peer_text = f"rank {peer}: {seen}" if peer is not None else f"a peer: {seen}"
        RuntimeError.__init__(self, f"{what}the ranks called this op with different M (rank {rank}: {mine}, "
                                    f"{peer_text}); every rank must pass the same number of rows "
                                    f"(M = rows per rank x W). The group is aborted")
        self.rank, self.reason = rank, 4


class DeviceCheckError(OverlapError, RuntimeError):
    """A check that an op runs on the device (registered with `SymmetricPool.failure_code`) failed on this
    rank; the message is the one registered with its code."""
