"""Comm/compute overlap for tensor-parallel layers: configuration, timing, and (as they land) the ops."""

from .config import ConfigError, OpConfig, OverlapConfig, load_config, load_preset
from .timing import Stats, bench_interleaved

__all__ = ["ConfigError", "OpConfig", "OverlapConfig", "load_config", "load_preset", "Stats",
           "bench_interleaved"]
