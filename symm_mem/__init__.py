"""Persistent symmetric memory: one allocation and one control page per rank, exchanged once, named regions,
control flags that streams wait on without an SM, bounded by a watchdog."""

__project__ = "tp-overlap"  # checked by overlap/_install.py

from .errors import (ArgumentMismatch, DeviceCheckError, PeerAbortError, PeerLostError, PeerMismatchError,
                     PoolCapacityError, PoolClosedError, PoolError, PoolStepMismatch, PoolTimeoutError, SignalTimeout)
from .layout import BACKENDS
from .pool import PoolStats, Region, SymmetricPool, live_pool_count

__all__ = ["SymmetricPool", "PoolStats", "Region", "PoolError", "PoolCapacityError", "PoolClosedError",
           "PoolTimeoutError", "SignalTimeout", "PeerLostError", "PeerAbortError", "PeerMismatchError",
           "DeviceCheckError", "ArgumentMismatch", "PoolStepMismatch", "live_pool_count", "BACKENDS"]
