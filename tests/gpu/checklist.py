"""The harness of the GPU check scripts: every check runs (a failure is reported with its message and the
next check still runs), one PASS / FAIL line each with its time, and the helpers the checks share."""

import sys
import time
import traceback

import torch


class Checks:
    """`check = Checks()`, then `@check("what it proves")` on each check function (run at once, in file
    order); `check.results` is [(name, passed, detail)]."""

    def __init__(self):
        self.results: list[tuple[str, bool, str]] = []

    def summary(self) -> int:
        """Print the tally and return the exit status (1 when any check failed)."""
        failed = [name for name, ok, _ in self.results if not ok]
        print(f"{len(self.results) - len(failed)} of {len(self.results)} checks passed"
              + (f"; FAILED: {failed}" if failed else ""))
        return 1 if failed else 0

    def __call__(self, name: str):
        def wrap(fn):
            start = time.perf_counter()
            try:
                self.results.append((name, True, fn() or ""))
            except Exception as exc:  # every check runs; the failure is reported with its message
                self.results.append((name, False, f"{type(exc).__name__}: {exc}"[:400]))
                traceback.print_exc()
            ok, detail = self.results[-1][1], self.results[-1][2]
            print(f"{'PASS' if ok else 'FAIL'} {name} ({time.perf_counter() - start:.1f} s) {detail}", flush=True)
            return fn
        return wrap


def target_device(argv) -> torch.device | None:
    """The device a check script runs on: the current CUDA device, or the CPU (the interpreter) with --cpu;
    None (after a FAIL line) when there is no GPU and --cpu was not given."""
    if "--cpu" in (argv if argv is not None else sys.argv[1:]):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print("FAIL no CUDA device (use --cpu for the interpreter)")
        return None
    return torch.device("cuda", torch.cuda.current_device())


def cuda_device(argv, what: str) -> torch.device | None:
    """The current CUDA device for a check of `what` that has no interpreter path (Gluon kernels); None after a
    FAIL line where there is none (or --cpu was given)."""
    dev = target_device(argv)
    if dev is None or dev.type != "cuda":
        print(f"FAIL {what} needs a CUDA device (Gluon kernels do not run under the interpreter)")
        return None
    return dev


def rel(actual, expected) -> float:
    """Relative Frobenius error, in fp64."""
    return (torch.linalg.norm(actual.double() - expected.double()) / torch.linalg.norm(expected.double())).item()


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def graph_replays_right(run, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, fresh_operands, verify, *,
                        replays: int = 3) -> None:
    """Capture `run()` (writing `out` from `a` and `b`) in a CUDA graph after one warm-up on the capture stream
    (it compiles and allocates that stream's buffers), then replay it `replays` times, each with fresh operands
    (`fresh_operands()` -> (a, b)) copied in and `out` NaN-poisoned; `verify(out, a, b, label)` checks each."""
    device = out.device
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        run()
    for replay in range(replays):
        fresh_a, fresh_b = fresh_operands()
        a.copy_(fresh_a)
        b.copy_(fresh_b)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(device)
        verify(out, a, b, f"replay {replay}")
