"""Is a peer process still there? Intra-node only: peers' pids are exchanged when a pool is created."""

from __future__ import annotations

import os

__all__ = ["process_alive"]


def process_alive(pid: int) -> bool:
    """False once `pid` has exited, including as a zombie its parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except PermissionError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
