"""Comm/compute overlap for tensor-parallel layers on Hopper: the user surface.

    from overlap import TPMLP, SymmetricPool, pool_requirements, load_preset

* ops: `AgGemm` (AllGather on copy engines + the GEMM that consumes it), `GemmRs` (GEMM whose epilogue
  scatters tiles to their owners + ReduceScatter on `sm_margin` SMs);
* layers: `TPMLP`, `ColumnParallelLinear`, `RowParallelLinear` (torch custom ops with autograd);
* the pool the ops live in: `SymmetricPool` (exchanged once per TP group), sized by `pool_requirements`;
* configuration: `OverlapConfig` of per-op `AgGemmConfig` / `GemmRsConfig` / `RoleConfig`, from YAML by
  `load_config`, or the shipped preset for a GPU and TP size by `load_preset`;
* activation offload: `OffloadConfig`, `plan_for`, `enable_offload` / `disable_offload`, `HostPool`;
* errors: every one derives from `OverlapError` (and from the builtin it refines).

Subpackages (`overlap.ops`, `overlap.gemm`, `overlap.offload`, `overlap.config`) hold the rest.
"""

__project__ = "tp-overlap"  # checked by overlap/_install.py

from ._install import check_import_names

check_import_names()

from ipc.errors import OverlapError, PoolError  # noqa: E402
from symm_mem import PeerAbortError, SignalTimeout, SymmetricPool  # noqa: E402

from .config.presets import load_config, load_preset  # noqa: E402
from .config.schema import AgGemmConfig, ConfigError, GemmRsConfig, OverlapConfig, RoleConfig  # noqa: E402
from .offload import HostPool, OffloadConfig, OffloadError, disable_offload, enable_offload, plan_for  # noqa: E402
from .ops.ag_gemm import AgGemm  # noqa: E402
from .ops.gemm_rs import GemmRs  # noqa: E402
from .ops.layers import ColumnParallelLinear, RowParallelLinear, TPMLP, pool_requirements  # noqa: E402
from .ops.validate import OpInputError  # noqa: E402

__all__ = [
    "AgGemm", "GemmRs", "TPMLP", "ColumnParallelLinear", "RowParallelLinear",
    "SymmetricPool", "pool_requirements",
    "OverlapConfig", "AgGemmConfig", "GemmRsConfig", "RoleConfig", "load_config", "load_preset",
    "OffloadConfig", "plan_for", "enable_offload", "disable_offload", "HostPool",
    "OverlapError", "ConfigError", "OpInputError", "PoolError", "SignalTimeout", "PeerAbortError", "OffloadError",
]
