"""Which failure an op call raises when several meet (overlap/ops/failure.py): the first, except that an
interrupt is never hidden behind the abort it or a peer's interrupt caused."""

import pytest

from tp_overlap.ops.failure import CallState
from tp_overlap.symm_mem.errors import PeerAbortError
from tp_overlap.symm_mem.layout import CALL_FAILED_REASON, INTERRUPTED_REASON


class _Pool:
    def __init__(self):
        self.aborts = []

    def abort(self, reason):
        self.aborts.append(reason)


class _Program:
    op = "test.op"

    def events(self):
        return ["ready"]


def _state():
    return CallState(_Pool(), _Program())


def test_an_interrupt_after_a_peers_abort_is_what_the_call_raises():
    state = _state()
    abort = PeerAbortError(0, CALL_FAILED_REASON)
    assert state.fail(abort, local=False) is False   # a lane met the peer's abort first
    assert state.fail(KeyboardInterrupt(), local=False) is False   # then this rank's own Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        state.raise_error()
    assert state.pool.aborts == [CALL_FAILED_REASON]   # aborted once, by the first failure
    assert all(event.is_set() for event in state.events.values())


def test_otherwise_the_first_failure_is_raised():
    state = _state()
    first, later = RuntimeError("first"), PeerAbortError(1, CALL_FAILED_REASON)
    state.fail(first, local=False)
    state.fail(later, local=False)
    state.fail(RuntimeError("third"), local=False)
    with pytest.raises(RuntimeError, match="first"):
        state.raise_error()
    interrupted = _state()
    interrupted.fail(KeyboardInterrupt("one"), local=False)
    interrupted.fail(KeyboardInterrupt("two"), local=False)
    with pytest.raises(KeyboardInterrupt, match="one"):
        interrupted.raise_error()


def test_an_interrupt_after_a_local_failure_aborts_the_call():
    state = _state()
    assert state.fail(ValueError("local step"), local=True) is True   # the protocol would have gone on
    assert state.fail(KeyboardInterrupt(), local=False) is False
    with pytest.raises(KeyboardInterrupt):
        state.raise_error()
    assert state.pool.aborts == [INTERRUPTED_REASON]   # the peers are told it was Ctrl-C
