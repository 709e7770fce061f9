"""The bound on a CUDA pool's stream waits: a host thread that releases a wait that never ends.

A stream memory-operation wait has no timeout of its own. Every wait the pool enqueues writes its board word
(nonzero while the stream sits in the wait: the value an equality wait awaits, or BOARD_GEQ; 0 after), and
this thread reads the board every PERIOD_S. A wait seen continuously for `timeout_s` is released: the thread
stores the awaited value into the flag (host memory, a plain store), records the flag in the error words and
aborts the group, so that the stream moves on and the next call (or `check_errors`) raises on every rank.
An equality wait whose flag holds another nonzero value is a disagreement (the flags that carry a call's M:
a peer called with another M): it is reported to every rank at once (PeerMismatchError), without waiting
for the timeout. The same happens, without waiting for the timeout,
when another rank aborted the group, when a kernel of this rank recorded an expired wait, or when a peer's
process is gone. After a failure every later wait is released as soon as it is seen: nothing hangs.

A board word that is nonzero in every reading for `timeout_s` means one wait of at least that long: a healthy wait
that merely recurs every step is 0 between its steps, and the thread reads the board hundreds of times per
second.
"""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np

from .layout import ABORT_WORD, CHECK_REASON, ERROR_CODE_WORD, ERROR_OBSERVED_WORD, ERROR_VALUE_WORD, MISMATCH_BIT

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
        self._peers: dict[int, int | None] = {}   # control flag -> the rank that writes it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tpov-watchdog-r{pool.rank}", daemon=True)
        self._thread.start()

    def expect(self, flag: int, value: int, timeout_s: float, peer: int | None = None) -> None:
        """A wait for control flag `flag` is being enqueued (called before the enqueue): `value` is what an
        at-least wait needs to be released; an equality wait's value is on the board."""
        if value > self._expected.get(flag, -1 << 31):
            self._expected[flag] = value
        self._timeouts[flag] = timeout_s
        self._peers[flag] = peer

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        control = self._control
        own = control.own
        n = control.num_control_words
        first_board = control.board_index(0)
        seen_since: dict[int, float] = {}
        suspects: dict[int, tuple[int, int]] = {}   # flag -> (awaited, seen) of one reading
        next_liveness = 0.0
        try:
            while not self._stop.wait(PERIOD_S):
                now = time.monotonic()
                # a snapshot: the streams write the board while it is read
                board = own[first_board:first_board + n].copy()
                waiting = np.flatnonzero(board)
                failed = own[ABORT_WORD] != 0 or own[ERROR_CODE_WORD] != 0
                if not failed and now >= next_liveness:
                    next_liveness = now + LIVENESS_PERIOD_S
                    lost = self._pool.lost_peers()
                    if lost:
                        self._pool.abort(LOST_REASON, lost=lost[0])
                        failed = True
                if failed:
                    if own[ABORT_WORD] == 0:  # a kernel of this rank recorded an expired wait or a disagreement
                        self._abort_for_kernel()
                    self._release(waiting, board)
                    continue
                for flag in list(seen_since):
                    if flag not in waiting:
                        del seen_since[flag]
                if self._disagreement(waiting, board, suspects) or self._expired(waiting, board, seen_since, now):
                    self._release(waiting, board)
        except ReferenceError:  # the pool was collected without close()
            return

    def _disagreement(self, waiting, board, suspects) -> bool:
        """An equality wait whose flag holds another nonzero value in two readings in a row (one reading may
        straddle the wait's end and the writer's next call): the ranks disagree on M."""
        own, control = self._control.own, self._control
        current = {}
        for flag in waiting.tolist():
            awaited = int(board[flag])
            seen = int(own[control.flag_index(flag)])
            if awaited > 0 and seen not in (0, awaited):
                current[flag] = (awaited, seen)
        found = next((f for f, v in current.items() if suspects.get(f) == v), None)
        suspects.clear()
        suspects.update(current)
        if found is None:
            return False
        awaited, seen = current[found]
        code = control.flag_index(found)
        self._pool.report_mismatch(code, awaited, seen, self._peers.get(found))
        return True

    def _expired(self, waiting, board, seen_since, now) -> bool:
        control, own = self._control, self._control.own
        for flag in waiting.tolist():
            since = seen_since.setdefault(flag, now)
            if now - since > self._timeouts.get(flag, self._pool.timeout_s):
                index = control.flag_index(flag)   # the value seen, before _release overwrites it
                control.record_error(index, self._awaited(flag, board), observed=int(own[index]))
                self._pool.abort(TIMEOUT_REASON)
                return True
        return False

    def _abort_for_kernel(self) -> None:
        own = self._control.own
        code = int(own[ERROR_CODE_WORD])
        if code & MISMATCH_BIT:
            self._pool.report_mismatch(code & ~MISMATCH_BIT, int(own[ERROR_VALUE_WORD]),
                                       int(own[ERROR_OBSERVED_WORD]), self._pool.source_of_code(code))
        elif self._pool._waits.is_failure_code(code):
            self._pool.abort(CHECK_REASON)
        else:
            self._pool.abort(TIMEOUT_REASON)

    def _awaited(self, flag: int, board) -> int:
        value = int(board[flag])
        return value if value > 0 else self._expected.get(flag, 1)

    def _release(self, waiting, board) -> None:
        own = self._control.own
        for flag in np.asarray(waiting).tolist():
            own[self._control.flag_index(flag)] = self._awaited(flag, board)
