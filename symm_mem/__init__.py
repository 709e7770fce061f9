"""Persistent symmetric memory: one allocation per rank, exchanged once, named regions and epoch flags."""

from .errors import (PeerAbortError, PeerLostError, PoolCapacityError, PoolClosedError, PoolError,
                     SignalTimeout)
from kernels.epoch import DeviceEpoch

from .pool import PoolStats, Region, SymmetricPool, live_pool_count

__all__ = ["SymmetricPool", "DeviceEpoch", "PoolStats", "Region", "PoolError", "PoolCapacityError", "PoolClosedError",
           "SignalTimeout", "PeerLostError", "PeerAbortError", "live_pool_count"]
