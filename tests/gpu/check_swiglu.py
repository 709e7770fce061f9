"""The one-kernel swiglu on one CUDA GPU: bitwise equal to ATen's unfused ops, and what it saves in time.

    python -m tests.gpu.check_swiglu [--json PATH]    # exit status 1 if any check FAILs

Checks: forward (`F.silu(gate) * up`) and backward (autograd's, through mul, silu and split) bitwise
equal for every bf16 and every fp16 value of gate (NaNs aside: any NaN is accepted as NaN) against random
up and gradients, for fp32 on random data, and at a llama8b shape with a padded row stride; inside a CUDA
graph. Then the times of both at the llama8b shape (M 4096, F 14336, bf16; median of 20, CUDA events).
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from tp_overlap.offload.activation import SavedInputActivation, activation_forward, swiglu_backward, swiglu_forward

from .checklist import Checks, expect, target_device

DEV = torch.device("cuda", 0)  # set by main
TIMES: dict = {}


def _unfused(h, grad_a):
    h = h.detach().requires_grad_(True)
    a = activation_forward(h, "swiglu")
    (dh,) = torch.autograd.grad(a, h, grad_a)
    return a.detach(), dh


def _mismatches(got, want) -> int:
    both_nan = got.isnan() & want.isnan()
    same = (got.view(torch.int16 if got.element_size() == 2 else torch.int32)
            == want.view(torch.int16 if want.element_size() == 2 else torch.int32))
    return int((~(same | both_nan)).sum())


def _compare(h, grad_a, what) -> str:
    a_want, dh_want = _unfused(h, grad_a)
    a, dh = swiglu_forward(h), swiglu_backward(grad_a, h)
    bad_a, bad_dh = _mismatches(a, a_want), _mismatches(dh, dh_want)
    expect(bad_a == 0 and bad_dh == 0, f"{what}: {bad_a} of {a.numel()} forward and {bad_dh} of {dh.numel()} "
                                       f"backward elements differ from ATen's")
    return f"{what}: {a.numel()} + {dh.numel()} elements equal"


def _every_value(dtype) -> torch.Tensor:
    gate = torch.arange(-2**15, 2**15, dtype=torch.int32, device=DEV).to(torch.int16).view(dtype)
    return gate.reshape(256, 256)


def _all_values(dtype) -> str:
    out = []
    for seed in range(3):
        torch.manual_seed(seed)
        gate = _every_value(dtype)
        up = (torch.randn(256, 256, device=DEV) * 2).to(dtype)
        grad_a = torch.randn(256, 256, device=DEV).to(dtype)
        out.append(_compare(torch.cat([gate, up], dim=1), grad_a, f"{dtype} seed {seed}"))
    return out[-1]


def _bf16():
    return _all_values(torch.bfloat16)


def _fp16():
    return _all_values(torch.float16)


def _fp32():
    torch.manual_seed(3)
    h = torch.randn(512, 2 * 1000, device=DEV) * 4
    return _compare(h, torch.randn(512, 1000, device=DEV), "fp32")


def _llama():
    torch.manual_seed(4)
    h = torch.randn(4096, 2 * 14336 + 64, device=DEV, dtype=torch.bfloat16)[:, :2 * 14336]
    return _compare(h, torch.randn(4096, 14336, device=DEV, dtype=torch.bfloat16), "4096 x 14336")


def _graph():
    torch.manual_seed(5)
    h = torch.randn(1024, 2 * 2048, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    grad_a = torch.randn(1024, 2048, device=DEV, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        SavedInputActivation.apply(h, "swiglu").backward(grad_a)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    h.grad = None
    with torch.cuda.graph(graph):
        a = SavedInputActivation.apply(h, "swiglu")
        a.backward(grad_a)
    for rep in range(3):
        with torch.no_grad():
            h.copy_(torch.randn_like(h))
            grad_a.copy_(torch.randn_like(grad_a))
            h.grad.fill_(float("nan"))
        graph.replay()
        a_want, dh_want = _unfused(h, grad_a)
        expect(_mismatches(a, a_want) == 0 and _mismatches(h.grad, dh_want) == 0, f"replay {rep} differs")
    return "3 replays equal"


def _median_ms(fn, reps=20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _times():
    torch.manual_seed(6)
    h = torch.randn(4096, 2 * 14336, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    grad_a = torch.randn(4096, 14336, device=DEV, dtype=torch.bfloat16)
    a_plain, a_lean = activation_forward(h, "swiglu"), SavedInputActivation.apply(h, "swiglu")
    with torch.no_grad():
        TIMES["forward_unfused_ms"] = _median_ms(lambda: activation_forward(h, "swiglu"))
        TIMES["forward_fused_ms"] = _median_ms(lambda: swiglu_forward(h))
    TIMES["backward_autograd_ms"] = _median_ms(lambda: torch.autograd.grad(a_plain, h, grad_a, retain_graph=True))
    TIMES["backward_fused_ms"] = _median_ms(lambda: torch.autograd.grad(a_lean, h, grad_a, retain_graph=True))
    return ", ".join(f"{k} {v:.3f}" for k, v in TIMES.items())


CHECKS = (
    ("bf16: every gate value, bitwise", _bf16),
    ("fp16: every gate value, bitwise", _fp16),
    ("fp32: random values, bitwise", _fp32),
    ("llama8b shape, padded row stride, bitwise", _llama),
    ("inside a CUDA graph, bitwise, replayed on fresh data", _graph),
    ("times at M 4096, F 14336, bf16", _times),
)


def main(argv=None) -> int:
    global DEV
    argv = sys.argv[1:] if argv is None else argv
    dev = target_device(argv)
    if dev is None:
        return 1
    if dev.type != "cuda":
        print("SKIP bitwise equality with ATen's CUDA kernels needs a GPU (tests/unit/test_kernels_swiglu.py "
              "runs the kernels on the CPU)")
        return 0
    DEV = dev
    check = Checks()
    for name, fn in CHECKS:
        check(name)(fn)
    status = check.summary()
    if "--json" in argv:
        path = argv[argv.index("--json") + 1]
        from tp_overlap.launch.output.report import command_line, git_commit
        with open(path, "w") as f:
            checks = [{"name": n, "passed": ok, "detail": d} for n, ok, d in check.results]
            json.dump({"commit": git_commit(), "command": command_line(), "checks": checks, "times_ms": TIMES,
                       "device": torch.cuda.get_device_name(DEV)}, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
