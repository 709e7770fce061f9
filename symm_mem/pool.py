"""SymmetricPool: one symmetric allocation per rank, exchanged once, carved into named regions.

Layout of every rank's allocation (identical offsets on all ranks):

    [ data arena: regions, 256-byte aligned ][ signal area: int32 words ]
                                               word 0: device error word, then per-region epoch flags

Flags hold epochs (the step number, >= 1) and are never reset: a waiter asks for `flag >= epoch`, so a
flag left over from step s-1 can never satisfy step s (no ABA). The signal area is zeroed once at
creation, before the creation barrier.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist

from .errors import (PeerAbortError, PeerLostError, PoolCapacityError, PoolClosedError, PoolError,
                     SignalTimeout)
from ._layout import (ABORT_WORD, ERROR_WORD, FIRST_FLAG_WORD, PoolStats, Region, align,
                      resolve_backend)
from .liveness import process_alive

__all__ = ["SymmetricPool", "PoolStats", "Region", "live_pool_count"]

LIVENESS_PERIOD_S = 0.05

_live_pools = 0


def live_pool_count() -> int:
    """Pools of this process that are open (created and not yet closed)."""
    return _live_pools


class SymmetricPool:
    """A symmetric buffer of `size_bytes` on every rank of `group`, plus `num_signal_words` flag words.

    Creation is collective (one rendezvous); `reserve`, `peer`, `signals` are local and must be called
    with the same arguments in the same order on every rank so that offsets agree. On CUDA, `signal`,
    `wait` and `barrier` are stream-ordered on the current stream; on CPU they act at once.
    """

    def __init__(self, size_bytes: int, *, group: dist.ProcessGroup, backend: str = "auto",
                 device: torch.device | str | None = None, num_signal_words: int = 4096,
                 timeout_s: float = 30.0):
        global _live_pools
        if not isinstance(size_bytes, int) or size_bytes <= 0:
            raise PoolError(f"size_bytes must be a positive int, got {size_bytes!r}")
        if not isinstance(num_signal_words, int) or num_signal_words < FIRST_FLAG_WORD:
            raise PoolError(f"num_signal_words must be an int >= {FIRST_FLAG_WORD}, got {num_signal_words!r}")
        if group is None:
            raise PoolError("group= is required (pass the TP process group explicitly)")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        self.device = torch.device(device)
        self.backend_name = resolve_backend(backend, self.device)
        self.group = group
        self.timeout_s = float(timeout_s)
        self.arena_bytes = align(size_bytes)
        self.num_signal_words = num_signal_words
        total = self.arena_bytes + 4 * num_signal_words
        self._backend = self._make_backend(total)
        self.rank, self.world_size = self._backend.rank, self._backend.world_size
        try:
            pids: list = [None] * self.world_size
            dist.all_gather_object(pids, os.getpid(), group=group)
        except BaseException:
            self._backend.close()
            raise
        self.peer_pids: tuple[int, ...] = tuple(pids)
        self._regions: dict[str, Region] = {}
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        self._flag_views: dict[tuple[str, int], torch.Tensor] = {}
        self._ptr_tables: dict[tuple[str, str], torch.Tensor] = {}
        self._arena_used = 0
        self._next_flag_word = FIRST_FLAG_WORD
        self._closed = False
        try:
            self._signal_words(self.rank).zero_()
            self._sync_device()
            self._backend.barrier(self.timeout_s)
            self._sync_device()
        except BaseException:
            self._backend.close()
            raise
        _live_pools += 1

    def _make_backend(self, total_bytes: int):
        if self.backend_name == "host":
            from .host import HostBackend
            return HostBackend(total_bytes, self.group)
        if self.backend_name == "torch":
            from .torch_backend import TorchBackend
            return TorchBackend(total_bytes, self.group, self.device)
        if self.backend_name == "ipc":
            from .ipc_backend import IpcBackend
            return IpcBackend(total_bytes, self.group, self.device)
        from .nvshmem_backend import NvshmemBackend
        return NvshmemBackend(total_bytes, self.group, self.device)

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the pool is closed")

    # ----- regions ---------------------------------------------------------------------------------
    def reserve(self, name: str, shape, dtype: torch.dtype, *, num_signals: int = 0,
                exclusive: bool = False) -> torch.Tensor:
        """Reserve region `name` (or return it again if reserved with the same spec); local view.

        Returns this rank's tensor of `shape` and `dtype`. `num_signals` int32 epoch flags come with it
        (see `signals`). Raises PoolCapacityError naming the region, the bytes asked and the bytes left.
        `exclusive=True` refuses a name that is already reserved: an op context counts its own epochs, so
        a second context on the same flags would see the first one's epochs as already arrived.
        """
        self._check_open()
        shape = self._check_spec(name, shape, dtype, num_signals)
        if name in self._regions and exclusive:
            raise PoolError(f"region {name!r} is already reserved by another op context of this pool; "
                            f"give each op (layer) a unique name")
        if name in self._regions:
            region = self._regions[name]
            if (region.shape, region.dtype, region.num_signals) != (shape, dtype, num_signals):
                raise PoolError(
                    f"region {name!r} is already reserved as {region.shape} {region.dtype} with "
                    f"{region.num_signals} signals; asked again as {shape} {dtype} with {num_signals}")
            return self.peer(name, self.rank)
        nbytes = math.prod(shape) * dtype.itemsize
        offset = align(self._arena_used)
        if offset + nbytes > self.arena_bytes:
            raise PoolCapacityError(name, nbytes, max(0, self.arena_bytes - offset), self.arena_bytes)
        if self._next_flag_word + num_signals > self.num_signal_words:
            raise PoolCapacityError(f"{name} (signals)", 4 * num_signals,
                                    4 * (self.num_signal_words - self._next_flag_word),
                                    4 * self.num_signal_words)
        self._regions[name] = Region(name, offset, shape, dtype, nbytes, self._next_flag_word, num_signals)
        self._arena_used = offset + nbytes
        self._next_flag_word += num_signals
        return self.peer(name, self.rank)

    @staticmethod
    def _check_spec(name, shape, dtype, num_signals) -> tuple[int, ...]:
        if not isinstance(name, str) or not name:
            raise PoolError(f"region name must be a non-empty str, got {name!r}")
        if isinstance(shape, int):
            shape = (shape,)
        shape = tuple(shape)
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise PoolError(f"region {name!r}: shape must be non-negative ints, got {shape!r}")
        if not isinstance(dtype, torch.dtype):
            raise PoolError(f"region {name!r}: dtype must be a torch.dtype, got {dtype!r}")
        if not isinstance(num_signals, int) or num_signals < 0:
            raise PoolError(f"region {name!r}: num_signals must be an int >= 0, got {num_signals!r}")
        return shape

    def region(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise PoolError(f"no region {name!r}; reserved: {sorted(self._regions)}") from None

    def peer(self, name: str, rank: int) -> torch.Tensor:
        """View of `rank`'s copy of region `name` (rank within the group). Cached: no allocation."""
        self._check_open()
        key = (name, rank)
        view = self._views.get(key)
        if view is None:
            region = self.region(name)
            self._check_rank(rank)
            raw = self._backend.buffer(rank)[region.offset_bytes:region.offset_bytes + region.nbytes]
            view = raw.view(region.dtype).view(region.shape)
            self._views[key] = view
        return view

    def peers(self, name: str) -> list[torch.Tensor]:
        return [self.peer(name, r) for r in range(self.world_size)]

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise PoolError(f"rank {rank!r} is not in the group (0 <= rank < {self.world_size})")

    # ----- signals ---------------------------------------------------------------------------------
    def _signal_words(self, rank: int) -> torch.Tensor:
        raw = self._backend.buffer(rank)[self.arena_bytes:self.arena_bytes + 4 * self.num_signal_words]
        return raw.view(torch.int32)

    def signals(self, name: str) -> torch.Tensor:
        """This rank's int32 epoch flags of region `name`, shape [num_signals]."""
        return self.peer_signals(name, self.rank)

    def peer_signals(self, name: str, rank: int) -> torch.Tensor:
        self._check_open()
        key = (name, rank)
        view = self._flag_views.get(key)
        if view is None:
            region = self.region(name)
            self._check_rank(rank)
            view = self._signal_words(rank)[region.first_flag_word:region.first_flag_word + region.num_signals]
            self._flag_views[key] = view
        return view

    def _check_flag(self, name: str, index: int, epoch: int) -> None:
        region = self.region(name)
        if not 0 <= index < region.num_signals:
            raise PoolError(f"flag index {index} out of range for region {name!r} "
                            f"({region.num_signals} signals)")
        from kernels.epoch import DeviceEpoch
        if isinstance(epoch, DeviceEpoch):
            counter = epoch.counter
            if self.device.type != "cuda":
                raise PoolError("a DeviceEpoch needs a CUDA pool; host pools take int epochs")
            if (counter.dtype, counter.numel(), counter.device) != (torch.int32, 1, self.device):
                raise PoolError(f"DeviceEpoch.counter must be one int32 on {self.device}, got "
                                f"{counter.dtype} x {counter.numel()} on {counter.device}")
            if not isinstance(epoch.offset, int) or abs(epoch.offset) >= 2**31:
                raise PoolError(f"DeviceEpoch.offset must be an int32, got {epoch.offset!r}")
        elif not isinstance(epoch, int) or not 1 <= epoch < 2**31:
            raise PoolError(f"epoch must be an int in [1, 2**31) or a DeviceEpoch, got {epoch!r}")

    def signal(self, name: str, index: int, epoch, *, rank: int) -> None:
        """Write `epoch` into flag `index` of region `name` on `rank` (release: after prior writes).

        `epoch` is an int, or on CUDA a `DeviceEpoch` (counter + offset read when the stream gets there:
        what a captured CUDA graph needs, at ~20 us of host time per call instead of ~3 us).

        CPU: a store after the caller's stores (x86 keeps store order). CUDA: enqueued on the current
        stream as a stream memory operation (cuStreamWriteValue32, fenced: ~3 us of host time, no SM),
        or, where that is unavailable for this memory, a release store at system scope from a kernel.
        """
        self._check_flag(name, index, epoch)
        flags = self.peer_signals(name, rank)
        if self.device.type == "cpu":
            flags[index] = epoch
            return
        from kernels.flags import write_flag
        write_flag(flags, index, epoch)

    def wait(self, name: str, index: int, epoch, *, timeout_s: float | None = None,
             peer: int | None = None, op: str | None = None) -> None:
        """Wait until this rank's flag `index` of `name` is >= `epoch`, bounded by `timeout_s`.

        `epoch` as in `signal` (a `DeviceEpoch` on CUDA only).

        CPU: blocks the calling thread and raises SignalTimeout on expiry. CUDA: enqueues a bounded
        spin on the current stream; on expiry the kernel records the flag in the device error word and
        exits, and the next `check_errors()` raises SignalTimeout.
        """
        self._check_flag(name, index, epoch)
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        flag = self.signals(name)[index:index + 1]
        if self.device.type == "cuda":
            self._last_device_timeout_s = timeout_s
            from kernels.flags import launch_wait
            word = self.region(name).first_flag_word + index
            launch_wait(flag, epoch, self._signal_words(self.rank)[ERROR_WORD:ABORT_WORD + 1],
                        error_code=word, timeout_ns=int(timeout_s * 1e9))
            return
        start = time.monotonic()
        next_check = start + LIVENESS_PERIOD_S
        pause = 1e-6
        while (seen := int(flag[0])) < epoch:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + LIVENESS_PERIOD_S
                self._raise_if_aborted_or_lost(peer, f"flag {name}[{index}] >= {epoch}")
            if now - start > timeout_s:
                self.abort(1)
                raise SignalTimeout(region=name, index=index, epoch=epoch, observed=seen,
                                    timeout_s=timeout_s, peer=peer, op=op)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _raise_if_aborted_or_lost(self, peer: int | None, waiting_for: str) -> None:
        code = int(self._signal_words(self.rank)[ABORT_WORD].item())
        if code:
            raise PeerAbortError((code & 0xFF) - 1, code >> 8)
        for r in ([peer] if peer is not None else range(self.world_size)):
            if r != self.rank and not process_alive(self.peer_pids[r]):
                self.abort(2)
                raise PeerLostError(r, self.peer_pids[r], waiting_for=waiting_for)

    def _aborted(self) -> bool:
        return int(self._signal_words(self.rank)[ABORT_WORD].item()) != 0

    def raise_if_peer_lost(self, waiting_for: str) -> None:
        """Raise PeerLostError (and abort the group) if a peer's process has exited: called when an op's
        own bounded wait expired, so that the error names the lost rank rather than only the flag."""
        lost = self.lost_peers()
        if lost:
            self.abort(2)
            raise PeerLostError(lost[0], self.peer_pids[lost[0]], waiting_for=waiting_for)

    def lost_peers(self) -> list[int]:
        """Ranks of the group whose process has exited."""
        return [r for r, pid in enumerate(self.peer_pids) if r != self.rank and not process_alive(pid)]

    def abort(self, reason: int = 3) -> None:
        """Tell every rank of the group (that is still alive) to stop: their waits raise PeerAbortError.

        Called by a rank that gave up (a wait timed out, a peer was lost), so that no rank is left waiting
        for a step that will never come. Only the first abort is kept.
        """
        if self._closed:
            return
        code = torch.tensor([(self.rank + 1) | (reason << 8)], dtype=torch.int32)
        for r in range(self.world_size):
            if r != self.rank and not process_alive(self.peer_pids[r]):
                continue
            word = self._signal_words(r)[ABORT_WORD:ABORT_WORD + 1]
            if int(word.item()) == 0:
                word.copy_(code.to(word.device))
        self._sync_device()

    def check_errors(self) -> None:
        """Raise SignalTimeout if a device-side wait of this rank expired (synchronises the device)."""
        self._check_open()
        if self.device.type != "cuda":
            return
        words = self._signal_words(self.rank)[ERROR_WORD:ABORT_WORD + 1]
        code, epoch, abort = (int(v) for v in words.tolist())
        if code == 0 and abort == 0:
            return
        if code == 0 or code == -1:
            self._raise_if_aborted_or_lost(None, "a device-side wait")
        words[:2].zero_()
        self.raise_if_peer_lost("a device-side wait")  # name the lost rank when a peer died
        self.abort(1)
        for region in self._regions.values():
            if region.first_flag_word <= code < region.first_flag_word + region.num_signals:
                index = code - region.first_flag_word
                seen = int(self.signals(region.name)[index].item())
                raise SignalTimeout(region=region.name, index=index, epoch=epoch, observed=seen,
                                    timeout_s=getattr(self, "_last_device_timeout_s", self.timeout_s))
        raise SignalTimeout(region="?", index=code, epoch=epoch, observed=-1, timeout_s=self.timeout_s)

    # ----- pointer tables for kernels ------------------------------------------------------------------
    def ptr_table(self, name: str, *, signals: bool = False) -> torch.Tensor:
        """int64 tensor [world_size] of every rank's address of region `name` (or of its flags), on the
        pool's device; built once per region and cached."""
        key = (name, "signals" if signals else "data")
        table = self._ptr_tables.get(key)
        if table is None:
            views = [self.peer_signals(name, r) if signals else self.peer(name, r)
                     for r in range(self.world_size)]
            table = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=self.device)
            self._ptr_tables[key] = table
        return table

    # ----- collective lifecycle ----------------------------------------------------------------------
    def barrier(self) -> None:
        """All ranks of the group reach this point (stream-ordered on CUDA, blocking on CPU)."""
        self._check_open()
        self._backend.barrier(self.timeout_s)

    def stats(self) -> PoolStats:
        return PoolStats(
            backend=self.backend_name,
            rendezvous_count=0 if self._closed else 1,
            allocations=(0 if self._closed else 1) + len(self._ptr_tables),
            bytes_total=self.arena_bytes,
            bytes_reserved=self._arena_used,
            num_regions=len(self._regions),
            signal_words_reserved=self._next_flag_word - FIRST_FLAG_WORD,
            handles_open=self._backend.handles_open if not self._closed else 0,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the allocation and every peer mapping (collective for nvshmem). Idempotent."""
        global _live_pools
        if self._closed:
            return
        if self.device.type == "cuda" and not self._aborted() and not self.lost_peers():
            # Collective on CUDA: a slower peer may still be reading this rank's memory (its last pull);
            # skipped after an abort, when a peer may never arrive.
            self._sync_device()
            dist.barrier(group=self.group)
        self._closed = True
        self._views.clear()
        self._flag_views.clear()
        self._ptr_tables.clear()
        self._backend.close()
        _live_pools -= 1

    def __enter__(self) -> "SymmetricPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
