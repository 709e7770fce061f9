"""The CUDA pool's watchdog, run on CPU against a stand-in pool: a board word held at 1 for longer than the
timeout is an expired wait. The watchdog must record the value the flag had (not the one it stores to release
the stream), abort the group once and release the flag; a wait that ends in time is left alone."""

import time

import numpy as np

from symm_mem._layout import ABORT_WORD, ERROR_CODE_WORD, ERROR_OBSERVED_WORD, ERROR_VALUE_WORD
from symm_mem.control import ControlPages
from symm_mem.watchdog import TIMEOUT_REASON, Watchdog

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

    def lost_peers(self):
        return []

    def abort(self, reason, lost=None):
        self.aborts.append(reason)
        self._control.own[ABORT_WORD] = reason


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
        control.own[control.board_index(flag)] = 1      # the stream sits in a wait for >= 7
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
            control.own[control.board_index(1)] = 1
            time.sleep(0.05)
            control.own[control.board_index(1)] = 0
            time.sleep(0.01)
        time.sleep(0.3)
        assert control.own[ERROR_CODE_WORD] == 0 and pool.aborts == []
        assert control.own[control.flag_index(1)] == 0
    finally:
        dog.stop()
