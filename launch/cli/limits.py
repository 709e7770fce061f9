"""What a run can hold: the memory a rank may use, checked from the arguments before any process group, pool
or GPU allocation exists (a size that cannot fit is a usage error naming the bytes needed and the limit).

The checks compare a lower bound of what a run allocates with the memory of its device, shared by the
ranks that share it: on CPU the host memory (the host pool's segments are host memory too) over the local
ranks, on CUDA the GPU's memory over the ranks placed on that GPU. A bound that passes does not promise the
run fits; one that fails proves it cannot.
"""

from __future__ import annotations

import math
import os

import torch

from .common import UsageError

def format_bytes(n: int) -> str:
    """'563,018,672,898,064 bytes (512 TiB)': exact, and readable."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    scale = min(len(units) - 1, max(0, int(math.log(max(n, 1), 1024))))
    return f"{n:,} bytes" + (f" ({n / 1024 ** scale:.1f} {units[scale]})" if scale else "")


def _host_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 1 << 62   # unknown: no limit rather than a false refusal


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (8 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 8 << 30


def _local_ranks(world_size: int) -> int:
    try:   # torchrun sets it; a plain process is alone
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    except ValueError:
        return max(1, world_size)


def memory_limit(where) -> tuple[int, str]:
    """(bytes one rank may use, what that limit is) for a `_dist.Placement`."""
    local = _local_ranks(where.world_size)
    if where.device.type == "cuda":
        props = torch.cuda.get_device_properties(where.device)
        sharing = math.ceil(local / max(1, torch.cuda.device_count()))
        total, what = props.total_memory, f"GPU memory of one {props.name}"
    else:
        sharing, total, what = local, _host_bytes(), "host memory"
    if sharing > 1:
        return total // sharing, f"per rank of {what} ({format_bytes(total)} shared by {sharing} ranks)"
    return total, f"of {what}"


def require_fits(what: str, need_bytes: int, where, hint: str) -> None:
    """UsageError when `need_bytes` (a lower bound per rank) exceeds this rank's share of its memory."""
    limit, limit_what = memory_limit(where)
    if need_bytes > limit:
        raise UsageError(f"{what} needs at least {format_bytes(need_bytes)} per rank, more than the "
                         f"{format_bytes(limit)} {limit_what}; {hint}")
