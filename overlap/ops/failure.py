"""What an op call does when one of its steps raises (overlap/ops/program.py's drivers): complete the
protocol without the step when its writes are this rank's only (a `local` run step), else abort the pool so
that every rank raises within the wait bound. Either way no rank is left one call behind, where a later call
would take this call's flags and return stale rows."""

from __future__ import annotations

import threading

from tp_overlap.ipc.errors import OverlapError
from tp_overlap.symm_mem.layout import CALL_FAILED_REASON, INTERRUPTED_REASON

__all__ = ["CallState", "LaneStopped", "abandon", "completed", "is_local", "join_lanes"]


def is_local(step) -> bool:
    """A run step marked local (`Program.run(..., local=True)`): its writes are read by this rank only."""
    return step.kind == "run" and step.args[1]


class LaneStopped(OverlapError):
    """A lane ends because another lane's failure aborted the call (that failure is the one raised)."""


class CallState:
    """What the lanes of one host call share: the ordering events and the first failure. A local failure
    lets the lanes go on (the protocol completes); any other aborts the pool and stops every lane."""

    def __init__(self, pool, program):
        self.pool, self.op = pool, program.op
        self.events = {name: threading.Event() for name in program.events()}
        self.error: BaseException | None = None
        self.fatal = False
        self._lock = threading.Lock()

    def fail(self, exc: BaseException, *, local: bool) -> bool:
        """Record a failure; True if the lane that saw it goes on with its remaining steps."""
        with self._lock:
            if self.error is None or _outranks(exc, self.error):
                self.error = exc
            if local and not self.fatal:
                return True
            if not self.fatal:
                self.fatal = True
                abandon(self.pool, self.op, self.error)
        for event in self.events.values():  # lanes waiting for an ordering point stop
            event.set()
        return False

    def raise_error(self) -> None:
        if not self.fatal:
            completed(self.op, self.error)
        raise self.error


def _outranks(exc: BaseException, first: BaseException) -> bool:
    """Ctrl-C reaches every rank at once, but the rank that acts on it first aborts the pool, and a peer's lane
    can meet that abort before the peer's own interrupt lands: the caller is told of the interrupt, not of the
    abort it caused."""
    return isinstance(exc, KeyboardInterrupt) and not isinstance(first, KeyboardInterrupt)


def join_lanes(threads, state: CallState) -> None:
    """Wait for the side lanes; an interrupt meanwhile (Ctrl-C) aborts the call and they stop at their next
    step (every wait of theirs is bounded and ends at an abort)."""
    for thread in threads:
        while thread.is_alive():
            try:
                thread.join()
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller once the lanes stopped
                state.fail(exc, local=False)


def abandon(pool, op: str, exc: BaseException) -> None:
    """A step that is not local raised part-way through a call: the peers may wait for what it would have
    produced, and a later call would meet this call's flags. Abort the pool: every rank raises."""
    # a no-op when the failure is the pool's own (its abort came first); an interrupt is named as one, so that
    # the peers report Ctrl-C rather than an error of theirs
    pool.abort(INTERRUPTED_REASON if isinstance(exc, KeyboardInterrupt) else CALL_FAILED_REASON)
    if not isinstance(exc, OverlapError):
        exc.add_note(f"{op}: this step's output or flags are awaited by the peers, so the pool was aborted: every "
                     f"rank raises (PeerAbortError) and the pool cannot be used again; build a new one to go on")


def completed(op: str, exc: BaseException) -> None:
    """A local step raised and the call completed its communication without it (its outputs are not valid)."""
    exc.add_note(f"{op}: the call's communication was completed without this step (the peers' results are "
                 f"right); the op can be called again")
