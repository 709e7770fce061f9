"""CUDA IPC for existing allocations (and memfd mappings for CPU tensors): export once, open once."""

__project__ = "tp-overlap"  # checked by overlap/_install.py

from .errors import IpcError
from .handles import Handle, host_allocation_count, host_empty, host_free
from .pool import IpcPool, IpcStats, TensorRecord, live_ipc_pool_count

__all__ = ["IpcPool", "IpcStats", "IpcError", "Handle", "TensorRecord", "host_empty", "host_free",
           "host_allocation_count", "live_ipc_pool_count"]
