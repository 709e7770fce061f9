"""The bound on a CUDA pool's stream waits: a host thread that releases a wait that never ends.

A stream memory-operation wait has no timeout of its own. Every wait the pool enqueues writes its board word
(1 while the stream sits in the wait, 0 after), and this thread reads the board every PERIOD_S. A wait seen
continuously for `timeout_s` is released: the thread stores the awaited value into the flag (host memory, a
plain store), records the flag in the error words and aborts the group, so that the stream moves on and
the next call (or `check_errors`) raises on every rank. The same happens, without waiting for the timeout,
when another rank aborted the group, when a kernel of this rank recorded an expired wait, or when a peer's
process is gone. After a failure every later wait is released as soon as it is seen: nothing hangs.

A board word that is 1 in every reading for `timeout_s` means one wait of at least that long: a healthy wait
that merely recurs every step is 0 between its steps, and the thread reads the board hundreds of times per
second.
"""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np

from ._layout import ABORT_WORD, ERROR_CODE_WORD

__all__ = ["Watchdog"]

PERIOD_S = 0.002
LIVENESS_PERIOD_S = 0.05
TIMEOUT_REASON, LOST_REASON = 1, 2


class Watchdog:
    def __init__(self, pool):
        self._pool = weakref.proxy(pool)
        self._control = pool._control
        self._expected: dict[int, int] = {}   # control flag -> value its enqueued waits expect
        self._timeouts: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tpov-watchdog-r{pool.rank}", daemon=True)
        self._thread.start()

    def expect(self, flag: int, value: int, timeout_s: float) -> None:
        """A wait for control flag `flag` >= `value` is being enqueued (called before the enqueue)."""
        if value > self._expected.get(flag, -1 << 31):
            self._expected[flag] = value
        self._timeouts[flag] = timeout_s

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        control = self._control
        own = control.own
        n = control.num_control_words
        first_board = control.board_index(0)
        seen_since: dict[int, float] = {}
        next_liveness = 0.0
        try:
            while not self._stop.wait(PERIOD_S):
                now = time.monotonic()
                # a snapshot: the streams write the board while it is read
                waiting = np.flatnonzero(own[first_board:first_board + n].copy())
                failed = own[ABORT_WORD] != 0 or own[ERROR_CODE_WORD] != 0
                if not failed and now >= next_liveness:
                    next_liveness = now + LIVENESS_PERIOD_S
                    lost = self._pool.lost_peers()
                    if lost:
                        self._pool.abort(LOST_REASON, lost=lost[0])
                        failed = True
                if failed:
                    if own[ABORT_WORD] == 0:  # a kernel of this rank recorded an expired wait
                        self._pool.abort(TIMEOUT_REASON)
                    self._release(waiting)
                    continue
                for flag in list(seen_since):
                    if flag not in waiting:
                        del seen_since[flag]
                for flag in waiting.tolist():
                    since = seen_since.setdefault(flag, now)
                    if now - since > self._timeouts.get(flag, self._pool.timeout_s):
                        index = control.flag_index(flag)   # the value seen, before _release overwrites it
                        control.record_error(index, self._expected.get(flag, 1), observed=int(own[index]))
                        self._pool.abort(TIMEOUT_REASON)
                        self._release(waiting)
                        break
        except ReferenceError:  # the pool was collected without close()
            return

    def _release(self, waiting) -> None:
        own = self._control.own
        for flag in np.asarray(waiting).tolist():
            own[self._control.flag_index(flag)] = self._expected.get(flag, 1)
