"""The launchers' edges: argument parsing, one-line errors, run folders, labels of what a run measured.

Errors. A launcher's `main(argv)` is `run_launcher(prog, parse_args, body, argv)`; whatever goes wrong is
printed as ONE line, `<prog>: <message>`, on stderr, and the process exits non-zero:

* usage errors (`UsageError`: a bad argument, found before the process group or any pool exists;
  `ConfigError`: a preset): every rank finds the same error from the same arguments, so only rank 0
  prints, with exit status 2. Under torchrun the other ranks exit 0 and rank 0 waits (at most
  SIBLING_WAIT_S) until they have: torchrun stops any worker still running when one fails, and lists
  each one it stopped as a failure of its own (exit code -15, SIGTERM); this way its report names one
  failed rank, rank 0 with exit code 2.
* any other error: exit status 1 on every rank that raised it; rank 0 prints, and another rank prints
  (`<prog>: rank R: ...`) unless its error is one every rank raises the same way (`OpInputError`,
  `PeerAbortError`: a peer gave up, that peer says why).

Ctrl-C: one line per rank, `<prog>: rank R: interrupted (Ctrl-C)`, exit status 130. torchrun forwards the
signal to its workers one at a time, so the first rank to act on it aborts its pool (an op call it lands in,
or the pool block it leaves) and a peer may stop on that abort before its own signal arrives: that peer
says `interrupted (Ctrl-C on rank R)`. Either way no rank is left waiting.

`--debug` (every launcher has it) prints the traceback as well. torchrun itself adds its own failure
report (`ChildFailedError`, ~30 lines) after any job with a failed rank; that part is not ours to change.

Outputs. Without `--out` / `--out-dir`, a launcher writes into a new run folder `runs/<launcher>-<UTC
time>/` under the working directory (gitignored); `results/` holds results of record and is written only
when asked for explicitly (`--out results/...`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

from tp_overlap.ipc.errors import OverlapError

RUNS_DIR = "runs"
USAGE_EXIT, ERROR_EXIT, INTERRUPTED_EXIT = 2, 1, 130   # 130: the shell's status of a command ended by SIGINT
SIBLING_WAIT_S = 10.0


class UsageError(OverlapError):
    """A bad argument: the same on every rank, found before any communication."""


def env_rank() -> int:
    """This process's rank from torchrun's environment (0 for a plain `python -m`); needs no process group."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout; appends each option's default to its help unless the help already
    says what the default is (defaults that depend on the device are spelled out in the help)."""

    def _get_help_string(self, action):
        text = action.help or ""
        value = action.default
        if (not action.option_strings or value is None or value is False or value is argparse.SUPPRESS
                or "default" in text):
            return text
        shown = ",".join(str(v) for v in value) if isinstance(value, (tuple, list)) else str(value)
        return f"{text} (default: {shown.replace('%', '%%')})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the launchers' conventions: errors raise UsageError (one line, rank 0), help and
    defaults shown by rank 0 only, no abbreviations (an abbreviation that torchrun's own parser also
    matches is swallowed by torchrun), and `--debug`."""

    def __init__(self, prog: str, description: str | None = None, **kwargs):
        super().__init__(prog=prog, description=description, formatter_class=HelpFormatter, allow_abbrev=False,
                         **kwargs)
        self.add_argument("--debug", action="store_true", help="on an error, print its traceback too")

    def error(self, message: str):
        raise UsageError(message)

    def _print_message(self, message, file=None):
        if env_rank() == 0:  # --help under torchrun: once, not once per rank
            super()._print_message(message, file)


def int_list(text: str) -> tuple[int, ...]:
    """argparse type of a comma-separated list of integers: '1024,4096' -> (1024, 4096)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """'1024x3072x4096,...' (M x N x K) -> ((1024, 3072, 4096), ...) (an argparse type: its name is in the error)."""
    try:
        shapes = tuple(tuple(int(v) for v in item.split("x")) for item in text.split(",") if item)
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise ValueError(f"expected MxNxK[,MxNxK...] with positive integers, got {text!r}")
    return shapes


def require(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


def distinct(flag: str, values, what: str = "value") -> None:
    """Refuse a list option that names one value twice (e.g. two MLPs would reserve the same pool regions)."""
    seen = set()
    for value in values:
        require(value not in seen, f"{flag}: {value} is given twice; give each {what} once")
        seen.add(value)


def names(flag: str, text: str, allowed, what: str = "name") -> list[str]:
    """A comma-separated list of names out of `allowed`, each given once (a UsageError naming the flag)."""
    items = [item for item in text.split(",") if item]
    unknown = [item for item in items if item not in allowed]
    require(not unknown, f"{flag}: unknown {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}")
    distinct(flag, items, what)
    return items


def input_file(text: str) -> str:
    """argparse type of a file to read (a YAML preset): a directory or a missing file is a usage error."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a YAML preset file, e.g. configs/cpu.yaml")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def output_file(text: str) -> str:
    """argparse type of a file a run writes at its end: refused now if it cannot be one (a directory, under
    a path that is a file, or where this process may not write), not after the run."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give the path of the file to write")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"{text}: {blocker} is a file, not a directory")
    problem = _unwritable(path)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: cannot write there ({problem}); give a path this process may "
                                         f"write")
    return text


def _unwritable(path: Path) -> str | None:
    """Why a file cannot be written at `path` (tried: a probe file created and removed in the nearest folder
    that exists, where the run would create the missing ones), or None. Write permission bits alone do not
    tell: root passes every check and still cannot create a file in /proc."""
    if path.exists():
        return None if os.access(path, os.W_OK) else "permission denied"
    folder = next(p for p in path.parents if p.exists())
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def output_dir(text: str) -> str:
    """argparse type of a folder a run writes into (created when missing)."""
    path = Path(text)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"{text}: {blocker} is a file, not a directory")
    return text


def _interrupt(exc: BaseException) -> str | None:
    """How Ctrl-C ended this rank, if it did: its own KeyboardInterrupt, or a peer's, when the peer acted on
    it first and aborted the group (torchrun forwards the signal to its workers one at a time)."""
    from tp_overlap.symm_mem.errors import PeerAbortError
    from tp_overlap.symm_mem.layout import INTERRUPTED_REASON
    if isinstance(exc, KeyboardInterrupt):
        return "Ctrl-C"
    if isinstance(exc, PeerAbortError) and exc.reason == INTERRUPTED_REASON:
        return f"Ctrl-C on rank {exc.rank}"
    return None


def _quiet_on_other_ranks(exc: BaseException) -> bool:
    """Errors that every rank raises the same way (rank 0's line says it)."""
    from tp_overlap import ConfigError, OpInputError
    from tp_overlap.symm_mem.errors import PeerAbortError
    return isinstance(exc, (UsageError, ConfigError, OpInputError, PeerAbortError))


def _one_line(exc: BaseException) -> str:
    from tp_overlap import ConfigError
    text = " ".join(str(exc).split())  # one line, whatever the message holds
    if isinstance(exc, ConfigError) and exc.file in ("", "<config>"):  # not from a file: say what, not where
        return " ".join((f"{exc.key}: {exc.detail}" if exc.key else exc.detail).split())
    if isinstance(exc, (UsageError, ConfigError)):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _a_sibling_runs() -> bool:
    """Whether another child of this process's parent (under torchrun: another local worker) still runs."""
    parent, me = os.getppid(), os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:   # no procfs: nothing to wait for
        return False
    for name in entries:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == parent and state not in ("Z", "X"):
            return True
    return False


def _wait_for_sibling_ranks(timeout_s: float = SIBLING_WAIT_S) -> None:
    """Let the other local workers exit first (bounded): see the module docstring, usage errors."""
    deadline = time.monotonic() + timeout_s
    while _a_sibling_runs() and time.monotonic() < deadline:
        time.sleep(0.02)


def run_launcher(prog: str, parse_args: Callable, body: Callable, argv=None) -> int:
    """Parse, run `body(args)`, and turn any error into one line and an exit status (module docstring).

    A torchrun rank run as a program (`argv` None) leaves here by `os._exit` once its output is flushed, its
    work, files and process group all closed: C++ threads of torch.distributed torn down during interpreter
    exit have aborted a finished rank now and then ("terminate called without an active exception", SIGABRT),
    which fails the whole job after a good run."""
    rank_program = argv is None and under_torchrun()
    status = _run_launcher(prog, parse_args, body, argv, rank_program)
    if rank_program:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(status or 0))
    return status


def _run_launcher(prog: str, parse_args: Callable, body: Callable, argv, rank_program: bool) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    rank = env_rank()
    try:
        args = parse_args(argv)
        return body(args)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - the launcher's one place that reports errors
        if rank_program:  # torchrun forwards a Ctrl-C to its workers one by one: a late one must not cut this short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if debug:
            print(f"{prog}: rank {rank}: " + "".join(traceback.format_exception(exc)).rstrip(), file=sys.stderr)
        return _report(prog, rank, exc)


def _report(prog: str, rank: int, exc: BaseException) -> int:
    interrupt = _interrupt(exc)
    if interrupt is not None:  # Ctrl-C reaches every rank: one line each, not a traceback each
        print(f"{prog}: rank {rank}: interrupted ({interrupt})", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT
    from tp_overlap import ConfigError
    usage = isinstance(exc, (UsageError, ConfigError))
    if rank == 0:
        print(f"{prog}: {_one_line(exc)}", file=sys.stderr, flush=True)
    elif not _quiet_on_other_ranks(exc):
        print(f"{prog}: rank {rank}: {_one_line(exc)}", file=sys.stderr, flush=True)
    if usage and under_torchrun():
        if rank != 0:
            return 0
        _wait_for_sibling_ranks()
    return USAGE_EXIT if usage else ERROR_EXIT


def run_dir(launcher: str) -> Path:
    """A new folder `runs/<launcher>-<UTC time>/` under the working directory (created; call on rank 0)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = Path(RUNS_DIR) / f"{launcher}-{stamp}"
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")
