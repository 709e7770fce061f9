"""The CUDA pool's watchdog, run on CPU against a stand-in pool: a board word held nonzero for longer than the
timeout is an expired wait. The watchdog must record the value the flag had (not the one it stores to release
the stream), abort the group once and release the flag; a wait that ends in time is left alone. An equality
wait (the board holds the awaited value, a call's M) whose flag holds another nonzero value in two readings
is a disagreement on M: reported at once, with both values, long before the timeout."""

import time

import numpy as np
import pytest

from tp_overlap.symm_mem.layout import (ABORT_WORD, BOARD_GEQ, ERROR_CODE_WORD, ERROR_OBSERVED_WORD, ERROR_VALUE_WORD,
                                        FIRST_FLAG_WORD, MISMATCH_REASON, decode_abort, encode_abort)
from tp_overlap.symm_mem.control import ControlPages
from tp_overlap.symm_mem.watchdog import TIMEOUT_REASON, Watchdog

NUM_FLAGS = 8


class _Control:
    """The words and index arithmetic of one rank's ControlPages, on a plain numpy page."""

    num_control_words = NUM_FLAGS
    flag_index = ControlPages.flag_index
    board_index = ControlPages.board_index
    record_error = ControlPages.record_error

    def __init__(self):
        self.own = np.zeros(ControlPages.board_index(self, NUM_FLAGS), dtype=np.int32)


class _Pool:
    rank, timeout_s = 0, 0.2

    def __init__(self):
        self._control = _Control()
        self.aborts = []
        self.mismatches = []

    def lost_peers(self):
        return []

    def abort(self, reason, lost=None):
        self.aborts.append(reason)
        self._control.own[ABORT_WORD] = reason

    def report_mismatch(self, code, mine, seen, peer):
        self.mismatches.append((code, mine, seen, peer))
        self.abort(4)


def _until(predicate, limit_s=5.0):
    end = time.monotonic() + limit_s
    while not predicate() and time.monotonic() < end:
        time.sleep(0.005)
    return predicate()


def test_an_expired_wait_is_recorded_with_the_value_it_saw_then_released():
    pool = _Pool()
    control = pool._control
    flag = 3
    control.own[control.flag_index(flag)] = 6           # the peer got as far as 6
    dog = Watchdog(pool)
    try:
        dog.expect(flag, 7, timeout_s=0.2)
        control.own[control.board_index(flag)] = BOARD_GEQ  # the stream sits in a wait for >= 7
        started = time.monotonic()
        assert _until(lambda: control.own[control.flag_index(flag)] == 7), "the wait was never released"
        assert time.monotonic() - started >= 0.2
        assert control.own[ERROR_CODE_WORD] == control.flag_index(flag)
        assert control.own[ERROR_VALUE_WORD] == 7
        assert control.own[ERROR_OBSERVED_WORD] == 6    # what the message reports, not the released 7
        assert pool.aborts == [TIMEOUT_REASON]
    finally:
        dog.stop()


def test_a_wait_that_ends_in_time_is_left_alone():
    pool = _Pool()
    control = pool._control
    dog = Watchdog(pool)
    try:
        for _ in range(5):                               # a recurring short wait: 0 between its steps
            dog.expect(1, 1, timeout_s=0.2)
            control.own[control.board_index(1)] = 16      # an equality wait for 16 (a call's M)...
            time.sleep(0.05)
            control.own[control.flag_index(1)] = 16       # ...met in time (the stream clears it)
            time.sleep(0.01)
            control.own[control.flag_index(1)] = 0
            control.own[control.board_index(1)] = 0
            time.sleep(0.01)
        time.sleep(0.3)
        assert control.own[ERROR_CODE_WORD] == 0 and pool.aborts == []
        assert control.own[control.flag_index(1)] == 0
    finally:
        dog.stop()


@pytest.mark.parametrize("mine,theirs", [(8, 16), (16, 8)])   # a peer's M larger than this rank's, or smaller
def test_a_flag_at_another_m_is_reported_at_once_with_both_values_and_the_wait_released(mine, theirs):
    pool = _Pool()
    control = pool._control
    flag = 2
    dog = Watchdog(pool)
    try:
        dog.expect(flag, mine, timeout_s=30, peer=1)
        control.own[control.flag_index(flag)] = theirs   # the peer called with its M
        control.own[control.board_index(flag)] = mine    # this rank waits for its own M
        started = time.monotonic()
        assert _until(lambda: pool.mismatches, limit_s=2), "the disagreement was not reported"
        assert time.monotonic() - started < 1.0          # not the 30 s bound
        assert pool.mismatches == [(control.flag_index(flag), mine, theirs, 1)]
        assert _until(lambda: control.own[control.flag_index(flag)] == mine), "the wait was not released"
        assert control.own[ERROR_CODE_WORD] == 0         # a disagreement, not an expired wait
    finally:
        dog.stop()


def test_one_reading_of_another_value_is_not_a_disagreement():
    """The board is read before the flags: a wait that ends between the two readings, followed at once by the
    writer's next call (another M), shows another value for one reading only. Two readings in a row make a
    disagreement. (The readings are driven by hand: the thread is stopped, so no timing is involved.)"""
    pool = _Pool()
    control = pool._control
    dog = Watchdog(pool)
    dog.stop()
    dog.expect(5, 8, timeout_s=30, peer=1)
    own = control.own
    suspects = {}

    def reading(board_value, flag_value):
        own[control.board_index(5)] = board_value
        own[control.flag_index(5)] = flag_value
        board = own[control.board_index(0):control.board_index(0) + NUM_FLAGS].copy()
        return dog._disagreement(np.flatnonzero(board), board, suspects)

    assert not reading(8, 24)   # one reading of the next call's M while the board still says 8
    assert not reading(0, 0)    # the wait had ended: nothing carries over
    assert not reading(8, 24)
    assert not reading(8, 8)    # the awaited value arrived
    assert pool.mismatches == []
    assert not reading(8, 24) and reading(8, 24)   # the same other value twice in a row: a disagreement
    assert pool.mismatches == [(control.flag_index(5), 8, 24, 1)]


class _HookedPage:
    """A control page that runs `hook` once, after the first store into it."""

    def __init__(self, words, hook=None):
        self.words, self.hook = words, hook

    def __getitem__(self, index):
        return self.words[index]

    def __setitem__(self, index, value):
        self.words[index] = value
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


def _pages_of(rank, pages):
    control = object.__new__(ControlPages)   # the words only: no shared segments, no device
    control.words, control.rank = pages, rank
    return control


def test_two_ranks_reporting_a_disagreement_at_once_each_raise_one_whole_record():
    """Rank 0 (M 12, saw 16) and rank 1 (M 16, saw 12) report at once: rank 1's whole report runs between rank
    0's first store into rank 1's page and the rest of rank 0's report. Every rank must then read one rank's
    record whole (its M and the M it saw), never one rank's M beside the other's. (With every record written into
    every page, as before, page 1 ended as rank 1's M beside rank 0's seen value: [16, 16, rank 0, code].)"""
    words = [np.zeros(FIRST_FLAG_WORD + 2 * NUM_FLAGS, dtype=np.int32) for _ in range(2)]
    reports = {0: (12, 16, 1 | 2 << 8, 40), 1: (16, 12, 2 | 1 << 8, 40)}
    rank1 = _pages_of(1, [_HookedPage(w) for w in words])
    pages0 = [_HookedPage(words[0]), _HookedPage(words[1], hook=lambda: rank1.write_abort(
        encode_abort(1, MISMATCH_REASON), [True, True], reports[1]))]
    _pages_of(0, pages0).write_abort(encode_abort(0, MISMATCH_REASON), [True, True], reports[0])
    for rank in (0, 1):
        reporter, reason, _ = decode_abort(int(words[rank][ABORT_WORD]))
        assert reason == MISMATCH_REASON
        assert _pages_of(rank, words).mismatch(reporter) == reports[reporter], rank


def test_a_timeout_message_says_when_the_flag_was_set_after_the_wait_gave_up():
    from tp_overlap.symm_mem.errors import SignalTimeout

    late = SignalTimeout(region="ag.a (device)", index=3, expected=1, observed=1, timeout_s=10, peer=1)
    lost = SignalTimeout(region="ag.a (device)", index=3, expected=1, observed=0, timeout_s=10, peer=1)
    assert "last value 1, set after the wait gave up: the writer was late)" in str(late)
    assert "(last value 0)" in str(lost) and "late" not in str(lost)
