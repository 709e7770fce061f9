"""Run every candidate GEMM configuration once, on a small shape, in a child process, before a sweep uses
it: a configuration that fails to compile, computes wrong numbers, kills the process (an illegal address,
a compiler abort) or hangs is dropped with its reason instead of taking the whole sweep down, and the
compiled kernels land in Triton's cache for the parent (same specialisation: every dimension a multiple of
16, and the stream-K configurations really split tiles there).

    results = run_canaries("bf16", [("128x256x64w8s3sk1", "nk"), ...], deadline)   # -> {(name, layout): reason}
    python -m tp_overlap.launch.measure.canary bf16 128x256x64w8s3sk1/nk,... cuda 1024x3072x512       # the child

The child prints `try <item>` before and `ok <item> <seconds>` or `bad <item> <reason>` after each one; a
child that dies or stays silent past STEP_TIMEOUT_S is restarted without the item it was trying.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import queue
import subprocess
import sys
import threading
import time

STEP_TIMEOUT_S = 90.0             # compile + run of one configuration; longer counts as a hang
CANARY_SHAPE = (1024, 3072, 512)  # M, N, K: 96 tiles of 128x256 (a partial wave), K short
DEFAULT_JOBS = max(1, min(12, (os.cpu_count() or 2) - 2))   # child processes compiling at once


def precompile(kind: str, items: list[tuple[str, str]], deadline: float, *, jobs: int, device: str,
               shape: tuple[int, int, int]) -> dict[tuple[str, str], str]:
    """`run_canaries`' verdicts ({(name, layout): "" or why not}) from `jobs` child processes at a time, each
    given every jobs-th item: Triton compiles on one core, so the compile phase shrinks ~jobs-fold."""
    slices = [items[i::jobs] for i in range(max(1, min(jobs, len(items))))]
    verdicts: dict[tuple[str, str], str] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(slices)) as pool:
        for result in pool.map(lambda part: run_canaries(kind, part, deadline, device=device, shape=shape), slices):
            verdicts.update(result)
    return verdicts


def operands(m, n, k, layout, dev, seed):
    """(a [M, K], b [K, N]) bf16 on `dev`, drawn there (a CPU draw of a 28672 x 8192 weight takes seconds):
    b row-major (`kn`) or the transpose view of a row-major [N, K] (`nk`)."""
    import torch

    gen = torch.Generator(device=dev).manual_seed(seed)
    a = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device=dev, dtype=torch.bfloat16) / math.sqrt(k)
    return a, (w.t() if layout == "nk" else w.t().contiguous())


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_canaries(kind: str, items: list[tuple[str, str]], deadline: float, *, device: str = "cuda",
                 shape: tuple[int, int, int] = CANARY_SHAPE) -> dict[tuple[str, str], str]:
    """{(name, layout): "" when it ran correctly, else why not}; items not reached by `deadline` are absent.
    `kind` is "bf16" (triton_mm, both layouts) or "fp8" (fp8_gemm, layout "nk")."""
    results: dict[tuple[str, str], str] = {}
    pending = list(items)
    while pending and time.monotonic() < deadline:
        arg = ",".join(f"{name}/{layout}" for name, layout in pending)
        child = subprocess.Popen([sys.executable, "-m", "tp_overlap.launch.measure.canary", kind, arg, device, "x".join(map(str, shape))],
                                 stdout=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True).start()
        current = None
        while True:
            try:
                line = lines.get(timeout=max(1.0, min(STEP_TIMEOUT_S, deadline - time.monotonic())))
            except queue.Empty:
                child.kill()
                if current is not None:
                    results[current] = f"no answer within {STEP_TIMEOUT_S:.0f} s (hang?)"
                break
            if line is None:
                break
            word, _, rest = line.strip().partition(" ")
            item, _, detail = rest.partition(" ")
            key = tuple(item.split("/", 1)) if "/" in item else None
            if word == "try":
                current = key
            elif word in ("ok", "bad") and key:
                results[key] = "" if word == "ok" else detail
                current = None
        code = child.wait()
        if current is not None and current not in results:
            results[current] = f"the process died (exit {code}) running it"
        if not any(key in results for key in pending):
            break  # no progress (e.g. the child cannot start): give up rather than loop
        pending = [key for key in pending if key not in results]
    return results


def _run_one(kind: str, name: str, layout: str, tensors: dict) -> str:
    import torch

    from tp_overlap.gemm import GemmBlocks

    blocks = GemmBlocks.parse(name)
    if kind == "fp8":
        from tp_overlap.gemm import fp8_gemm
        a8, a_scales, w8, w_scales, ref = tensors["fp8"]
        out = torch.full_like(ref, float("nan"))
        fp8_gemm(a8=a8, a_scales=a_scales, w8=w8, w_scales=w_scales, out=out, blocks=blocks)
        tolerance = 5e-3
    else:
        from tp_overlap.gemm import triton_mm
        a, b, ref = tensors[layout]
        out = torch.full_like(ref, float("nan"))
        triton_mm(a, b, out, blocks=blocks)
        tolerance = 1e-2
    if out.is_cuda:
        torch.cuda.synchronize()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return "" if err <= tolerance else f"relative error {err:.3g}"


def _child(kind: str, arg: str, device: str, shape: str) -> int:
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the child of a CPU test: before Triton is imported
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device != "cpu" else torch.device("cpu")
    m, n, k = (int(v) for v in shape.split("x"))
    tensors = {}
    for layout in ("kn", "nk"):
        a, b = operands(m, n, k, layout, dev, seed=1)
        tensors[layout] = (a, b, torch.mm(a, b))
    if kind == "fp8":
        from tp_overlap.gemm import dequantize_activation, dequantize_weight, quantize_activation, quantize_weight
        a, b, _ = tensors["nk"]
        a8, a_scales = quantize_activation(a)
        w8, w_scales = quantize_weight(b.t())
        ref = (dequantize_activation(a8, a_scales) @ dequantize_weight(w8, w_scales).T).bfloat16()
        tensors["fp8"] = (a8, a_scales, w8, w_scales, ref)
    for item in arg.split(","):
        name, layout = item.split("/", 1)
        print(f"try {item}", flush=True)
        start = time.perf_counter()
        try:
            reason = _run_one(kind, name, layout, tensors)
        except Exception as exc:  # a compile error or OutOfResources: this configuration only
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}"
        reason = reason.replace("\n", " ")
        print(f"ok {item} {time.perf_counter() - start:.1f}" if not reason else f"bad {item} {reason}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:5]))
