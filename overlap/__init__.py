"""Comm/compute overlap for tensor-parallel layers: the ops (`ag_gemm`, `gemm_rs`), the layers, configuration."""

from ._validate import OpInputError
from .config import AgGemmConfig, ConfigError, GemmRsConfig, OverlapConfig, RoleConfig
from .presets import load_config, load_preset

__all__ = ["AgGemmConfig", "GemmRsConfig", "RoleConfig", "OverlapConfig", "ConfigError", "OpInputError",
           "load_config", "load_preset"]
