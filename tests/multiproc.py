"""Run a function on N real processes joined by torch.distributed (gloo on CPU, NCCL on GPUs).

`run_ranks(fn, world_size)` spawns the processes, calls `fn(rank, world_size, *args)` in each after
init_process_group, and returns the per-rank return values. Any rank's exception is re-raised in the
test process with that rank's traceback; a run that outlives `timeout_s` is killed and fails the test.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
GPU_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def child_pythonpath(*first: object) -> str:
    """PYTHONPATH for a child process: `first`, the checkout (for `tests`), then this process's own entries
    (where `tp_overlap` was found when it is not installed: the GPU scripts' link)."""
    entries = [*map(str, first), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(entry for entry in entries if entry)


class RankFailure(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, backend, args, results, pg_timeout_s):
    import torch
    import torch.distributed as dist

    os.environ.update(GPU_SAFE_ENV)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s), **kwargs)
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
    except BaseException as exc:  # report every failure, including SystemExit and timeouts
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 90.0,
              pg_timeout_s: float = 60.0, allow_exit: frozenset[int] = frozenset()):
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return the list of return values.

    Ranks listed in `allow_exit` may die without reporting (tests that kill a rank); their value is None.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, backend, args, results, pg_timeout_s),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    values, errors = {}, {}
    try:
        import time
        deadline = time.monotonic() + timeout_s
        expected = set(range(world_size))
        while set(values) | set(errors) != expected:
            dead = {r for r, p in enumerate(procs) if not p.is_alive() and r not in values and r not in errors}
            try:
                rank, status, payload = results.get(timeout=0.2)
                (values if status == "ok" else errors)[rank] = payload
                continue
            except queue.Empty:
                pass
            for r in dead & allow_exit:
                values[r] = None
            if dead - allow_exit and results.empty():
                for r in dead - allow_exit:
                    errors.setdefault(r, f"process exited with code {procs[r].exitcode} without a result")
            if time.monotonic() > deadline:
                missing = sorted(expected - set(values) - set(errors))
                raise RankFailure(f"ranks {missing} did not finish within {timeout_s} s (hang?)")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        first = min(errors)
        raise RankFailure(f"{len(errors)} rank(s) failed; rank {first}:\n{errors[first]}")
    return [values[r] for r in range(world_size)]
