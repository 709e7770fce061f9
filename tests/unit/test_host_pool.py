"""HostPool on CPU: NUMA placement from a (fake) sysfs tree, lifecycle and counting, slot carving and guards."""

import os

import pytest
import torch

from tp_overlap.offload import numa
from tp_overlap.offload.host_pool import (SLOT_ALIGN_BYTES, HostPool, OffloadError, SlotInUseError, StaleSlotError,
                               live_host_pool_count)


def _sysfs(tmp_path, *, nodes="0-1", cpulists=None, pci=None):
    """A fake /sys: node online list, per-node cpulists, and PCI devices' numa_node."""
    node_dir = tmp_path / "devices/system/node"
    node_dir.mkdir(parents=True)
    if nodes is not None:
        (node_dir / "online").write_text(nodes + "\n")
    for node, cpus in (cpulists or {}).items():
        (node_dir / f"node{node}").mkdir()
        (node_dir / f"node{node}/cpulist").write_text(cpus + "\n")
    for address, value in (pci or {}).items():
        dev = tmp_path / "bus/pci/devices" / address
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(f"{value}\n")
    return str(tmp_path)


def test_parse_cpulist():
    assert numa.parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert numa.parse_cpulist("") == ()


def test_the_gpu_node_comes_from_its_pci_device(tmp_path, monkeypatch):
    mine = sorted(os.sched_getaffinity(0))
    root = _sysfs(tmp_path, cpulists={0: "1000-1001", 1: ",".join(map(str, mine))},
                  pci={"0000:18:00.0": 1, "0000:9a:00.0": -1})
    monkeypatch.setattr(numa, "pci_address", lambda device: ("0000:18:00.0", "test"))
    found = numa.find_placement(torch.device("cuda", 0), sysfs=root)
    assert found.node == 1 and found.cpus == tuple(mine)
    assert "0000:18:00.0/numa_node = 1" in found.source
    # the firmware's "no node" (-1), a missing file, and a device with no PCI address all fall back cleanly
    monkeypatch.setattr(numa, "pci_address", lambda device: ("0000:9a:00.0", "test"))
    assert numa.find_placement("cuda:0", sysfs=root).node is None
    assert "-1" in numa.find_placement("cuda:0", sysfs=root).source
    monkeypatch.setattr(numa, "pci_address", lambda device: ("0000:aa:00.0", "test"))
    assert "unreadable" in numa.find_placement("cuda:0", sysfs=root).source
    monkeypatch.setattr(numa, "pci_address", lambda device: (None, "no PCI address here"))
    assert numa.find_placement("cuda:0", sysfs=root) == numa.NumaPlacement(None, (), "no PCI address here")


def test_placement_falls_back_without_numa_information(tmp_path):
    assert numa.find_placement("cpu", sysfs=str(tmp_path)).node is None  # no sysfs at all
    single = _sysfs(tmp_path / "one", nodes="0", cpulists={0: "0-1"})
    assert "single NUMA node" in numa.find_placement("cuda:0", sysfs=single).source
    assert numa.find_placement("cpu", node=None).source == "placement disabled by the caller"
    with pytest.raises(ValueError, match="allowed"):
        numa.find_placement("cpu", node="nearest")


def test_a_cpu_rank_uses_the_node_of_its_cpus(tmp_path):
    mine = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    root = _sysfs(tmp_path, cpulists={0: "1000-1001", 1: mine})
    found = numa.find_placement("cpu", sysfs=root)
    assert found.node == 1 and "node 1" in found.source


def test_a_forced_node_places_and_reports_the_pages():
    with HostPool(1 << 20, numa=0) as pool:
        stats = pool.stats()
        assert stats.numa_node == 0 and "node 0 given" in stats.numa_source
        assert "first touch" in stats.placement
        assert all(node in (0, None) for node in stats.page_nodes)  # None: the kernel would not say


def _mapped(addr: int, nbytes: int) -> bool:
    """Whether any mapping of this process overlaps [addr, addr + nbytes)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo < addr + nbytes and addr < hi:
                return True
    return False


def test_lifecycle_is_counted_idempotent_and_100_cycles_leave_nothing():
    base_live = live_host_pool_count()
    for _ in range(100):
        pool = HostPool(1 << 20)
        addr, nbytes = pool._addr, pool.size_bytes
        assert live_host_pool_count() == base_live + 1 and _mapped(addr, nbytes)
        pool.slot("s", 1000).acquire("me")
        pool.close()
        pool.close()  # idempotent
        assert pool.closed and pool.stats().bytes_total == 0
        assert live_host_pool_count() == base_live and not _mapped(addr, nbytes)
    with HostPool(4096) as pool:
        assert live_host_pool_count() == base_live + 1
    assert live_host_pool_count() == base_live
    with pytest.raises(OffloadError, match="closed"):
        pool.slot("late", 16)


def test_slots_are_carved_once_aligned_and_bounded():
    with HostPool(3 * SLOT_ALIGN_BYTES) as pool:
        a = pool.slot("a", 100)
        b = pool.slot("b", SLOT_ALIGN_BYTES + 1)
        assert (a.offset, b.offset) == (0, SLOT_ALIGN_BYTES)
        assert pool.slot("a", 50) is a
        with pytest.raises(OffloadError, match="carved with 100 bytes"):
            pool.slot("a", 101)
        with pytest.raises(OffloadError, match="host pool full"):
            pool.slot("c", SLOT_ALIGN_BYTES)
        with pytest.raises(OffloadError, match="positive int"):
            pool.slot("d", 0)
        view = b.view((4, 8), torch.float32)
        view.copy_(torch.arange(32.0).view(4, 8))
        assert torch.equal(b.view((4, 8), torch.float32), torch.arange(32.0).view(4, 8))
        with pytest.raises(OffloadError, match="holds"):
            a.view((100,), torch.float32)
        stats = pool.stats()
        assert (stats.num_slots, stats.bytes_carved, stats.slots_in_use) == (2, 2 * SLOT_ALIGN_BYTES + 1, 0)


def test_a_held_slot_is_refused_and_a_rewritten_one_is_detected():
    with HostPool(1 << 16) as pool:
        slot = pool.slot("h", 1024)
        gen = slot.acquire("step 1")
        with pytest.raises(SlotInUseError, match="still held by step 1"):
            slot.acquire("step 2")
        assert pool.stats().slots_in_use == 1 and pool.stats().bytes_in_use == 1024
        with pytest.raises(SlotInUseError):
            pool.reset_slots()
        slot.check(gen, "step 1")
        with pytest.raises(OffloadError, match="held by step 1"):
            slot.release("step 2")
        slot.release("step 1")
        slot.acquire("step 2")  # a new owner: the generation moves on
        with pytest.raises(StaleSlotError, match="rewritten"):
            slot.check(gen, "step 1")
        slot.release("step 2")
        pool.reset_slots()
        assert pool.stats().num_slots == 0 and pool.stats().acquisitions == 2


def test_bad_sizes_are_refused():
    for size in (0, -1, 1.5, True):
        with pytest.raises(OffloadError, match="positive int"):
            HostPool(size)
