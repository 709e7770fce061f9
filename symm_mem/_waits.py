"""A pool's waits and failures: control-flag writes and waits (memory operations on CUDA, bounded host loops
on CPU), the bounded host wait every blocking step uses, the agreement check, and turning the control
page's error and abort words into one exception."""

from __future__ import annotations

import time

from .layout import (BOARD_GEQ, DEVICE_CODE_BASE, ERROR_CODE_WORD, ERROR_OBSERVED_WORD, FAILURE_CODE_BASE,
                      FIRST_FLAG_WORD, MISMATCH_BIT, MISMATCH_REASON, decode_abort, layout_difference)
from .errors import (ArgumentMismatch, DeviceCheckError, PeerAbortError, PeerLostError, PeerMismatchError,
                     SignalTimeout)


LIVENESS_PERIOD_S = 0.05
SPIN_POLLS = 2000


class WaitState:
    def __init__(self, pool):
        self.pool = pool
        self.cuda = pool.device.type == "cuda"
        self._batches: dict[tuple, object] = {}
        self._info: dict[int, tuple] = {}   # control word -> (region, index, expected, timeout_s, peer, op)
        self._failures: dict[int, str] = {}  # failure code -> message

    def failure_code(self, message: str) -> int:
        code = FAILURE_CODE_BASE + len(self._failures) + 1
        self._failures[code] = message
        return code

    def is_failure_code(self, code: int) -> bool:
        return code in self._failures

    # ----- control flags ---------------------------------------------------------------------------------
    def signal(self, name: str, index: int, value: int, rank: int) -> None:
        address = self.pool.control_address(name, index, rank=rank)
        if not self.cuda:
            self.pool.signals(name, rank)[index] = value
            return
        self._batch(("signal", address, value), lambda m: [m.write(address, value)]).enqueue(_stream())

    def expect(self, name, index, value, timeout_s, peer, op) -> None:
        region = self.pool.region(name)
        word = region.first_control_word + index
        self._info[word] = (name, index, value, timeout_s, peer, op)
        if self.pool._watchdog is not None:
            self.pool._watchdog.expect(word, value, timeout_s, peer)

    def wait(self, name, index, value, timeout_s, peer, op) -> None:
        flag = self.pool.control_address(name, index)
        self.expect(name, index, value, timeout_s, peer, op)
        if self.cuda:
            board = self.pool.control_address(name, index, board=True)
            self._batch(("wait", flag, value), lambda m: [m.write(board, BOARD_GEQ), m.wait_geq(flag, value),
                                                          m.write(board, 0)]).enqueue(_stream())
            return
        words = self.pool.signals(name)
        self.host_wait(lambda: int(words[index]) >= value, timeout_s=timeout_s, peer=peer,
                       on_timeout=lambda: self._timeout(name, index, value, int(words[index]), timeout_s, peer, op),
                       waiting_for=f"flag {name}[{index}] >= {value}")

    def _batch(self, key, make):
        batch = self._batches.get(key)
        if batch is None:
            from . import memops
            batch = self._batches[key] = memops.MemOpBatch(make(memops))
        return batch

    # ----- bounded host waits ----------------------------------------------------------------------------
    def host_wait(self, ready, *, timeout_s: float, peer: int | None, on_timeout, waiting_for: str) -> None:
        """Poll `ready()` (spin first, then back off to 1 ms), bounded by `timeout_s`; between polls raise
        if the group failed or a peer's process is gone. On expiry record the failure, abort the group and
        raise `on_timeout()`."""
        for _ in range(SPIN_POLLS):
            if ready():
                return
        start = time.monotonic()
        next_check = 0.0
        pause = 1e-5
        while not ready():
            now = time.monotonic()
            if now >= next_check:
                next_check = now + LIVENESS_PERIOD_S
                self.raise_if_failed()
                lost = self.pool.lost_peers()
                if lost:
                    self.pool.abort(2, lost=lost[0])
                    raise PeerLostError(lost[0], self.pool.peer_pids[lost[0]], waiting_for=waiting_for)
            if now - start > timeout_s:
                raise on_timeout()
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _timeout(self, name, index, expected, observed, timeout_s, peer, op) -> SignalTimeout:
        region = self.pool.region(name)
        self.pool._control.record_error(FIRST_FLAG_WORD + region.first_control_word + index, expected,
                                        observed=observed)
        self.pool.abort(1)
        return SignalTimeout(region=name, index=index, expected=expected, observed=observed, timeout_s=timeout_s,
                             peer=peer, op=op)

    # ----- failures --------------------------------------------------------------------------------------
    def failed(self) -> bool:
        code, _, abort = self.pool._control.error()
        return bool(code or abort)

    def raise_if_failed(self) -> None:
        code, expected, abort = self.pool._control.error()
        if code and not code & MISMATCH_BIT:
            raise self._expired(code, expected)
        if abort:
            rank, reason, lost = decode_abort(abort)
            if reason == MISMATCH_REASON:
                raise self._mismatch(rank)
            if lost is not None:
                pid = self.pool.peer_pids[lost] if 0 <= lost < len(self.pool.peer_pids) else None
                raise PeerLostError(lost, pid, reported_by=rank)
            raise PeerAbortError(rank, reason)

    def _mismatch(self, reporter: int) -> PeerMismatchError:
        mine, seen, who, flag_code = self.pool._control.mismatch(reporter)
        rank, peer = (who & 0xFF) - 1, ((who >> 8) & 0xFF) - 1
        return PeerMismatchError(op=self.op_of(flag_code), mine=mine, seen=seen, rank=rank,
                                 peer=peer if peer >= 0 else None)

    def op_of(self, code: int) -> str | None:
        """The op that waits on the flag of error code `code` (a control word's, or a device word's)."""
        code &= ~MISMATCH_BIT
        if code >= DEVICE_CODE_BASE:
            word = code - DEVICE_CODE_BASE
            for region in self.pool._regions.values():
                if region.first_device_word <= word < region.first_device_word + region.num_device_flags:
                    return region.name.rsplit(".", 1)[0]
            return None
        info = self._info.get(code - FIRST_FLAG_WORD)
        if info is not None and info[5]:
            return info[5]
        for region in self.pool._regions.values():
            if region.first_control_word <= code - FIRST_FLAG_WORD < region.first_control_word + region.num_control:
                return region.name.rsplit(".", 1)[0]
        return None

    def _expired(self, code: int, expected: int) -> BaseException:
        pool = self.pool
        if code in self._failures:
            return DeviceCheckError(self._failures[code])
        if code >= DEVICE_CODE_BASE:
            word = code - DEVICE_CODE_BASE
            for region in pool._regions.values():
                if region.first_device_word <= word < region.first_device_word + region.num_device_flags:
                    index = word - region.first_device_word
                    return SignalTimeout(region=f"{region.name} (device)", index=index, expected=expected,
                                         observed=int(pool.device_flags(region.name)[index]),
                                         timeout_s=pool.timeout_s, peer=_source_of(region, index, pool))
            return SignalTimeout(region="?", index=word, expected=expected, observed=-1, timeout_s=pool.timeout_s)
        word = code - FIRST_FLAG_WORD
        name, index, value, timeout_s, peer, op = self._info.get(word, ("?", word, expected, pool.timeout_s,
                                                                         None, None))
        own = pool._control.own
        observed = int(own[ERROR_OBSERVED_WORD]) if own[ERROR_CODE_WORD] == code else -1
        if observed < 0 and 0 <= code < len(own):   # not recorded with the value seen: the flag as it is now
            observed = int(own[code])
        return SignalTimeout(region=name, index=index, expected=expected, observed=observed, timeout_s=timeout_s,
                             peer=peer, op=op)


def source_of_code(pool, code: int) -> int | None:
    """The rank that writes the device flag of error code `code` (None for a control word's code)."""
    word = (code & ~MISMATCH_BIT) - DEVICE_CODE_BASE
    for region in pool._regions.values():
        if word >= 0 and region.first_device_word <= word < region.first_device_word + region.num_device_flags:
            return _source_of(region, word - region.first_device_word, pool)
    return None


def _source_of(region, index: int, pool) -> int | None:
    """Device flags of a GEMM+RS region are [world_size sources, flags per source]: the source rank."""
    per = region.num_device_flags // max(pool.world_size, 1)
    return index // per if per else None


def _stream() -> int:
    import torch
    return torch.cuda.current_stream().cuda_stream


def agree(pool, what: str, fields: dict) -> None:
    """Every rank's `fields` and pool layout so far (the regions and where they landed) must be equal: ranks
    whose regions landed elsewhere would read and write each other's memory at the wrong offsets."""
    exchanged = pool._rendezvous.exchange((dict(fields), pool.layout()), what=f"{what}: argument check",
                                          kind="agree")
    values = [theirs for theirs, _ in exchanged]
    differing = sorted(k for k in fields if len({repr(v.get(k)) for v in values}) > 1)
    extra = sorted({k for v in values for k in v} - set(fields))
    if differing or extra:
        parts = [f"{k}: " + ", ".join(f"rank {r} {v.get(k)!r}" for r, v in enumerate(values))
                 for k in differing + extra]
        raise ArgumentMismatch(f"{what}: the ranks passed different arguments ({'; '.join(parts)}); every rank "
                               f"must build the same ops with the same arguments in the same order")
    difference = layout_difference([layout for _, layout in exchanged])
    if difference:
        raise ArgumentMismatch(f"{what}: the pool's regions differ between the ranks before this op reserves its "
                               f"own ({difference}); every rank must reserve the same regions, with the same "
                               f"shapes, in the same order")
