"""Activation offload for stacks of TP MLPs: the engine, its planner and step model, the pinned host pool.

Modules: `engine` (OffloadEngine, enable_offload), `records` (what the engine keeps per saved tensor),
`planner` (per-tensor keep / offload / recompute under a time budget), `sim` (the step model the planner
scores plans with), `config` (OffloadConfig, the YAML section and the CLI form), `host_pool` (pinned,
NUMA-placed host slots), `numa` (placement), `activation` (the MLP activation that saves only its input).
"""

from .activation import SavedInputActivation, activation_forward
from ..config.offload import DEFAULT_MAX_ADDED, PACING, OffloadConfig, parse_offload_arg, parse_offload_section
from .engine import OffloadEngine, disable_offload, enable_offload, host_bytes
from .host_pool import HostPool, OffloadError
from .planner import (MLPShape, OffloadPlanError, Rates, calibrate, pacing_offset, plan_for, plan_offload, plan_sweep,
                      simulate, tensor_bytes)

__all__ = ["OffloadEngine", "enable_offload", "disable_offload", "host_bytes", "plan_for", "plan_offload",
           "plan_sweep", "simulate", "calibrate", "pacing_offset", "tensor_bytes", "MLPShape", "Rates",
           "OffloadPlanError",
           "OffloadConfig", "parse_offload_section", "parse_offload_arg", "DEFAULT_MAX_ADDED", "PACING",
           "HostPool", "OffloadError", "SavedInputActivation", "activation_forward"]
