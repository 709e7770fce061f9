"""Host cost of the launches one overlapped call makes (one GPU, one process): what bounds the fixed cost
of AG+GEMM at small M. For each launch kind: host µs per launch (enqueue only, 2,000 launches) and device
µs per launch (the same 2,000 back to back, timed with events). The kinds: the protocol's flag signals and
waits (stream memory operations, symm_mem/memops.py: one write, one satisfied wait, a batch of 16 writes;
and torch's stream_write_value32), an event handshake between streams, a device copy, and the GEMMs --
torch.mm, the persistent Triton GEMM alone and as the fused AllGather consumer whose chunk flags are all set
(overlap/gemm/launch.py).

    python -m tp_overlap.launch.launch_overhead [--out FILE]

Needs a CUDA GPU.
"""

from __future__ import annotations

import sys
import time

import torch

from tp_overlap.launch.cli.common import ArgumentParser, output_file, require, run_dir, run_launcher
from tp_overlap.launch.output.report import device_slug, format_table, write_results

PROG = "tp_overlap.launch.launch_overhead"
N = 2000


def _time(fn) -> tuple[float, float]:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(N):
        fn()
    end.record()
    host_us = (time.perf_counter() - t0) / N * 1e6
    torch.cuda.synchronize()
    return host_us, start.elapsed_time(end) / N * 1e3


def make_parser() -> ArgumentParser:
    p = ArgumentParser(PROG, description=__doc__)
    p.add_argument("--out", type=output_file, default=None,
                   help="results JSON (default: runs/launch_overhead-<UTC time>/launch_overhead_<gpu>.json)")
    return p


def parse_args(argv=None):
    return make_parser().parse_args(argv)


def main(argv=None) -> int:
    return run_launcher(PROG, parse_args, _run, argv)


def _launch_kinds(dev: torch.device) -> dict:
    """One callable per launch kind, each making one launch on the current stream; every wait is
    satisfied at once (the flags hold SET), so what is timed is the launch alone."""
    from tp_overlap.kernels.constants import SET
    from tp_overlap.gemm import ChunkWait, GemmBlocks, launch_gemm, num_sms, triton_mm
    from tp_overlap.symm_mem import memops

    flags = torch.full((64,), SET, dtype=torch.int32, device=dev)
    error_words = torch.zeros(3, dtype=torch.int32, device=dev)
    base, word = flags.data_ptr(), flags.element_size()
    signal = memops.MemOpBatch([memops.write(base, SET)])
    wait = memops.MemOpBatch([memops.wait_eq(base + word, SET)])
    signal_range = memops.MemOpBatch([memops.write(base + i * word, SET) for i in range(2, 18)])
    stream = torch.cuda.current_stream(dev).cuda_stream
    write32 = torch._C._distributed_c10d._SymmetricMemory.stream_write_value32
    a = torch.randn(512, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 3072, device=dev, dtype=torch.bfloat16)
    out = torch.empty(512, 3072, device=dev, dtype=torch.bfloat16)
    blocks, programs = GemmBlocks(128, 128, 64, 8, 4, 4), num_sms(dev)
    # two owners of 256 rows, one chunk each: flags 18 and 19
    chunk_wait = ChunkWait(flags=flags[18:20], rows_per_rank=256, chunks_per_rank=1, error_words=error_words,
                           error_code_base=1, timeout_s=1.0)
    src, dst = torch.empty(4 << 20, dtype=torch.uint8, device=dev), torch.empty(4 << 20, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream(priority=-1)
    event = torch.cuda.Event()
    epoch = iter(range(1, 10**9))
    return {
        "memop write (signal)": lambda: signal.enqueue(stream),
        "memop wait (satisfied)": lambda: wait.enqueue(stream),
        "memop batch of 16 writes": lambda: signal_range.enqueue(stream),
        "stream_write_value32": lambda: write32(flags.view(torch.uint32), 40, next(epoch)),
        "event record + wait_event": lambda: (event.record(side), torch.cuda.current_stream().wait_event(event)),
        "copy_ 4 MB d2d": lambda: dst.copy_(src, non_blocking=True),
        "torch.mm 512x4096x3072": lambda: torch.mm(a, b, out=out),
        "triton_mm 512x4096x3072": lambda: triton_mm(a, b, out, blocks=blocks),
        "fused AG consumer 512x4096x3072": lambda: launch_gemm(a=a, w=b, out=out, num_programs=programs,
                                                               blocks=blocks, chunk_wait=chunk_wait),
    }


def _run(args) -> int:
    require(torch.cuda.is_available(), "needs a CUDA GPU (it times kernel launches on one GPU); run it on a GPU "
                                       "machine")
    dev = torch.device("cuda", 0)
    rows = []
    for name, fn in _launch_kinds(dev).items():
        host_us, device_us = _time(fn)
        rows.append({"launch": name, "host_us_per_launch": host_us, "device_us_per_launch": device_us})
        print(f"{name:36s} host {host_us:7.2f} us   device {device_us:7.2f} us", flush=True)
    name = torch.cuda.get_device_name(dev)
    path = args.out or run_dir("launch_overhead") / f"launch_overhead_{device_slug(name)}.json"
    write_results(path, rows, device=name, tp=1, extra={"op": "launch_overhead", "launches": N})
    print(format_table(rows, ["launch", "host_us_per_launch", "device_us_per_launch"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
