"""SymmetricPool: one symmetric allocation per rank and one control page per rank, exchanged once.

    [ data arena: regions, 256-byte aligned ][ device flag words (int32, kernels poll them) ]   per rank
    [ control page: error and abort words, control flags, their board ]  shared host memory, per rank

Creation and `barrier()` are bounded by `timeout_s` (a bounded rendezvous through the process group's
store, naming the ranks that did not arrive, or the rank whose process is gone). Every rank must create the
pool with the same sizes (checked at creation) and reserve the same regions in the same order (checked by
every op's agreement step, `agree`). Control flags are what streams wait on: on CUDA a wait is a
stream memory operation (no SM), bounded by the pool's watchdog thread; on CPU a bounded host loop. The
words' values are the protocol's business (`tp_overlap.ops.protocol`); the pool offers "write v" and "wait until
>= v". A failure anywhere (a wait that expired, a lost peer, an abort) is recorded in the control pages and
raised by `raise_if_failed()` (no synchronisation) and `check_errors()` (synchronises) on every rank.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from . import _waits
from .layout import (ABORT_WORD, DEFAULT_TIMEOUT_S, ERROR_CODE_WORD, FIRST_FLAG_WORD, PoolStats, Region, align,
                      check_same_shape, check_spec, check_timeout, check_word, gpu_identity, resolve_backend)
from .control import ControlPages
from .failures import PoolFailures
from .errors import PeerLostError, PoolCapacityError, PoolClosedError, PoolError
from .rendezvous import Rendezvous

__all__ = ["SymmetricPool", "PoolStats", "Region", "live_pool_count"]

_live_pools = 0


def live_pool_count() -> int:
    """Pools of this process that are open (created and not yet closed)."""
    return _live_pools


class SymmetricPool(PoolFailures):
    """`size_bytes` of symmetric memory on every rank of `group`, `num_signal_words` control flags (what
    streams and host threads wait on) and `num_device_words` device flags (what kernels poll).

    Creation, barriers and waits are bounded by `timeout_s` (DEFAULT_TIMEOUT_S unless given; the pools tp_overlap
    builds pass OVERLAP_TIMEOUT_S, docs/CONFIGURATION.md); `reserve` and the views are local and must be
    called with the same arguments in the same order on every rank, so that offsets agree. Views handed
    out (`reserve`, `peer`, `signals`) are valid until `close()`. `shares_gpu`: another rank's memory is on this
    GPU (tests, one-GPU machines), where copies between ranks run on SMs, not copy engines."""

    def __init__(self, size_bytes: int, *, group: dist.ProcessGroup, backend: str = "auto",
                 device: torch.device | str | None = None, num_signal_words: int = 1024,
                 num_device_words: int = 4096, timeout_s: float = DEFAULT_TIMEOUT_S):
        global _live_pools
        for arg, value, low in (("size_bytes", size_bytes, 1), ("num_signal_words", num_signal_words, 0),
                                ("num_device_words", num_device_words, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PoolError(f"{arg} must be an int >= {low}, got {value!r}")
        if group is None:
            raise PoolError("group= is required (pass the TP process group explicitly)")
        check_timeout(timeout_s)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        group_backend = str(dist.get_backend(group)) if backend == "auto" and self.device.type == "cuda" else "nccl"
        self.backend_name = resolve_backend(backend, self.device, group_backend)
        self.group, self.timeout_s = group, float(timeout_s)
        self.arena_bytes = align(size_bytes)
        self.num_signal_words, self.num_device_words = num_signal_words, num_device_words
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.group_ranks = tuple(dist.get_process_group_ranks(group))   # global ranks of the group's members
        self._closed, self._backend, self._control, self._watchdog = True, None, None, None
        self._allocations = 0   # what stats() reports: counted where memory is allocated, never derived
        self._rendezvous = Rendezvous(group, timeout_s=self.timeout_s)
        try:
            shape = (self.arena_bytes, num_signal_words, num_device_words, self.backend_name)
            created = self._rendezvous.exchange((os.getpid(), shape, gpu_identity(self.device)), what="pool creation")
            self.peer_pids = tuple(pid for pid, _, _ in created)
            self._rendezvous.peer_pids = self.peer_pids
            check_same_shape([theirs for _, theirs, _ in created])
            self.shares_gpu = self.device.type == "cuda" and [g for *_, g in created].count(created[self.rank][2]) > 1
            self._control = ControlPages(num_signal_words, self._rendezvous, self.device)
            self._allocations += 1
            self._backend = self._make_backend(self.arena_bytes + 4 * num_device_words)
            self._allocations += 1
            self._device_words(self.rank).zero_()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._rendezvous.barrier(what="pool creation (ready)")
        except BaseException:
            self._rendezvous.abort("pool creation failed")
            self._release()
            raise
        self._regions: dict[str, Region] = {}
        self._released: set[str] = set()   # regions of closed op contexts: a new one may take them back
        self._views: dict[tuple, torch.Tensor] = {}
        self._arena_used = 0
        self._next_control, self._next_device = 0, 0
        self._waits = _waits.WaitState(self)
        self._own = self._control.own
        self._in_flight = 0
        self._closed = False
        if self.device.type == "cuda":
            from .watchdog import Watchdog
            self._watchdog = Watchdog(self)
        _live_pools += 1

    def _make_backend(self, total_bytes: int):
        if self.backend_name == "host":
            from .host import HostBackend
            return HostBackend(total_bytes, self.group, self._rendezvous)
        if self.backend_name == "torch":
            from .torch_backend import TorchBackend
            return TorchBackend(total_bytes, self.group, self.device)
        if self.backend_name == "ipc":
            from .ipc_backend import IpcBackend
            return IpcBackend(total_bytes, self.group, self.device, self._rendezvous)
        from .nvshmem_backend import NvshmemBackend
        return NvshmemBackend(total_bytes, self.group, self.device)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the SymmetricPool is closed (pool.close() was called): its regions, views "
                                  "and the ops built on it were valid until then")

    # ----- regions ---------------------------------------------------------------------------------------
    def layout(self) -> tuple:
        """The regions reserved so far, in order, with where they landed (byte offset, control and device
        words): equal on every rank of a correct program (an op's `agree` compares it)."""
        return tuple((r.name, r.offset_bytes, r.shape, str(r.dtype), r.first_control_word, r.num_control,
                      r.first_device_word, r.num_device_flags) for r in self._regions.values())

    def reserve(self, name: str, shape, dtype: torch.dtype, *, num_signals: int = 0, num_device_flags: int = 0,
                exclusive: bool = False) -> torch.Tensor:
        """Reserve region `name` (or return it again if reserved with the same spec); this rank's view.

        `num_signals` control flags and `num_device_flags` device flags come with it (`signals`,
        `device_flags`); every flag starts at 0. Raises PoolCapacityError naming the region, what was asked,
        what is left and the constructor argument to raise. `exclusive=True` refuses a name already
        reserved (an op context owns its flags; a second one would see the first one's values).
        """
        self._check_open()
        shape = check_spec(name, shape, dtype, num_signals, num_device_flags)
        if name in self._regions:
            region = self._regions[name]
            released = name in self._released
            if exclusive and not released:
                raise PoolError(f"region {name!r} is already reserved by another op context of this pool; "
                                f"give each op (layer) a unique name, or close() the one that holds it first")
            if (region.shape, region.dtype, region.num_control, region.num_device_flags) != \
                    (shape, dtype, num_signals, num_device_flags):
                again = ("was released by a closed op; a pool's arena does not shrink, so a released region is "
                         "only taken back as it was (give the new op another name)") if released else \
                    "is already reserved"
                raise PoolError(f"region {name!r} {again}: it is {region.shape} {region.dtype} with "
                                f"{region.num_control} signals and {region.num_device_flags} device flags; "
                                f"asked again as {shape} {dtype} with {num_signals} and {num_device_flags}")
            self._released.discard(name)
            return self.peer(name, self.rank)
        nbytes = math.prod(shape) * dtype.itemsize
        offset = align(self._arena_used)
        if offset + nbytes > self.arena_bytes:
            raise PoolCapacityError(name, nbytes, max(0, self.arena_bytes - offset), self.arena_bytes)
        if self._next_control + num_signals > self.num_signal_words:
            raise PoolCapacityError(f"{name} (signals)", num_signals, self.num_signal_words - self._next_control,
                                    self.num_signal_words, unit="signal words", knob="num_signal_words")
        if self._next_device + num_device_flags > self.num_device_words:
            raise PoolCapacityError(f"{name} (device flags)", num_device_flags,
                                    self.num_device_words - self._next_device, self.num_device_words,
                                    unit="device words", knob="num_device_words")
        self._regions[name] = Region(name, offset, shape, dtype, nbytes, self._next_control, num_signals,
                                     self._next_device, num_device_flags)
        self._arena_used = offset + nbytes
        self._next_control, self._next_device = self._next_control + num_signals, self._next_device + num_device_flags
        return self.peer(name, self.rank)

    def release(self, name: str) -> None:
        """Give region `name` back (an op context's close): a later `reserve` of the same name and spec takes
        the same memory and flags again, exclusive or not, on every rank alike (the layout does not change:
        the arena does not shrink). Its flags are left as the last call left them, which is where the
        protocol's next call expects them."""
        if not self._closed and name in self._regions:
            self._released.add(name)

    def region(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise PoolError(f"no region {name!r}; reserved: {sorted(self._regions)}") from None

    def peer(self, name: str, rank: int) -> torch.Tensor:
        """View of `rank`'s copy of region `name` (rank within the group). Cached: no allocation."""
        self._check_open()
        key = ("data", name, rank)
        view = self._views.get(key)
        if view is None:
            region = self.region(name)
            self._check_rank(rank)
            raw = self._backend.buffer(rank)[region.offset_bytes:region.offset_bytes + region.nbytes]
            view = self._views[key] = raw.view(region.dtype).view(region.shape)
        return view

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise PoolError(f"rank {rank!r} is not in the group (0 <= rank < {self.world_size})")

    def _device_words(self, rank: int) -> torch.Tensor:
        raw = self._backend.buffer(rank)[self.arena_bytes:self.arena_bytes + 4 * self.num_device_words]
        return raw.view(torch.int32)

    def device_flags(self, name: str, rank: int | None = None) -> torch.Tensor:
        """`rank`'s (default: this rank's) int32 device flags of region `name`, on the pool's device."""
        self._check_open()
        rank = self.rank if rank is None else rank
        key = ("device", name, rank)
        view = self._views.get(key)
        if view is None:
            region = self.region(name)
            self._check_rank(rank)
            first = region.first_device_word
            view = self._views[key] = self._device_words(rank)[first:first + region.num_device_flags]
        return view

    def ptr_table(self, name: str, *, device_flags: bool = False) -> torch.Tensor:
        """int64 tensor [world_size] of every rank's address of region `name` (or of its device flags), on
        the pool's device; built once per region and cached."""
        self._check_open()
        key = ("table", name, device_flags)
        table = self._views.get(key)
        if table is None:
            views = [self.device_flags(name, r) if device_flags else self.peer(name, r)
                     for r in range(self.world_size)]
            table = self._views[key] = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64,
                                                    device=self.device)
            self._allocations += 1
        return table

    # ----- control flags ---------------------------------------------------------------------------------
    def signals(self, name: str, rank: int | None = None):
        """`rank`'s (default: this rank's) control flags of region `name`: an int32 numpy view of shared
        host memory (read and written with plain loads and stores)."""
        self._check_open()
        region = self.region(name)
        rank = self.rank if rank is None else rank
        self._check_rank(rank)
        first = FIRST_FLAG_WORD + region.first_control_word
        return self._control.words[rank][first:first + region.num_control]

    def signal(self, name: str, index: int, value: int, *, rank: int) -> None:
        """Write `value` into control flag `index` of region `name` on `rank`: on CUDA a fenced stream
        memory operation on the current stream (after the stream's earlier work); on CPU a store now."""
        self._check_open()
        check_word("signal", value)
        self._waits.signal(name, index, value, rank)

    def wait(self, name: str, index: int, value: int, *, timeout_s: float | None = None, peer: int | None = None,
             op: str | None = None) -> None:
        """Wait until this rank's control flag `index` of region `name` is >= `value`, bounded.

        CUDA: enqueued on the current stream as a memory-operation wait (no SM); the watchdog releases it
        after `timeout_s` and the next `raise_if_failed` / `check_errors` raises SignalTimeout. CPU: blocks
        the calling thread and raises SignalTimeout (or PeerLostError / PeerAbortError) itself.
        """
        self._check_open()
        check_word("wait", value)
        self._waits.wait(name, index, value, self._bound(timeout_s), peer, op)

    def control_address(self, name: str, index: int, *, rank: int | None = None, board: bool = False) -> int:
        """Device address (CUDA; host address on CPU) of a control flag (or, board=True, of this rank's
        board word for it), for stream memory operations built by the ops."""
        region = self.region(name)
        if not 0 <= index < region.num_control:
            raise PoolError(f"flag index {index} out of range for region {name!r} ({region.num_control} signals)")
        word = region.first_control_word + index
        if board:
            return self._control.address(self.rank, self._control.board_index(word))
        rank = self.rank if rank is None else rank
        self._check_rank(rank)
        return self._control.address(rank, self._control.flag_index(word))

    def expect(self, name: str, index: int, value: int, *, timeout_s: float | None = None, peer: int | None = None,
               op: str | None = None) -> None:
        """Tell the watchdog (and the error messages) about a wait for control flag `index` >= `value`
        that the caller enqueues itself (the ops' pre-built memory-operation batches)."""
        check_word("expect", value)
        self._waits.expect(name, index, value, self._bound(timeout_s), peer, op)

    def _bound(self, timeout_s) -> float:
        return self.timeout_s if timeout_s is None else check_timeout(timeout_s)

    def agree(self, what: str, fields: dict) -> None:
        """Collective, bounded: raise (on every rank) if the ranks passed different `fields`; the message names
        each differing field and every rank's value. For an op's static arguments."""
        self._check_open()
        _waits.agree(self, what, fields)

    def host_wait(self, ready, *, waiting_for: str, on_timeout, timeout_s: float | None = None,
                  peer: int | None = None) -> None:
        """Block until `ready()` is true: spin briefly, then poll with back-off, raising between polls if the
        group failed or a peer's process is gone; after `timeout_s` raise `on_timeout()` (which should record
        the failure). The one bounded host wait of the runtime (CPU flag waits, the ops' call check)."""
        self._check_open()
        self._waits.host_wait(ready, timeout_s=self.timeout_s if timeout_s is None else timeout_s, peer=peer,
                              on_timeout=on_timeout, waiting_for=waiting_for)

    # ----- collective lifecycle ---------------------------------------------------------------------------
    def barrier(self) -> None:
        """Every rank of the group reaches this point, bounded by timeout_s (drains the device first)."""
        self._check_open()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._rendezvous.barrier(what="pool barrier", kind="barrier")

    def begin_call(self) -> None:
        """The entry of an op call: the pool is open and no failure is recorded (else raise it, as
        `raise_if_failed`); the call counts as in flight (close() refuses) until `end_call`."""
        if self._closed:
            self._check_open()
        own = self._own
        if own[ERROR_CODE_WORD] or own[ABORT_WORD]:
            self._waits.raise_if_failed()
        self._in_flight += 1

    def end_call(self) -> None:
        self._in_flight -= 1

    def stats(self) -> PoolStats:
        """Counters that prove the hot path's claims: `allocations` (memory this pool allocated since creation:
        its control page, its symmetric allocation and each cached pointer table) and `rendezvous_count` (the
        collective steps through the group's store: creation's exchanges, each op's agreement step, barriers)
        only grow outside op calls."""
        live = not self._closed
        return PoolStats(backend=self.backend_name, rendezvous_count=self._rendezvous.steps,
                         allocations=self._allocations,
                         bytes_total=self.arena_bytes, bytes_reserved=self._arena_used if live else 0,
                         num_regions=len(self._regions), control_words_reserved=self._next_control,
                         device_words_reserved=self._next_device,
                         handles_open=self._backend.handles_open if live else 0,
                         host_registrations=len(self._control.device_addresses)
                         if live and self.device.type == "cuda" else 0)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the allocation, the control pages and every peer mapping. Idempotent. Refused while an op
        call on this pool is in flight (another thread). On CPU a view still held (from `reserve`, `peer`,
        an op's `return_gathered`) keeps its memory mapped: it reads stale data after close, never faults."""
        self._close(None)

    def _close(self, reason: str | None, *, meet: bool = True) -> None:
        global _live_pools
        if self._closed:
            return
        if self._in_flight:
            raise PoolError("SymmetricPool.close() while an op call on it is in flight; close after the call "
                            "returns")
        failed = self._waits.failed()
        if meet and not failed and not self.lost_peers() and self._rendezvous.out_of_step is None:
            try:  # a slower peer may still be reading this rank's memory (its last pull)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                # `reason`: why this rank leaves its pool block, for a peer still at another step
                self._rendezvous.barrier(what="pool close", kind="close", note=reason)
            except (PoolError, PeerLostError):
                pass  # bounded; the peers' own close is bounded too
        self._closed = True
        self._release()
        _live_pools -= 1

    def _release(self) -> None:
        if self._watchdog is not None:
            # drain the device while the watchdog still releases waits (after a failure every queued wait is
            # released as soon as a stream reaches it), so that nothing is left waiting once it stops
            torch.cuda.synchronize(self.device)
            self._watchdog.stop()
            self._watchdog = None
        if getattr(self, "_views", None):
            self._views.clear()
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        self._own = None  # a view of the control page: it would keep the page mapped (views outlive close)
        if self._control is not None:
            self._control.close()
            self._control = None

    def __enter__(self) -> "SymmetricPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._leave_block(exc)
