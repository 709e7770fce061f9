"""Where host memory for a GPU should live, and how to put it there (Linux; plain fallbacks elsewhere).

A device-to-host copy into pinned memory on the GPU's own NUMA node runs at the PCIe rate; memory on the
other socket costs 2-3x (GPU.md). The node comes from the device's PCI address in sysfs
(`/sys/bus/pci/devices/<addr>/numa_node`), its CPUs from `/sys/devices/system/node/node<N>/cpulist`.
Pages are placed by a preferred-node policy (`mbind`) where the kernel allows it, and are first touched by
threads bound to the node's CPUs either way (a container's seccomp profile often refuses `mbind`; first
touch by a local thread places the page on that thread's node under the default policy).

Everything here reports how it decided (`NumaPlacement.source`, `how`), so a run can show whether the
pool really sits next to the GPU.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import subprocess
import threading
from dataclasses import dataclass

import torch

__all__: list[str] = []  # host_pool places its memory with it; nothing outside overlap.offload does

# syscall numbers (x86_64, aarch64): mbind, get_mempolicy
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236)}
_MPOL_PREFERRED = 1
_MPOL_F_NODE, _MPOL_F_ADDR = 1, 2
_TOUCH_THREADS = 8

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.syscall.restype = ctypes.c_long
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass(frozen=True)
class NumaPlacement:
    """The node host memory for a device should live on (None: unknown or irrelevant) and its CPUs
    (those this process may run on; empty when unknown). `source` says how the node was found."""
    node: int | None
    cpus: tuple[int, ...]
    source: str


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); '' -> ()."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(cpus))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def pci_address(device: torch.device) -> tuple[str | None, str]:
    """(sysfs PCI address 'dddd:bb:dd.f' of a CUDA device or None, where it came from)."""
    props = torch.cuda.get_device_properties(device)
    parts = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if all(isinstance(p, int) for p in parts):
        return f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}.0", "torch device properties"
    try:  # older torch: ask the driver's tool (bounded: it must never hang a launcher)
        out = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader",
                              f"--id={device.index or 0}"], capture_output=True, text=True, timeout=20)
        bus_id = out.stdout.strip().lower()  # '00000000:18:00.0': an 8-digit domain, sysfs uses 4
        if out.returncode == 0 and bus_id.count(":") == 2:
            domain, rest = bus_id.split(":", 1)
            return f"{int(domain, 16):04x}:{rest}", "nvidia-smi"
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return None, "no PCI address (torch lacks pci_* properties and nvidia-smi did not answer)"


def _node_cpus(node: int, sysfs: str) -> tuple[int, ...]:
    listed = _read(f"{sysfs}/devices/system/node/node{node}/cpulist")
    if listed is None:
        return ()
    allowed = os.sched_getaffinity(0)
    return tuple(c for c in parse_cpulist(listed) if c in allowed)


def _online_nodes(sysfs: str) -> tuple[int, ...] | None:
    online = _read(f"{sysfs}/devices/system/node/online")
    return None if online is None else parse_cpulist(online)


def find_placement(device: torch.device | str, *, node: int | str | None = "auto",
                   sysfs: str = "/sys") -> NumaPlacement:
    """The NUMA node for host buffers serving `device`.

    node="auto": a CUDA device's node from sysfs (the PCI device's `numa_node`); for a CPU device the node
    of the CPUs this process runs on when they all belong to one node. An int forces that node; None
    asks for no placement. A single-node machine (or sysfs without the files, or `numa_node` = -1)
    gives node None with the reason in `source`: there is nothing to choose or no way to know.
    """
    device = torch.device(device)
    if node is None:
        return NumaPlacement(None, (), "placement disabled by the caller")
    if isinstance(node, int) and not isinstance(node, bool):
        return NumaPlacement(node, _node_cpus(node, sysfs), f"node {node} given by the caller")
    if node != "auto":
        raise ValueError(f"node={node!r}; allowed: 'auto', an int node id, or None")
    nodes = _online_nodes(sysfs)
    if nodes is None:
        return NumaPlacement(None, (), f"{sysfs}/devices/system/node/online missing: no NUMA information")
    if len(nodes) == 1:
        return NumaPlacement(None, (), f"single NUMA node ({nodes[0]}): nothing to choose")
    if device.type == "cuda":
        address, how = pci_address(device)
        if address is None:
            return NumaPlacement(None, (), how)
        path = f"{sysfs}/bus/pci/devices/{address}/numa_node"
        value = _read(path)
        if value is None or not value.lstrip("-").isdigit():
            return NumaPlacement(None, (), f"{path} unreadable (address from {how})")
        if int(value) < 0:
            return NumaPlacement(None, (), f"{path} = {value}: the firmware reports no node")
        found = int(value)
        return NumaPlacement(found, _node_cpus(found, sysfs), f"{path} = {found} (address from {how})")
    mine = os.sched_getaffinity(0)
    owners = {n for n in nodes
              if mine & set(parse_cpulist(_read(f"{sysfs}/devices/system/node/node{n}/cpulist") or ""))}
    if len(owners) == 1:
        found = owners.pop()
        return NumaPlacement(found, _node_cpus(found, sysfs), f"cpu rank: this process's CPUs are on node {found}")
    return NumaPlacement(None, (), f"cpu rank: this process's CPUs span nodes {sorted(owners)}")


def _syscall_numbers() -> tuple[int, int] | None:
    return _SYSCALLS.get(platform.machine())


def _mbind_preferred(addr: int, nbytes: int, node: int) -> str:
    numbers = _syscall_numbers()
    if numbers is None:
        return f"no mbind on {platform.machine()}"
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    rc = _libc.syscall(ctypes.c_long(numbers[0]), ctypes.c_void_p(addr), ctypes.c_ulong(nbytes),
                       ctypes.c_int(_MPOL_PREFERRED), mask, ctypes.c_ulong(64 * words + 1), ctypes.c_uint(0))
    if rc != 0:
        return f"mbind refused ({os.strerror(ctypes.get_errno())})"
    return "mbind(preferred)"


def page_node(addr: int) -> int | None:
    """NUMA node of the (touched) page at `addr`, or None where the kernel will not say."""
    numbers = _syscall_numbers()
    if numbers is None:
        return None
    mode = ctypes.c_int(-1)
    rc = _libc.syscall(ctypes.c_long(numbers[1]), ctypes.byref(mode), None, ctypes.c_ulong(0),
                       ctypes.c_void_p(addr), ctypes.c_ulong(_MPOL_F_NODE | _MPOL_F_ADDR))
    return mode.value if rc == 0 else None


def _touch(addr: int, nbytes: int, cpus: tuple[int, ...]) -> bool:
    """Zero [addr, addr + nbytes) from threads bound to `cpus` (first touch decides a page's node).
    Returns whether the threads could be bound. ctypes.memset drops the GIL, so the threads run at once."""
    bound = [True]
    page = mmap.PAGESIZE
    # several threads (memset at one thread's ~5-10 GB/s would take seconds for tens of GB)
    num = max(1, min(_TOUCH_THREADS, len(cpus) or os.cpu_count() or 1, nbytes // (64 << 20) or 1))
    step = -(-nbytes // num // page) * page

    def work(lo: int) -> None:
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)  # Linux: pid 0 = this thread only
            except OSError:
                bound[0] = False
        ctypes.memset(addr + lo, 0, max(0, min(step, nbytes - lo)))

    threads = [threading.Thread(target=work, args=(lo,), name="host-pool-touch")
               for lo in range(0, nbytes, step)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return bound[0] and bool(cpus)


def map_on_node(nbytes: int, placement: NumaPlacement) -> tuple[int, str]:
    """Anonymous private memory of `nbytes` (page-rounded by the caller), placed on `placement.node` and
    touched once. Returns (address, how it was placed)."""
    addr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      -1, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {nbytes} bytes of host memory failed: {os.strerror(err)}")
    how = []
    if placement.node is not None:
        how.append(_mbind_preferred(addr, nbytes, placement.node))
    bound = _touch(addr, nbytes, placement.cpus if placement.node is not None else ())
    how.append("first touch on the node's CPUs" if bound else "first touch unbound")
    return addr, "; ".join(how)


def unmap(addr: int, nbytes: int) -> None:
    if _libc.munmap(ctypes.c_void_p(addr), nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap failed: {os.strerror(err)}")
