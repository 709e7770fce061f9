"""Errors of the pools. The bases live here, in the lowest package, so that `symm_mem` (which builds on
`ipc`) can derive from them without `ipc` importing `symm_mem`."""

__all__ = ["PoolError", "PoolClosedError", "IpcError"]


class PoolError(RuntimeError):
    """Misuse of a pool: wrong arguments, wrong backend for the device, double use."""


class PoolClosedError(PoolError):
    """A pool (symmetric or IPC) was used after close(); the message says which one."""


class IpcError(PoolError):
    """An allocation cannot be exported, a handle cannot be opened, or a name is unknown."""
