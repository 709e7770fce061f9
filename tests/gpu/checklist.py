"""The harness of the GPU check scripts: every check runs (a failure is reported with its message and the
next check still runs), one PASS / FAIL line each with its time, and the helpers the checks share."""

import time
import traceback

import torch


class Checks:
    """`check = Checks()`, then `@check("what it proves")` on each check function (run at once, in file
    order); `check.results` is [(name, passed, detail)]."""

    def __init__(self):
        self.results: list[tuple[str, bool, str]] = []

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


def rel(actual, expected) -> float:
    """Relative Frobenius error, in fp64."""
    return (torch.linalg.norm(actual.double() - expected.double()) / torch.linalg.norm(expected.double())).item()


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
