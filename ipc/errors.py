"""The project's exception root and the pools' base errors. They live here, in the lowest package, so that
every other package (`symm_mem`, `overlap`, `launch`) derives from them without an import cycle."""

__all__ = ["OverlapError", "PoolError", "PoolClosedError", "IpcError"]


class OverlapError(Exception):
    """Root of every exception this project raises on purpose: `except OverlapError` catches them all.
    Each subclass also derives from the builtin it refines (ValueError, TimeoutError, RuntimeError), so
    code written against the builtins keeps working."""


class PoolError(OverlapError, RuntimeError):
    """Misuse of a pool: wrong arguments, wrong backend for the device, double use."""


class PoolClosedError(PoolError):
    """A pool (symmetric or IPC) was used after close(); the message says which one."""


class IpcError(PoolError):
    """An allocation cannot be exported, a handle cannot be opened, or a name is unknown."""
