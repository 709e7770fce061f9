"""One results format: a JSON file with provenance plus rows, and a markdown table for humans."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from tp_overlap.config import envs

CPU_NOTE = ("CPU run: functional check, not a performance measurement (gloo + the host pool: the comm path is "
            "a memcpy on a thread, GEMMs are torch.mm; times are host clocks, not comparable with GPU ones)")
ONE_RANK_NOTE = ("1 rank: nothing to overlap (no peer to gather from or reduce to); the overlap columns time "
                 "the ops' machinery alone")


class RunLabels(NamedTuple):
    kind: str            # the table's `run_kind` column: measurement | CPU check | 1 rank | CPU check, 1 rank
    header: list[str]    # lines printed above the table (and stored in the JSON as `notes`)


def run_labels(device_type: str, world_size: int) -> RunLabels:
    """What a run's numbers are: a measurement only on GPUs with at least 2 ranks."""
    kinds, header = [], []
    if device_type != "cuda":
        kinds.append("CPU check")
        header.append(CPU_NOTE)
    if world_size == 1:
        kinds.append("1 rank")
        header.append(ONE_RANK_NOTE)
    return RunLabels(", ".join(kinds) or "measurement", header)


def git_commit() -> str:
    """OVERLAP_GIT_COMMIT when a script set it (a copied checkout's .git can be stale: the GPU machine's
    was), else HEAD of the checkout ('+dirty' when it has uncommitted changes)."""
    given = envs.git_commit()
    if given:
        return given
    try:
        root = Path(__file__).resolve().parents[2]  # the checkout
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def command_line() -> str:
    """The command that reproduces this run: OVERLAP_COMMAND if a script set it, else reconstructed, with the
    environment it needs in front (`envs.recorded_environment`, e.g. TRITON_INTERPRET=1 on CPU)."""
    given = envs.command()
    if given:
        return given
    module = next((a for a in sys.orig_argv if a.startswith("tp_overlap.launch.")), None) if hasattr(sys, "orig_argv") else None
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    world = envs.torchrun_world()
    env = "".join(f"{name}={shlex.quote(value)} " for name, value in envs.recorded_environment().items())
    if module and world:
        return f"{env}torchrun --standalone --nproc-per-node {world[2]} -m {module} {args}".strip()
    return env + " ".join(shlex.quote(a) for a in getattr(sys, "orig_argv", sys.argv))


def device_slug(device_name: str) -> str:
    from tp_overlap.gemm.blocks import gpu_slug
    return gpu_slug(device_name)


def gemm_blocks_source(device: str) -> str:
    """What chose the Triton GEMMs' blocks on `device` (a device name): its block table, or the heuristic."""
    from tp_overlap.gemm.blocks import block_table_name
    slug = device_slug(device)
    return "the CPU interpreter's small tiles" if slug == "cpu" else block_table_name(slug)


def write_results(path: str | Path, rows: list[dict], *, device: str, tp: int, extra: dict | None = None) -> Path:
    """Write {"device", "tp", "commit", "command", "date", "gemm_blocks", "rows", ...extra} as JSON; returns the
    path. `gemm_blocks` says what chose the Triton GEMMs' blocks (a GPU without a table: the heuristic)."""
    doc = {"device": device, "tp": tp, "commit": git_commit(), "command": command_line(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gemm_blocks": gemm_blocks_source(device), **(extra or {}), "rows": rows}
    path = Path(path)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(path)
    except OSError as exc:  # named by the path asked for, not the temporary file written first
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise OSError(f"cannot write the results to {path}: {exc.strerror or exc}") from None
    return path


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of `columns` (missing cells blank)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)
