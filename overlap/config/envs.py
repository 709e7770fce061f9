"""The one module that reads environment variables (debugging and provenance only; the table: docs/CONFIGURATION.md).

| variable            | meaning                                                   | default |
|---------------------|-----------------------------------------------------------|---------|
| OVERLAP_TIMEOUT_S   | bound of every flag wait / pool barrier, seconds          | 30      |
| OVERLAP_GIT_COMMIT  | commit recorded in results (else `git rev-parse HEAD`)    | unset   |
| OVERLAP_COMMAND     | exact command line recorded in results (set by scripts)   | derived |
| OVERLAP_PROGRESS    | 0 silences progress lines on stderr                        | 1       |
| OVERLAP_EAGER_GRAPHS| 0: eager CUDA calls enqueue their plan step by step (no replay of a recorded call) | 1 |

A results file's recorded command carries the variables of `RECORDED` that were set (Triton's
TRITON_INTERPRET among them: a CPU run of Triton kernels fails without it), so that it runs again as it ran.
"""

from __future__ import annotations

import os


def timeout_s() -> float:
    value = os.environ.get("OVERLAP_TIMEOUT_S", "30")
    try:
        parsed = float(value)
    except ValueError:
        raise ValueError(f"OVERLAP_TIMEOUT_S={value!r} is not a number of seconds") from None
    if parsed <= 0:
        raise ValueError(f"OVERLAP_TIMEOUT_S={value!r} must be > 0")
    return parsed


def git_commit() -> str | None:
    return os.environ.get("OVERLAP_GIT_COMMIT") or None


def command() -> str | None:
    return os.environ.get("OVERLAP_COMMAND") or None


def progress_enabled() -> bool:
    return os.environ.get("OVERLAP_PROGRESS", "1") != "0"


def torchrun_world() -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) when launched by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return (int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            int(os.environ["WORLD_SIZE"]))


def eager_graphs() -> bool:
    """Replay eager CUDA op calls as CUDA graphs recorded from their plans (overlap/ops/base.py)."""
    return os.environ.get("OVERLAP_EAGER_GRAPHS", "1") != "0"


RECORDED = ("TRITON_INTERPRET", "OVERLAP_TIMEOUT_S", "OVERLAP_EAGER_GRAPHS", "CUDA_VISIBLE_DEVICES")


def recorded_environment() -> dict[str, str]:
    """The variables of RECORDED that are set: what a recorded command must set again to do the same run."""
    return {name: os.environ[name] for name in RECORDED if name in os.environ}
