"""Run many `python -m tp_overlap.launch.X ARGS` calls from one warm interpreter: each call is a forked child process that
runs the launcher module as `__main__` (as `-m` does), with its own environment, working directory, stdout and
stderr, and exits with the status `python -m` would give. torch and the project's packages are imported once,
before the forks: a call then costs a fraction of a second instead of a torch import.

    python tests/mp/_launcher_runner.py CALLS.json   (reads [{key, module, argv, env, cwd, timeout_s}],
                                                      prints {key: {returncode, stdout, stderr}} as JSON)

The environment of the runner itself (CUDA_VISIBLE_DEVICES, TRITON_INTERPRET) must be the calls' own where
torch reads it at import.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback


def _child(call: dict, out_path: str, err_path: str) -> None:
    """In the forked child: become `python -m tp_overlap.launch.<module> argv` and exit with its status."""
    code = 1
    atexit._clear()   # the runner's exit handlers (its temporary folder's cleanup) are not the call's
    try:
        os.chdir(call["cwd"])
        os.environ.clear()
        os.environ.update(call["env"])
        for fd, path in ((1, out_path), (2, err_path)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = [call["module"], *call["argv"]]
        try:
            runpy.run_module(call["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:   # as the interpreter turns sys.exit(...) into a status
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - an uncaught error: the interpreter's traceback and status 1
            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(running: dict, results: dict) -> None:
    for pid, (key, out_path, err_path, deadline) in list(running.items()):
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done and time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            done, status = os.waitpid(pid, 0)
        if done:
            del running[pid]
            with open(out_path) as out, open(err_path) as err:
                results[key] = {"returncode": os.waitstatus_to_exitcode(status), "stdout": out.read(),
                                "stderr": err.read()}


def run(calls: list[dict], parallel: int) -> dict:
    results: dict = {}
    running: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, call in enumerate(calls):
            while len(running) >= parallel:
                _reap(running, results)
                time.sleep(0.01)
            out_path, err_path = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(call, out_path, err_path)
            running[pid] = (call["key"], out_path, err_path, time.monotonic() + call["timeout_s"])
        while running:
            _reap(running, results)
            time.sleep(0.01)
    return results


def main() -> None:
    with open(sys.argv[1]) as f:
        calls = json.load(f)
    # what every launcher imports: loaded once here, shared by the forks
    import torch  # noqa: F401
    import tp_overlap.ops.layers  # noqa: F401
    import tp_overlap.launch.cli.dist  # noqa: F401
    import tp_overlap.launch.output.report  # noqa: F401
    import tp_overlap.launch.measure.timing  # noqa: F401
    results = run(calls, parallel=max(2, os.cpu_count() or 2))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
