"""One-GPU probe of the primitives the one-protocol design rests on (2 processes sharing the GPU, gloo).

    torchrun --standalone --nproc-per-node 2 tests/gpu/probe_memops.py      (prints JSON lines)

Each check prints {"check": name, "ok": bool, ...}; a failing check never stops the others.
"""
import ctypes
import json
import mmap
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())
from tp_overlap.symm_mem import memops  # noqa: E402

RESULTS = []


def report(name, ok, **extra):
    row = {"check": name, "ok": bool(ok), "rank": RANK, **extra}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def check(name):
    def deco(fn):
        def run(*args):
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001
                report(name, False, error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc()[-800:])
        return run
    return deco


def page(nbytes=4096):
    fd = os.memfd_create("probe", 0)
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    return fd, m, addr


def words(addr, n):
    return (ctypes.c_uint32 * n).from_address(addr)


@check("host_page_write_wait")
def host_page_write_wait():
    fd, m, addr = page()
    dev = memops.host_register(addr, 4096)
    w = words(addr, 8)
    s = torch.cuda.Stream()
    memops.MemOpBatch([memops.write(dev + 4, 7)]).enqueue(s.cuda_stream)
    s.synchronize()
    wrote = w[1] == 7
    # a wait released by a plain host store 50 ms later
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(s)
    memops.MemOpBatch([memops.wait_eq(dev + 8, 1), memops.write(dev + 12, 5)]).enqueue(s.cuda_stream)
    e1.record(s)
    threading.Timer(0.05, lambda: w.__setitem__(2, 1)).start()
    t0 = time.perf_counter()
    s.synchronize()
    host_ms = (time.perf_counter() - t0) * 1e3
    report("host_page_write_wait", wrote and w[3] == 5 and 40 < e0.elapsed_time(e1) < 500,
           device_ms=e0.elapsed_time(e1), host_ms=host_ms, dev_equals_host=dev == addr)
    memops.host_unregister(addr)


@check("zero_sm_wait")
def zero_sm_wait():
    fd, m, addr = page()
    dev = memops.host_register(addr, 4096)
    words(addr, 4)[0] = 1
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    compute, side = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    batch = memops.MemOpBatch([memops.wait_eq(dev, 1)])
    rows = []
    for _ in range(5):
        torch.cuda.synchronize()
        g0, c0, c1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        with torch.cuda.stream(compute):
            torch.cuda._sleep(1_000_000)
            g0.record()
            torch.mm(a, a)
        side.wait_event(g0)
        batch.enqueue(side.cuda_stream)
        c0.record(side)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        c1.record(side)
        torch.cuda.synchronize()
        rows.append((g0.elapsed_time(c0) * 1e3, c0.elapsed_time(c1)))
    late = sorted(r[0] for r in rows)[len(rows) // 2]
    report("zero_sm_wait", late < 20, copy_start_after_gemm_start_us=[round(r[0], 1) for r in rows],
           copy_ms=[round(r[1], 3) for r in rows])
    memops.host_unregister(addr)


@check("host_cost")
def host_cost():
    fd, m, addr = page()
    dev = memops.host_register(addr, 4096)
    words(addr, 4)[0] = 1
    s = torch.cuda.current_stream()
    a = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)
    x = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ev = torch.cuda.Event()
    b2 = memops.MemOpBatch([memops.wait_eq(dev, 1), memops.write(dev + 4, 0)])
    b4 = memops.MemOpBatch([memops.write(dev + 4 * i, 1) for i in range(4)])
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y.copy_(x)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=side):
            for _ in range(4):
                y.copy_(x)
                b2.enqueue(torch.cuda.current_stream().cuda_stream)
    import triton
    import triton.language as tl

    @triton.jit
    def noop(p):
        tl.store(p, 1)

    noop[(1,)](x)
    calls = {
        "torch.mm 512x4096x3072": lambda: torch.mm(a, b),
        "event.record": lambda: ev.record(s),
        "stream.wait_event": lambda: s.wait_event(ev),
        "copy_ 4MB": lambda: y.copy_(x),
        "cuMemcpyAsync 4MB (ctypes)": lambda: memops.memcpy_async(y.data_ptr(), x.data_ptr(), 4 << 20, s.cuda_stream),
        "batch memop 2 (ctypes)": lambda: b2.enqueue(s.cuda_stream),
        "batch memop 4 writes (ctypes)": lambda: b4.enqueue(s.cuda_stream),
        "graph replay (8 nodes)": lambda: g.replay(),
        "triton launch": lambda: noop[(1,)](x),
        "torch.empty 4MB": lambda: torch.empty(4 << 20, dtype=torch.uint8, device="cuda"),
    }
    out = {}
    for name, fn in calls.items():
        samples = []
        for _ in range(3):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda._sleep(50_000_000)
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            samples.append((time.perf_counter() - t0) / 50 * 1e6)
        out[name] = round(sorted(samples)[1], 2)
    torch.cuda.synchronize()
    report("host_cost", True, host_us=out)


@check("cross_process_pull_graphed")
def cross_process_pull_graphed():
    # Each rank: a control page shared with its peer (memfd through /proc/pid/fd), a device buffer shared by
    # CUDA IPC. Per step: rank copies fresh data into its slot, writes ready=1 on the peer's page; waits its
    # own ready == 1, resets it, pulls the peer's slot (copy engine), writes consumed=1 on the peer; before
    # the next publish it waits consumed == 1 and resets it. Eager for 20 steps, then captured once and
    # replayed 50 times with fresh data each time.
    from tp_overlap.ipc.pool import IpcPool
    peer = 1 - RANK
    fd, m, addr = page()
    names = [None, None]
    dist.all_gather_object(names, (os.getpid(), fd))
    pfd = os.open(f"/proc/{names[peer][0]}/fd/{names[peer][1]}", os.O_RDWR)
    pm = mmap.mmap(pfd, 4096)
    paddr = ctypes.addressof(ctypes.c_char.from_buffer(pm))
    mine, theirs = memops.host_register(addr, 4096), memops.host_register(paddr, 4096)
    own = words(addr, 8)
    own[1] = 1  # consumed (by the peer) starts set
    n = 1 << 20
    slot = torch.zeros(n, dtype=torch.float32, device="cuda")
    gathered = torch.zeros(n, dtype=torch.float32, device="cuda")
    src = torch.zeros(n, dtype=torch.float32, device="cuda")
    ipc = IpcPool(group=dist.group.WORLD)
    ipc.exchange({"slot": slot})
    peer_slot = ipc.peer("slot", peer)
    dist.barrier()
    publish, comm = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=-1)
    pre = memops.MemOpBatch([memops.wait_eq(mine + 4, 1), memops.write(mine + 4, 0)])
    ready = memops.MemOpBatch([memops.write(theirs + 0, 1)])
    take = memops.MemOpBatch([memops.wait_eq(mine + 0, 1), memops.write(mine + 0, 0)])
    done = memops.MemOpBatch([memops.write(theirs + 4, 1)])

    def step():
        cur = torch.cuda.current_stream()
        publish.wait_stream(cur)
        comm.wait_stream(cur)
        pre.enqueue(publish.cuda_stream)
        with torch.cuda.stream(publish):
            slot.copy_(src)
        ready.enqueue(publish.cuda_stream)
        take.enqueue(comm.cuda_stream)
        with torch.cuda.stream(comm):
            gathered.copy_(peer_slot)
        done.enqueue(comm.cuda_stream)
        cur.wait_stream(publish)
        cur.wait_stream(comm)

    bad = 0
    for i in range(20):
        src.copy_(torch.full((n,), float(i * 10 + RANK), device="cuda"))
        step()
        bad += int(not torch.equal(gathered, torch.full((n,), float(i * 10 + peer), device="cuda")))
    torch.cuda.synchronize()
    dist.barrier()
    cap = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(cap):
        with torch.cuda.graph(g, stream=cap):
            step()
    for i in range(50):
        src.copy_(torch.full((n,), float(1000 + i * 10 + RANK), device="cuda"))
        g.replay()
        bad += int(not torch.equal(gathered, torch.full((n,), float(1000 + i * 10 + peer), device="cuda")))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(200):
        g.replay()
    torch.cuda.synchronize()
    per_step_us = (time.perf_counter() - t0) / 200 * 1e6
    report("cross_process_pull_graphed", bad == 0, mismatches=bad, replay_step_us=round(per_step_us, 1))
    dist.barrier()
    ipc.close()
    memops.host_unregister(addr)
    memops.host_unregister(paddr)


@check("external_event_in_graph")
def external_event_in_graph():
    x = torch.zeros(1 << 20, device="cuda")
    y = torch.zeros_like(x)
    s = torch.cuda.Stream()
    ev = torch.cuda.Event(external=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        x.add_(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            torch.cuda._sleep(2_000_000)
            x.add_(1)
            ev.record()
            torch.cuda._sleep(20_000_000)
    ok = True
    for i in range(5):
        g.replay()
        torch.cuda.current_stream().wait_event(ev)
        y.copy_(x)   # must see x after this replay's add, and need not wait for the long sleep
        torch.cuda.synchronize()
        ok &= float(y[0]) == float(x[0])
    report("external_event_in_graph", ok)


@check("graph_launch_in_capture")
def graph_launch_in_capture():
    x = torch.zeros(16, device="cuda")
    s = torch.cuda.Stream()
    inner, outer = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(inner, stream=s):
            x.add_(1)
        with torch.cuda.graph(outer, stream=s):
            inner.replay()
            x.add_(1)
    outer.replay()
    torch.cuda.synchronize()
    report("graph_launch_in_capture", float(x[0]) == 2.0, value=float(x[0]))


@check("kernel_store_to_host_page")
def kernel_store_to_host_page():
    import triton
    import triton.language as tl

    @triton.jit
    def store_word(p, v):
        tl.store(p, v)
    fd, m, addr = page()
    dev = memops.host_register(addr, 4096)
    ptr = torch.empty(0, dtype=torch.int32, device="cuda")
    # a tensor over the mapped page (the device sees the host page at `dev`)
    t = torch.as_tensor(_CudaArray(dev, 4096), device="cuda").view(torch.int32)
    store_word[(1,)](t[3:], 42)
    torch.cuda.synchronize()
    report("kernel_store_to_host_page", words(addr, 4)[3] == 42)
    del ptr


class _CudaArray:
    def __init__(self, addr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 3, "strides": None}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    RANK = dist.get_rank()
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    if RANK == 0:
        host_page_write_wait()
        kernel_store_to_host_page()
        external_event_in_graph()
        graph_launch_in_capture()
    dist.barrier()
    host_cost()
    dist.barrier()
    cross_process_pull_graphed()
    dist.barrier()
    if RANK == 0:
        zero_sm_wait()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"probe_rank{RANK}.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
