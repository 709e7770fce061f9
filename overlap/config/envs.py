"""The one module that reads environment variables (debugging and provenance only): OVERLAP_TIMEOUT_S,
OVERLAP_GIT_COMMIT, OVERLAP_COMMAND, OVERLAP_PROGRESS, OVERLAP_EAGER_GRAPHS, and torchrun's RANK, LOCAL_RANK and
WORLD_SIZE. What each means and its default: the table in docs/CONFIGURATION.md.

A results file's recorded command carries the variables of `RECORDED` that were set (Triton's
TRITON_INTERPRET among them: a CPU run of Triton kernels fails without it), so that it runs again as it ran.
"""

from __future__ import annotations

import os


def timeout_s() -> float:
    """OVERLAP_TIMEOUT_S, else the pool's default: what the pools tp_overlap builds pass as their `timeout_s`
    (`tp_overlap.parallelize`, the launchers); a SymmetricPool built by hand takes its own argument."""
    from tp_overlap.symm_mem.layout import DEFAULT_TIMEOUT_S   # the one default (symm_mem reads no environment)

    value = os.environ.get("OVERLAP_TIMEOUT_S")
    if value is None:
        return DEFAULT_TIMEOUT_S
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
