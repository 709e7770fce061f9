"""Typed, frozen configuration and the one YAML loader.

A preset has a `node` section, one section per op under `ops` (each may carry `by_m` buckets: the first
bucket with `m_max >= M` overrides fields for that M), an optional `roles` section keyed by GEMM role, an
optional `model` and an optional `offload` section. Every error names the file, the key, the bad value and
what is allowed.

GEMM roles are the names Megatron / TransformerEngine users know: `fc1_fprop` (AllGather+GEMM of a column
layer), `fc1_dgrad` (its GEMM+ReduceScatter in backward), `fc2_fprop` (GEMM+ReduceScatter of a row layer),
`fc2_dgrad` (its AllGather+GEMM in backward). `fc1_*` apply to every ColumnParallelLinear, `fc2_*` to every
RowParallelLinear. Role settings: `lead_wgrad` (fc2_dgrad) and `bulk_wgrad` (fc1_dgrad), see RoleConfig.

Automatic selection (`preset_path`): `<gpu-slug>_tp<W>.yaml` in the `configs` package; a CUDA GPU without
its own preset falls back to `cuda_default.yaml`, CPU runs use `cpu.yaml`. The YAML loader is
`tp_overlap.config.presets` (the only place YAML is parsed); presets written before the per-op classes and roles
existed keep loading there (`presets.migrate`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tp_overlap.ipc.errors import OverlapError

__all__ = ["AgGemmConfig", "GemmRsConfig", "RoleConfig", "OpPreset", "NodeConfig", "ModelConfig", "MODELS",
           "ACTIVATIONS", "ROLES", "OverlapConfig", "ConfigError", "OPS", "METHODS", "OP_CLASSES", "op_config"]

OPS = ("ag_gemm", "gemm_rs")
METHODS = {"ag_gemm": ("decomposed", "fused"), "gemm_rs": ("fused", "decomposed", "epilogue_reduce", "pair")}
ROLES = ("fc1_fprop", "fc1_dgrad", "fc2_fprop", "fc2_dgrad")
MAX_CHUNKS_PER_RANK = 64
DEFAULT_COMM_SMS = {"fused": 16, "decomposed": 16, "epilogue_reduce": 0, "pair": 0}  # GemmRsConfig.num_comm_sms
STREAM_PRIORITY_RANGE = (-5, 0)  # CUDA: lower is higher priority


class ConfigError(OverlapError, ValueError):
    def __init__(self, message: str, *, file: str = "<config>", key: str = "", value=None, allowed: str = ""):
        self.file, self.key, self.value, self.allowed, self.detail = file, key, value, allowed, message
        where = f"{file}: " if file else ""
        super().__init__(f"{where}{key}: {message}" if key else f"{where}{message}")


def _bad(key: str, value, allowed: str, file: str = "<config>") -> ConfigError:
    return ConfigError(f"got {value!r}; allowed: {allowed}", file=file, key=key, value=value, allowed=allowed)


def _int_in(key, value, lo, hi, file="<config>") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(key, value, f"an int with {lo} <= x <= {hi}", file)


def _common(cfg, key: str, file: str, num_sms: int | None) -> None:
    if cfg.method not in METHODS[cfg.op]:
        raise _bad(f"{key}.method", cfg.method, " | ".join(METHODS[cfg.op]), file)
    _int_in(f"{key}.sm_margin", cfg.sm_margin, 0, (num_sms - 1) if num_sms else 1 << 16, file)
    _int_in(f"{key}.comm_stream_priority", cfg.comm_stream_priority, *STREAM_PRIORITY_RANGE, file)


@dataclass(frozen=True, kw_only=True)
class AgGemmConfig:
    """AllGather+GEMM. method: `decomposed` (cuBLAS consumer: one GEMM per arriving chunk, or with
    lead_fraction f > 0 a lead GEMM over f of the local rows and one GEMM over the rest) or `fused` (one
    persistent Triton GEMM whose tiles wait for their chunk's flag). sm_margin: SMs the consumer leaves
    free (cuBLAS carveout / fewer Triton programs; `fused` leaves at least 1 where ranks share a GPU, whose
    same-device pulls run on SMs); chunks_per_rank: pieces each rank's shard is pulled in;
    comm_stream_priority: priority of the side streams (lower is higher)."""
    method: str = "decomposed"
    sm_margin: int = 0
    chunks_per_rank: int = 1
    comm_stream_priority: int = -1
    lead_fraction: float = 0.0
    op = "ag_gemm"

    def __post_init__(self):
        self.validate()

    def with_method(self, method: str, **changes) -> "AgGemmConfig":
        """A copy running `method` (sweeps): lead_fraction falls back to 0 for `fused`."""
        if method != "decomposed":
            changes.setdefault("lead_fraction", 0.0)
        return dataclasses.replace(self, method=method, **changes)

    def validate(self, *, num_sms: int | None = None, file: str = "<config>", key: str = "ops.ag_gemm") -> None:
        _common(self, key, file, num_sms)
        _int_in(f"{key}.chunks_per_rank", self.chunks_per_rank, 1, MAX_CHUNKS_PER_RANK, file)
        lead = self.lead_fraction
        if isinstance(lead, bool) or not isinstance(lead, (int, float)) or not 0 <= lead <= 1:
            raise _bad(f"{key}.lead_fraction", lead, "a number with 0 <= x <= 1", file)
        if lead and self.method != "decomposed":
            raise _bad(f"{key}.lead_fraction", lead, f"0 (it applies to method decomposed, this is {self.method})",
                       file)


@dataclass(frozen=True, kw_only=True)
class GemmRsConfig:
    """GEMM+ReduceScatter. method: `fused` (Triton GEMM storing each tile into its owner's slot + a
    reduction kernel on num_comm_sms programs that waits for each row block), `epilogue_reduce` (one Triton
    GEMM: other owners' rows scattered first, own rows reduced in its epilogue; needs (M/W) % 128 == 0),
    `decomposed` (one cuBLAS GEMM per owner chunk, copy-engine push, reduction kernel on num_comm_sms
    programs) or `pair` (W = 2 only: cuBLAS GEMM of the peer's rows, copy-engine push while the own rows'
    GEMM runs, one add). sm_margin: SMs the GEMM leaves free; num_comm_sms: reduction programs, by default
    what the method runs (16 for fused and decomposed, 0 for epilogue_reduce and pair: no reduction kernel)."""
    method: str = "fused"
    sm_margin: int = 16
    num_comm_sms: int | None = None
    comm_stream_priority: int = -1
    op = "gemm_rs"

    def __post_init__(self):
        self.fill_defaults()
        self.validate()

    def fill_defaults(self) -> None:
        """num_comm_sms left out (None) follows the method, so that a config naming only its method is valid."""
        if self.num_comm_sms is None:
            object.__setattr__(self, "num_comm_sms", DEFAULT_COMM_SMS.get(self.method, 16))

    def with_method(self, method: str, **changes) -> "GemmRsConfig":
        """A copy running `method` (sweeps), the fields that method needs filled in: fused keeps or takes 16
        reduction programs and at least as many reserved SMs, decomposed 8 reduction programs, epilogue_reduce
        and pair none."""
        if method == "fused":
            comm = changes.setdefault("num_comm_sms", self.num_comm_sms or 16)
            changes.setdefault("sm_margin", max(self.sm_margin, comm))
        elif method == "decomposed":
            changes.setdefault("num_comm_sms", self.num_comm_sms or 8)
        else:
            changes.setdefault("num_comm_sms", 0)
        return dataclasses.replace(self, method=method, **changes)

    def validate(self, *, num_sms: int | None = None, file: str = "<config>", key: str = "ops.gemm_rs") -> None:
        _common(self, key, file, num_sms)
        _int_in(f"{key}.num_comm_sms", self.num_comm_sms, 0, (num_sms - 1) if num_sms else 1 << 16, file)
        if self.method in ("fused", "decomposed") and self.num_comm_sms < 1:
            raise _bad(f"{key}.num_comm_sms", self.num_comm_sms, f">= 1 (method {self.method} runs its "
                       f"reduction kernel on num_comm_sms programs)", file)
        if self.method == "fused" and self.sm_margin < self.num_comm_sms:
            raise _bad(f"{key}.sm_margin", self.sm_margin, f">= num_comm_sms ({self.num_comm_sms}): the fused "
                       f"GEMM and its reduction kernel run at once and must both fit on the GPU", file)
        if self.method in ("epilogue_reduce", "pair") and self.num_comm_sms:
            raise _bad(f"{key}.num_comm_sms", self.num_comm_sms, f"0 (method {self.method} has no reduction "
                       f"kernel)", file)


OP_CLASSES = {"ag_gemm": AgGemmConfig, "gemm_rs": GemmRsConfig}


def op_config(op: str, **fields):
    """The config of `op` ("ag_gemm" | "gemm_rs") with `fields` (for sweeps and tests)."""
    if op not in OP_CLASSES:
        raise ConfigError(f"unknown op {op!r}; allowed: {' | '.join(OPS)}")
    return OP_CLASSES[op](**fields)


@dataclass(frozen=True, kw_only=True)
class RoleConfig:
    """Settings of one GEMM role of a layer.

    lead_wgrad (fc2_dgrad, ag_gemm decomposed): the row layer's backward runs the weight-grad GEMM of this
    rank's rows of dy while the peers' rows are pulled, then the input-grad GEMM whole, then accumulates
    the other rows' weight grad onto the lead's (no split of the input-grad GEMM).
    bulk_wgrad (fc1_dgrad): the column layer's backward runs its input-grad GEMM whole on cuBLAS and hides
    its reduce-scatter (copy engine) behind the weight-grad GEMM instead of behind itself.
    """
    lead_wgrad: bool = False
    bulk_wgrad: bool = False

    def validate(self, role: str, file: str = "<config>") -> None:
        for name in ("lead_wgrad", "bulk_wgrad"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(f"roles.{role}.{name}", getattr(self, name), "true or false", file)
        if self.lead_wgrad and role != "fc2_dgrad":
            raise _bad(f"roles.{role}.lead_wgrad", True, "false (it applies to fc2_dgrad)", file)
        if self.bulk_wgrad and role != "fc1_dgrad":
            raise _bad(f"roles.{role}.bulk_wgrad", True, "false (it applies to fc1_dgrad)", file)


@dataclass(frozen=True, kw_only=True)
class OpPreset:
    """A default and `by_m` buckets ((m_max, value), ascending): the first bucket with m_max >= M wins."""
    default: object
    by_m: tuple = ()

    def for_m(self, m: int):
        for m_max, value in self.by_m:
            if m <= m_max:
                return value
        return self.default

    def reachable(self, max_m: int, multiple: int = 1) -> list:
        """The values some M can reach: M a multiple of `multiple` (an op's group size), 0 < M <= max_m, in
        bucket order, the default last. What an op context checks at construction: a bucket or default no
        call can reach is never run, so it is not refused."""
        values, low = [], 0   # the Ms a bucket wins are (the largest earlier m_max, its own m_max]
        for m_max, value in self.by_m:
            first = (max(low, 0) // multiple + 1) * multiple   # the smallest M above every earlier bucket
            if first <= min(m_max, max_m):
                values.append(value)
            low = max(low, m_max)
        if max_m > low:
            values.append(self.default)
        return values


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    gpu_name: str
    tp_size: int | None  # None: any TP size (CPU and the generic CUDA fallback)
    num_sms: int | None  # None: read from the device at run time
    pool_bytes: int


MODELS = {  # Llama-style MLP dims: hidden size and FFN size (gate and up are each ffn_hidden wide)
    "llama8b": {"hidden": 4096, "ffn_hidden": 14336},
    "llama70b": {"hidden": 8192, "ffn_hidden": 28672},
    "tiny": {"hidden": 64, "ffn_hidden": 176},
}
ACTIVATIONS = ("swiglu", "gelu")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The TP MLP to build: `name` picks dims from MODELS unless hidden/ffn_hidden are given."""
    name: str
    hidden: int
    ffn_hidden: int
    activation: str = "swiglu"

    def __post_init__(self):
        _int_in("model.hidden", self.hidden, 1, 1 << 20)
        _int_in("model.ffn_hidden", self.ffn_hidden, 1, 1 << 22)
        if self.activation not in ACTIVATIONS:
            raise _bad("model.activation", self.activation, " | ".join(ACTIVATIONS))

    @classmethod
    def named(cls, name: str, activation: str = "swiglu") -> "ModelConfig":
        if name not in MODELS:
            raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODELS)}", file="", key="model")
        return cls(name=name, activation=activation, **MODELS[name])


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    node: NodeConfig
    ag_gemm: OpPreset
    gemm_rs: OpPreset
    roles: dict = dataclasses.field(default_factory=dict)   # role -> OpPreset of RoleConfig
    model: ModelConfig | None = None
    offload: object | None = None
    fp8: bool = False   # the layers' default for fp8= (FP8 GEMM+RS runs decomposed or pair)
    source: str = "<config>"

    def op_config(self, op: str, m: int):
        if op not in OPS:
            raise ConfigError(f"unknown op {op!r}; allowed: {' | '.join(OPS)}", file=self.source)
        return getattr(self, op).for_m(m)

    def role(self, role: str, m: int) -> RoleConfig:
        if role not in ROLES:
            raise ConfigError(f"unknown role {role!r}; allowed: {' | '.join(ROLES)}", file=self.source)
        preset = self.roles.get(role)
        return preset.for_m(m) if preset is not None else RoleConfig()

    def check_world_size(self, world_size: int) -> None:
        """Refuse a preset written for another TP size."""
        if self.node.tp_size is not None and self.node.tp_size != world_size:
            raise _bad("node.tp_size", self.node.tp_size,
                       f"{world_size} (the group size this run uses); pick the preset for TP{world_size}",
                       self.source)
