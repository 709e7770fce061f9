"""One GPU, one process: a copy-engine copy queued behind the comm path's wait on an already-set flag starts
within 20 us of a full-SM cuBLAS GEMM's start (the wait is a stream memory operation: it needs no SM).

    python -m tests.gpu.check_zero_sm_wait [--json FILE]      (exit 1 when the median start is >= 20 us)

The wait is the pool's own (`SymmetricPool.wait`: board write, memory-operation wait, board write, on the
side stream), on a control flag set beforehand; the copy is 256 MB device -> pinned host (the copy engine).
Offsets are CUDA events: the GEMM's start on the compute stream, the side stream right after the wait.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

LIMIT_US = 20.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.check_zero_sm_wait")
    parser.add_argument("--json", default=None)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args(argv)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29561"),
                       "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    dist.init_process_group("gloo", rank=0, world_size=1)
    from tp_overlap.symm_mem.pool import SymmetricPool
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rows = []
    with SymmetricPool(1 << 20, group=dist.group.WORLD, backend="ipc", device=dev) as pool:
        pool.reserve("ready", (1,), torch.int32, num_signals=1)
        pool.signals("ready")[0] = 1            # the peer's ready flag, already set
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        dst = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
        compute, side = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
        for rep in range(args.reps + 1):
            torch.cuda.synchronize()
            gemm_start, copy_start, copy_end, gemm_end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            with torch.cuda.stream(compute):
                torch.cuda._sleep(2_000_000)   # both sides queued before either starts
                gemm_start.record()
                torch.mm(a, a)
                gemm_end.record()
            side.wait_event(gemm_start)
            with torch.cuda.stream(side):
                pool.wait("ready", 0, 1)       # the comm path's wait: a memory operation, bounded by the watchdog
                copy_start.record()
                dst.copy_(src, non_blocking=True)
                copy_end.record()
            torch.cuda.synchronize()
            pool.check_errors()
            if rep:  # the first rep warms up
                rows.append({"copy_start_after_gemm_start_us": gemm_start.elapsed_time(copy_start) * 1e3,
                             "gemm_ms": gemm_start.elapsed_time(gemm_end),
                             "copy_ms": copy_start.elapsed_time(copy_end)})
    dist.destroy_process_group()
    median = statistics.median(r["copy_start_after_gemm_start_us"] for r in rows)
    ok = median < LIMIT_US
    from tp_overlap.launch.output.report import command_line, git_commit
    doc = {"check": "zero_sm_wait", "commit": git_commit(), "command": command_line(), "ok": ok, "limit_us": LIMIT_US, "median_start_us": median,
           "gemm": "torch.mm 8192 x 8192 x 8192 bf16 (all SMs)", "copy": "256 MB device -> pinned host",
           "wait": "SymmetricPool.wait on a set control flag (cuStreamBatchMemOp)", "rows": rows}
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
