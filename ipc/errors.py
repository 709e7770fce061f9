"""Errors of the IPC pool."""

from symm_mem.errors import PoolClosedError, PoolError

__all__ = ["IpcError", "PoolClosedError"]


class IpcError(PoolError):
    """An allocation cannot be exported, a handle cannot be opened, or a name is unknown."""
