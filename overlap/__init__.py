"""Comm/compute overlap for tensor-parallel layers on Hopper: the user surface.

    import tp_overlap
    tp = tp_overlap.parallelize(model, group=tp_group, max_tokens=batch * seq)   # a transformers Llama, in place

* a whole model: `parallelize` (Llama, Mistral, Qwen2: attention and MLP of every block overlapped);
* ops: `AgGemm` (AllGather on copy engines + the GEMM that consumes it), `GemmRs` (GEMM whose epilogue
  scatters tiles to their owners + ReduceScatter on `sm_margin` SMs);
* layers: `TPMLP`, `ColumnParallelLinear`, `RowParallelLinear` (torch custom ops with autograd);
* the pool the ops live in: `SymmetricPool` (exchanged once per TP group), sized by `pool_requirements`;
* configuration: `OverlapConfig` of per-op `AgGemmConfig` / `GemmRsConfig` / `RoleConfig`, from YAML by
  `load_config`, or the shipped preset for a GPU and TP size by `load_preset`;
* activation offload: `OffloadConfig`, `plan_for`, `enable_offload` / `disable_offload`, `HostPool`;
* errors: every one derives from `OverlapError` (and from the builtin it refines).

Subpackages (`tp_overlap.model`, `tp_overlap.ops`, `tp_overlap.gemm`, `tp_overlap.offload`,
`tp_overlap.config`) hold the rest.
"""

from . import _install

if __name__ != _install.PACKAGE:  # overlap/ imported as `overlap`: a checkout's root is on sys.path
    _install.defer_to_other_overlap(__name__, __file__)
else:
    if (_root := _install.checkout_root(__file__)) is not None:  # kernels/, symm_mem/, ... beside overlap/
        __path__.append(str(_root))
    from tp_overlap.ipc.errors import OverlapError, PoolError
    from tp_overlap.symm_mem.errors import PeerAbortError, SignalTimeout
    from tp_overlap.symm_mem.pool import SymmetricPool
    from .config.presets import load_config, load_preset
    from .config.schema import AgGemmConfig, ConfigError, GemmRsConfig, OverlapConfig, RoleConfig
    from .offload import HostPool, OffloadConfig, OffloadError, disable_offload, enable_offload, plan_for
    from .ops.ag_gemm import AgGemm
    from .ops.gemm_rs import GemmRs
    from .ops.layers import ColumnParallelLinear, RowParallelLinear, TPMLP, pool_requirements
    from .ops.validate import OpInputError
    from .model import parallelize

__all__ = [
    "parallelize",
    "AgGemm", "GemmRs", "TPMLP", "ColumnParallelLinear", "RowParallelLinear",
    "SymmetricPool", "pool_requirements",
    "OverlapConfig", "AgGemmConfig", "GemmRsConfig", "RoleConfig", "load_config", "load_preset",
    "OffloadConfig", "plan_for", "enable_offload", "disable_offload", "HostPool",
    "OverlapError", "ConfigError", "OpInputError", "PoolError", "SignalTimeout", "PeerAbortError", "OffloadError",
]
