"""HostPool: page-locked host memory allocated once per process on the GPU's NUMA node, carved into slots.

Activation offload copies saved tensors to host memory in forward and back in backward, every step. The
copy engine moves 55 GB/s only into page-locked memory that sits on the GPU's own socket (GPU.md), and
pinning is expensive (milliseconds per GB), so the pool is allocated, placed, touched and pinned once;
a step only reuses its slots. It lives in `overlap/` rather than `symm_mem/`: it is per process (no
rendezvous, no peers), and only the offload engine uses it.

    with HostPool(8 << 30, device="cuda:0") as pool:       # placed on the GPU's node, pinned
        slot = pool.slot("L0.h", nbytes)                   # carved once; the same name returns the same slot
        gen = slot.acquire("step 3 L0.h")                  # refuses a slot that is still held
        host = slot.view((m, n), torch.bfloat16)           # CPU tensor over the slot (no allocation)
        slot.release("step 3 L0.h")

Lifecycle like the device pools: `live_host_pool_count()`, `close()` idempotent (CUDA: synchronises the
device first, so no copy is in flight into unmapped memory), context manager, `stats()`. On CPU ranks the
same bookkeeping runs over ordinary (placed, unpinned) memory.

Slot reuse has two guards. Host side: `acquire` raises SlotInUseError while another owner holds the slot,
and every acquire bumps the slot's `generation`, which the holder re-checks before it reads (`check`):
a slot rewritten under a holder raises StaleSlotError instead of returning someone else's data. Device
side: `last_read` is the CUDA event of the slot's last host-to-device copy; a writer's stream waits on it
before the next device-to-host copy into the slot (stream-ordered, no host synchronisation).
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

import torch

from tp_overlap.ipc.errors import OverlapError

from . import numa as _numa

__all__ = ["HostPool", "OffloadError"]

SLOT_ALIGN_BYTES = 4096  # page-aligned slots: DMA-friendly and no two slots share a page
_CUDA_HOST_REGISTER_PORTABLE = 1

_live_pools = 0


def live_host_pool_count() -> int:
    """HostPools of this process that are open (created and not yet closed)."""
    return _live_pools


class OffloadError(OverlapError, RuntimeError):
    """Activation offload cannot do what was asked (pool, slots, plan or engine misuse)."""


class SlotInUseError(OffloadError):
    """A slot was asked for while another owner still holds it."""


class StaleSlotError(OffloadError):
    """A slot was rewritten while its holder still needed its contents."""


@dataclass(frozen=True)
class HostPoolStats:
    bytes_total: int
    bytes_carved: int
    num_slots: int
    slots_in_use: int
    bytes_in_use: int
    acquisitions: int
    pinned: bool
    numa_node: int | None
    numa_source: str
    placement: str
    page_nodes: tuple  # NUMA node of sampled pages (first, middle, last) as the kernel reports them


class HostSlot:
    """`nbytes` of the pool at a fixed address (`offset` from the pool's base). See the module doc."""

    def __init__(self, pool: "HostPool", name: str, offset: int, nbytes: int):
        self.pool, self.name, self.offset, self.nbytes = pool, name, offset, nbytes
        self.generation = 0
        self.owner: str | None = None
        self.last_read = None  # torch.cuda.Event of the last host-to-device copy out of this slot

    def acquire(self, owner: str) -> int:
        """Take the slot for `owner`; returns the new generation. Raises SlotInUseError if held."""
        self.pool._check_open()
        if self.owner is not None:
            raise SlotInUseError(
                f"host slot {self.name!r} is still held by {self.owner}; {owner} asked for it. A second "
                f"forward ran before the backward of the first (give the engine pending_forwards=2), or a "
                f"slot leaked")
        self.owner = owner
        self.generation += 1
        self.pool._acquisitions += 1
        return self.generation

    def release(self, owner: str) -> None:
        if self.owner != owner:
            raise OffloadError(f"host slot {self.name!r}: {owner} released it, but it is held by {self.owner}")
        self.owner = None

    def check(self, generation: int, owner: str) -> None:
        """Raise StaleSlotError unless the slot still carries `owner`'s write of `generation`."""
        if self.generation != generation:
            raise StaleSlotError(
                f"host slot {self.name!r} was rewritten (generation {self.generation}, {owner} wrote "
                f"{generation}) before {owner} read it back")

    def view(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """CPU tensor of `shape` and `dtype` over the start of the slot (no allocation, no copy)."""
        self.pool._check_open()
        shape = tuple(shape)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.nbytes:
            raise OffloadError(f"host slot {self.name!r} holds {self.nbytes} bytes; {shape} {dtype} needs {nbytes}")
        raw = self.pool._buffer[self.offset:self.offset + nbytes]
        return raw.view(dtype).view(shape)


class HostPool:
    """`size_bytes` of host memory for `device`'s offload copies: placed on its NUMA node (`numa`: "auto",
    a node id, or None), touched and, for CUDA, page-locked with cudaHostRegister, once."""

    def __init__(self, size_bytes: int, *, device: torch.device | str = "cpu", numa: int | str | None = "auto",
                 sysfs: str = "/sys"):
        global _live_pools
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes <= 0:
            raise OffloadError(f"HostPool size_bytes must be a positive int, got {size_bytes!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.size_bytes = -(-size_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.numa = _numa.find_placement(self.device, node=numa, sysfs=sysfs)
        self._addr, self.placement = _numa.map_on_node(self.size_bytes, self.numa)
        self.pinned = False
        try:
            if self.device.type == "cuda":
                self._register()
            self.page_nodes = tuple(_numa.page_node(self._addr + off) for off in
                                    (0, self.size_bytes // 2 // mmap.PAGESIZE * mmap.PAGESIZE,
                                     self.size_bytes - mmap.PAGESIZE))
            self._buffer = torch.frombuffer((ctypes.c_uint8 * self.size_bytes).from_address(self._addr),
                                            dtype=torch.uint8, count=self.size_bytes)
        except BaseException:
            self._unregister()
            _numa.unmap(self._addr, self.size_bytes)
            raise
        self._slots: dict[str, HostSlot] = {}
        self._carved = 0
        self._acquisitions = 0
        self._closed = False
        _live_pools += 1

    # ----- page locking ------------------------------------------------------------------------------
    def _register(self) -> None:
        # torch's own binding of cudaHostRegister (what torch uses for shared pinned memory); flags
        # "portable": pinned for every CUDA context of the process
        with torch.cuda.device(self.device):
            code = int(torch.cuda.cudart().cudaHostRegister(self._addr, self.size_bytes,
                                                            _CUDA_HOST_REGISTER_PORTABLE))
        if code != 0:
            raise OffloadError(f"cudaHostRegister of {self.size_bytes} bytes failed (cudaError {code}); "
                               f"the host may be short of lockable memory")
        self.pinned = True

    def _unregister(self) -> None:
        if self.pinned:
            with torch.cuda.device(self.device):
                torch.cuda.cudart().cudaHostUnregister(self._addr)
            self.pinned = False

    # ----- slots -------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("the host pool is closed")

    def slot(self, name: str, nbytes: int) -> HostSlot:
        """Slot `name` of `nbytes` (carved on first request, the same slot afterwards; a later request may
        ask for fewer bytes, not more). Raises OffloadError naming the bytes asked and left."""
        self._check_open()
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise OffloadError(f"host slot {name!r}: nbytes must be a positive int, got {nbytes!r}")
        found = self._slots.get(name)
        if found is not None:
            if nbytes > found.nbytes:
                raise OffloadError(f"host slot {name!r} was carved with {found.nbytes} bytes; asked again "
                                   f"with {nbytes}")
            return found
        offset = -(-self._carved // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
        if offset + nbytes > self.size_bytes:
            raise OffloadError(f"host pool full: slot {name!r} needs {nbytes} bytes, "
                               f"{max(0, self.size_bytes - offset)} of {self.size_bytes} are left")
        found = self._slots[name] = HostSlot(self, name, offset, nbytes)
        self._carved = offset + nbytes
        return found

    def reset_slots(self) -> None:
        """Forget every slot so the memory can be carved again (e.g. for other shapes); refuses while any
        slot is held. Call it between uses, never inside a step."""
        self._check_open()
        held = [s.name for s in self._slots.values() if s.owner is not None]
        if held:
            raise SlotInUseError(f"reset_slots: slots {held} are still held")
        self._slots.clear()
        self._carved = 0

    def stats(self) -> HostPoolStats:
        live = [s for s in self._slots.values() if s.owner is not None]
        return HostPoolStats(
            bytes_total=0 if self._closed else self.size_bytes, bytes_carved=self._carved,
            num_slots=len(self._slots), slots_in_use=len(live), bytes_in_use=sum(s.nbytes for s in live),
            acquisitions=self._acquisitions, pinned=self.pinned, numa_node=self.numa.node,
            numa_source=self.numa.source, placement=self.placement, page_nodes=self.page_nodes)

    # ----- lifecycle ---------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unpin and unmap (idempotent). On CUDA the device is synchronised first: a copy still in flight
        must not land in unmapped memory."""
        global _live_pools
        if self._closed:
            return
        self._closed = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._slots.clear()
        self._buffer = None
        self._unregister()
        _numa.unmap(self._addr, self.size_bytes)
        _live_pools -= 1

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._slots)} slots"
        return (f"HostPool({self.size_bytes} bytes on {self.device}, node {self.numa.node}, "
                f"pinned={self.pinned}, {state})")
