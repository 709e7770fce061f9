"""What a pool knows of failures: the error words kernels record into, the group's abort, the codes that
name a flag or a device-side check, and raising what was recorded. A mixin of SymmetricPool (it reads the
pool's control pages and regions)."""

from __future__ import annotations

import torch

from . import _waits
from .errors import PeerAbortError
from .layout import (ABORT_WORD, DEVICE_CODE_BASE, ERROR_CODE_WORD, FIRST_FLAG_WORD, INTERRUPTED_REASON,
                     MISMATCH_REASON, decode_abort, encode_abort)
from .liveness import process_alive

__all__ = ["PoolFailures"]


class PoolFailures:
    """Failure recording and raising for SymmetricPool (see its docstring)."""

    def error_words(self) -> torch.Tensor:
        """This rank's control page as an int32 tensor on the pool's device: kernels store the code of an
        expired wait into word 0 and the value they waited for into word 1, and read the abort word 2."""
        self._check_open()
        return self._control.own_tensor()

    def device_error_code(self, name: str, index: int) -> int:
        """The error code a kernel records for device flag `index` of region `name`."""
        return DEVICE_CODE_BASE + self.region(name).first_device_word + index


    def raise_if_failed(self) -> None:
        """Raise the recorded failure of this rank or the group (no synchronisation: host memory only)."""
        self._check_open()
        own = self._own
        if own[ERROR_CODE_WORD] or own[ABORT_WORD]:  # the common case costs two loads
            self._waits.raise_if_failed()

    def check_errors(self) -> None:
        """Synchronise the device, then raise SignalTimeout / PeerLostError / PeerAbortError if any wait of
        this rank expired or any rank gave up."""
        self._check_open()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._waits.raise_if_failed()

    def abort(self, reason: int = 3, *, lost: int | None = None, mismatch=None) -> None:
        """Tell every live rank of the group to stop: their waits end and raise PeerAbortError (or, with
        `lost`, PeerLostError naming that rank; with `mismatch`, PeerMismatchError). Only the first abort is
        kept. Plain host stores."""
        if self._control is None or not self._control.words:
            return
        alive = [r == self.rank or process_alive(pid) for r, pid in enumerate(self.peer_pids)]
        self._control.write_abort(encode_abort(self.rank, reason, lost), alive, mismatch)

    def _interrupted_peer(self) -> int | None:
        """The peer whose Ctrl-C aborted the group, if that is the abort this pool recorded (host memory only)."""
        abort = self._control.error()[2] if self._control is not None else 0
        if not abort:
            return None
        rank, reason, _ = decode_abort(abort)
        return rank if reason == INTERRUPTED_REASON and rank != self.rank else None

    def _leave_block(self, exc: BaseException | None) -> None:
        """`with pool:` ends. On Ctrl-C the group is aborted first: a peer in a wait of this pool stops at once,
        one in a blocking call of another group when this process exits, and each reports the interrupt. An
        error that a peer's interrupt caused here (such as a collective whose peer is gone) is raised as the
        interrupt's PeerAbortError, from that error."""
        if isinstance(exc, KeyboardInterrupt):
            self.abort(INTERRUPTED_REASON)
            return self._close("interrupted", meet=False)
        peer = self._interrupted_peer() if exc is not None else None
        self._close(f"it left its pool block with {type(exc).__name__}: {exc}" if exc is not None else None)
        if peer is not None and not (isinstance(exc, PeerAbortError) and exc.reason == INTERRUPTED_REASON):
            raise PeerAbortError(peer, INTERRUPTED_REASON) from exc

    def report_mismatch(self, flag_code: int, mine: int, seen: int, peer: int | None) -> None:
        """This rank awaited `mine` on the flag of `flag_code` (a control word's error code, or a device
        word's) and found the peer's `seen`: the ranks disagree on a call's M. Recorded in this rank's page, and
        the abort naming this rank in every page, so that every rank raises PeerMismatchError naming both values."""
        who = (self.rank + 1) | ((peer + 1 if peer is not None else 0) << 8)
        self.abort(MISMATCH_REASON, mismatch=(mine, seen, who, flag_code))

    def source_of_code(self, code: int) -> int | None:
        """The peer that writes the device flag of a kernel's error code (None if not a device flag)."""
        return _waits.source_of_code(self, code)

    def failure_code(self, message: str) -> int:
        """An error code for a device-side check of an op (`record_failure_if`): when recorded, this rank
        raises DeviceCheckError(message) and the others PeerAbortError."""
        self._check_open()
        return self._waits.failure_code(message)

    def record_failure_if(self, condition: torch.Tensor, code: int) -> None:
        """On the current stream: record `code` (a `failure_code`) in this rank's error word if the bool [1]
        tensor `condition` is true and no failure is recorded yet; the watchdog then aborts the group."""
        head = self._control.own_tensor()[:1]
        head.copy_(torch.where(condition & (head == 0), code, head))

    def control_code(self, name: str, index: int) -> int:
        """The error code of control flag `index` of region `name` (what the watchdog and errors name)."""
        return FIRST_FLAG_WORD + self.region(name).first_control_word + index

    def lost_peers(self) -> list[int]:
        """Ranks of the group whose process has exited."""
        return [r for r, pid in enumerate(self.peer_pids) if r != self.rank and not process_alive(pid)]

    def record_timeout(self, name: str, index: int, expected: int, observed: int = -1) -> None:
        """Record an expired wait on control flag `index` of `name` (it expected `expected`, last saw
        `observed`) and abort the group (for `on_timeout`)."""
        region = self.region(name)
        self._control.record_error(FIRST_FLAG_WORD + region.first_control_word + index, expected, observed)
        self.abort(1)
