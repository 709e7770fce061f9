"""Typed, frozen configuration and the one YAML loader.

A preset file has a `node` section and one section per op under `ops`; an op section may carry `by_m`
buckets (first bucket with `m_max >= M` wins) that override fields for small/medium M. Every error names
the file, the key, the bad value and what is allowed.

Automatic selection (`preset_path`): `<gpu-slug>_tp<W>.yaml` in the `configs` package (e.g. an
"NVIDIA H200" at TP2 -> `h200_tp2.yaml`); a CUDA GPU without its own preset falls back to
`cuda_default.yaml` (SM count read from the device at run time), and CPU runs use `cpu.yaml`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = ["OpConfig", "OpBucket", "OpPreset", "NodeConfig", "ModelConfig", "MODELS", "OverlapConfig", "ConfigError", "OPS",
           "METHODS", "load_config", "parse_config", "to_dict", "preset_path", "load_preset", "dump_config", "gpu_slug"]

OPS = ("ag_gemm", "gemm_rs")
METHODS = {"ag_gemm": ("decomposed", "fused"), "gemm_rs": ("fused", "decomposed", "epilogue_reduce")}
MAX_CHUNKS_PER_RANK = 64
STREAM_PRIORITY_RANGE = (-5, 0)  # CUDA: lower is higher priority


class ConfigError(ValueError):
    def __init__(self, message: str, *, file: str = "<dict>", key: str = "", value=None, allowed: str = ""):
        self.file, self.key, self.value, self.allowed, self.detail = file, key, value, allowed, message
        super().__init__(f"{file}: {key}: {message}" if key else f"{file}: {message}")


def _bad(key: str, value, allowed: str, file: str = "<dict>") -> ConfigError:
    return ConfigError(f"got {value!r}; allowed: {allowed}", file=file, key=key, value=value, allowed=allowed)


def _int_in(key, value, lo, hi, file="<dict>") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(key, value, f"an int with {lo} <= x <= {hi}", file)


@dataclass(frozen=True, kw_only=True)
class OpConfig:
    """SM partition and schedule of one overlapped op.

    sm_margin: SMs the GEMM leaves free (the GEMM runs on num_sms - sm_margin); num_comm_sms: SMs the
    communication side may use (0 = copy engine only); chunks_per_rank: sub-chunks per rank's shard;
    comm_stream_priority: CUDA priority of the communication stream(s) (lower = higher priority);
    lead_fraction (ag_gemm, decomposed): 0 = one GEMM per arriving chunk; f in (0, 1] = a lead GEMM over
    f of the local rows, then one GEMM over the rest once every pull has landed (see AgGemm);
    lead_wgrad (ag_gemm, decomposed): in a row layer's backward, the weight-grad GEMM over this rank's
    rows of dy leads while the peers' rows are pulled, then the input-grad GEMM runs whole over all M
    rows, then the weight grad of the other rows is accumulated onto the lead's (beta = 1): no split of
    the input-grad GEMM; lead_fraction does not apply to that call;
    bulk_wgrad (gemm_rs): in a column layer's backward, run the input-grad GEMM whole on cuBLAS and
    overlap its reduce-scatter (copy engine) with the weight-grad GEMM instead of with itself.
    """
    op: str
    method: str
    sm_margin: int = 0
    num_comm_sms: int = 0
    chunks_per_rank: int = 1
    comm_stream_priority: int = -1
    lead_fraction: float = 0.0
    lead_wgrad: bool = False
    bulk_wgrad: bool = False

    def __post_init__(self):
        self.validate()

    def with_method(self, method: str, **changes) -> "OpConfig":
        """A copy running `method` (sweeps): fields that only apply to another method fall back to 0."""
        if method != "decomposed":
            changes.setdefault("lead_fraction", 0.0)
            changes.setdefault("lead_wgrad", False)
        return dataclasses.replace(self, method=method, **changes)

    def validate(self, *, num_sms: int | None = None, file: str = "<dict>", prefix: str = "") -> None:
        key = prefix or f"ops.{self.op}"
        if self.op not in OPS:
            raise _bad(f"{key}.op", self.op, " | ".join(OPS), file)
        if self.method not in METHODS[self.op]:
            raise _bad(f"{key}.method", self.method, " | ".join(METHODS[self.op]), file)
        sm_hi = (num_sms - 1) if num_sms else 1 << 16
        _int_in(f"{key}.sm_margin", self.sm_margin, 0, sm_hi, file)
        _int_in(f"{key}.num_comm_sms", self.num_comm_sms, 0, sm_hi, file)
        _int_in(f"{key}.chunks_per_rank", self.chunks_per_rank, 1, MAX_CHUNKS_PER_RANK, file)
        _int_in(f"{key}.comm_stream_priority", self.comm_stream_priority, *STREAM_PRIORITY_RANGE, file)
        lead = self.lead_fraction
        if isinstance(lead, bool) or not isinstance(lead, (int, float)) or not 0 <= lead <= 1:
            raise _bad(f"{key}.lead_fraction", lead, "a number with 0 <= x <= 1", file)
        if lead and (self.op, self.method) != ("ag_gemm", "decomposed"):
            raise _bad(f"{key}.lead_fraction", lead, f"0 (it applies to ag_gemm with method decomposed; "
                       f"this is {self.op} with method {self.method})", file)
        if not isinstance(self.lead_wgrad, bool):
            raise _bad(f"{key}.lead_wgrad", self.lead_wgrad, "true or false", file)
        if self.lead_wgrad and (self.op, self.method) != ("ag_gemm", "decomposed"):
            raise _bad(f"{key}.lead_wgrad", self.lead_wgrad, f"false (it applies to ag_gemm with method "
                       f"decomposed; this is {self.op} with method {self.method})", file)
        if not isinstance(self.bulk_wgrad, bool):
            raise _bad(f"{key}.bulk_wgrad", self.bulk_wgrad, "true or false", file)
        if self.bulk_wgrad and self.op != "gemm_rs":
            raise _bad(f"{key}.bulk_wgrad", self.bulk_wgrad, "false (it applies to gemm_rs)", file)


@dataclass(frozen=True, kw_only=True)
class OpBucket:
    """Overrides for M <= m_max."""
    m_max: int
    config: OpConfig


@dataclass(frozen=True, kw_only=True)
class OpPreset:
    default: OpConfig
    by_m: tuple[OpBucket, ...] = ()

    def for_m(self, m: int) -> OpConfig:
        for bucket in self.by_m:
            if m <= bucket.m_max:
                return bucket.config
        return self.default


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
            raise _bad("model.name", name, " | ".join(MODELS))
        return cls(name=name, activation=activation, **MODELS[name])


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    node: NodeConfig
    ag_gemm: OpPreset
    gemm_rs: OpPreset
    model: ModelConfig | None = None
    source: str = "<dict>"

    def op_config(self, op: str, m: int) -> OpConfig:
        if op not in OPS:
            raise ConfigError(f"unknown op {op!r}; allowed: {' | '.join(OPS)}", file=self.source)
        return getattr(self, op).for_m(m)

    def check_world_size(self, world_size: int) -> None:
        """Refuse a preset written for another TP size."""
        if self.node.tp_size is not None and self.node.tp_size != world_size:
            raise _bad("node.tp_size", self.node.tp_size,
                       f"{world_size} (the group size this run uses); pick the preset for TP{world_size}",
                       self.source)


_NODE_KEYS = {"gpu_name": str, "tp_size": (int, type(None)), "num_sms": (int, type(None)), "pool_bytes": int}
_OP_KEYS = {f.name for f in dataclasses.fields(OpConfig)} - {"op"}


def _check_keys(mapping, allowed, key, file) -> None:
    if not isinstance(mapping, dict):
        raise _bad(key or "<top>", mapping, "a mapping", file)
    for k in mapping:
        if k not in allowed:
            raise ConfigError(f"unknown key {k!r}; allowed: {', '.join(sorted(allowed))}",
                              file=file, key=f"{key}.{k}" if key else str(k), value=k,
                              allowed=", ".join(sorted(allowed)))


def _parse_node(raw, file) -> NodeConfig:
    _check_keys(raw, set(_NODE_KEYS), "node", file)
    for k, typ in _NODE_KEYS.items():
        if k not in raw:
            raise ConfigError("missing key", file=file, key=f"node.{k}")
        if isinstance(raw[k], bool) or not isinstance(raw[k], typ):
            raise _bad(f"node.{k}", raw[k], "a string" if typ is str else "an int" +
                       (" or null" if isinstance(typ, tuple) else ""), file)
    if raw["tp_size"] is not None:
        _int_in("node.tp_size", raw["tp_size"], 1, 64, file)
    if raw["num_sms"] is not None:
        _int_in("node.num_sms", raw["num_sms"], 1, 1 << 16, file)
    _int_in("node.pool_bytes", raw["pool_bytes"], 1, 1 << 40, file)
    return NodeConfig(**raw)


def _parse_op(op, raw, num_sms, file) -> OpPreset:
    _check_keys(raw, _OP_KEYS | {"by_m"}, f"ops.{op}", file)
    fields = {k: v for k, v in raw.items() if k != "by_m"}
    if "method" not in fields:
        raise ConfigError("missing key", file=file, key=f"ops.{op}.method")
    default = _make_op(op, fields, num_sms, file, f"ops.{op}")
    buckets, last = [], 0
    by_m = raw.get("by_m", [])
    if not isinstance(by_m, list):
        raise _bad(f"ops.{op}.by_m", by_m, "a list of mappings with m_max", file)
    for i, item in enumerate(by_m):
        key = f"ops.{op}.by_m[{i}]"
        _check_keys(item, _OP_KEYS | {"m_max"}, key, file)
        if "m_max" not in item:
            raise ConfigError("missing key", file=file, key=f"{key}.m_max")
        _int_in(f"{key}.m_max", item["m_max"], last + 1, 1 << 40, file)
        last = item["m_max"]
        merged = {**fields, **{k: v for k, v in item.items() if k != "m_max"}}
        for only_decomposed in ("lead_fraction", "lead_wgrad"):
            if merged.get("method") != "decomposed" and only_decomposed not in item:
                merged.pop(only_decomposed, None)  # a bucket that switches method drops decomposed-only fields
        buckets.append(OpBucket(m_max=item["m_max"], config=_make_op(op, merged, num_sms, file, key)))
    return OpPreset(default=default, by_m=tuple(buckets))


def _make_op(op, fields, num_sms, file, key) -> OpConfig:
    # Validate field by field with the file and key before the dataclass sees the values.
    probe = OpConfig.__new__(OpConfig)
    for name, value in {**{f.name: f.default for f in dataclasses.fields(OpConfig)}, **fields, "op": op}.items():
        object.__setattr__(probe, name, value)
    probe.validate(num_sms=num_sms, file=file, prefix=key)
    return OpConfig(op=op, **fields)


def _parse_model(raw, file) -> ModelConfig:
    _check_keys(raw, {"name", "hidden", "ffn_hidden", "activation"}, "model", file)
    if "name" not in raw or not isinstance(raw["name"], str):
        raise _bad("model.name", raw.get("name"), "a string (a MODELS name, or any name with hidden and "
                   "ffn_hidden given)", file)
    fields = dict(MODELS.get(raw["name"], {}))
    fields.update({k: v for k, v in raw.items() if k != "name"})
    if "hidden" not in fields or "ffn_hidden" not in fields:
        raise _bad("model.name", raw["name"], f"one of {', '.join(MODELS)} or give hidden and ffn_hidden", file)
    try:
        return ModelConfig(name=raw["name"], **fields)
    except ConfigError as exc:
        raise ConfigError(exc.detail, file=file, key=exc.key, value=exc.value,
                          allowed=exc.allowed) from None


def parse_config(raw, *, file: str = "<dict>") -> OverlapConfig:
    _check_keys(raw, {"node", "ops", "model"}, "", file)
    if "node" not in raw or "ops" not in raw:
        raise ConfigError("a preset needs the sections 'node' and 'ops'", file=file)
    node = _parse_node(raw["node"], file)
    _check_keys(raw["ops"], set(OPS), "ops", file)
    missing = [op for op in OPS if op not in raw["ops"]]
    if missing:
        raise ConfigError(f"missing op sections {missing}", file=file, key="ops")
    ops = {op: _parse_op(op, raw["ops"][op], node.num_sms, file) for op in OPS}
    model = _parse_model(raw["model"], file) if raw.get("model") is not None else None
    return OverlapConfig(node=node, model=model, source=file, **ops)


def load_config(path: str | Path) -> OverlapConfig:
    """Parse and validate one YAML preset."""
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError("no such file", file=str(path)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", file=str(path)) from None
    return parse_config(raw, file=str(path))


def gpu_slug(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100', 'cpu' -> 'cpu'."""
    name = device_name.lower().replace("nvidia", " ")
    match = re.search(r"\b([a-z]+\d+[a-z]*)\b", name)
    return match.group(1) if match else re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "unknown"


def preset_path(device_name: str, world_size: int) -> Path:
    """The preset for (device, TP size): exact file, else cuda_default.yaml (GPU) or cpu.yaml."""
    base = resources.files("configs")
    slug = gpu_slug(device_name)
    if slug == "cpu":
        return Path(str(base / "cpu.yaml"))
    exact = base / f"{slug}_tp{world_size}.yaml"
    if exact.is_file():
        return Path(str(exact))
    return Path(str(base / "cuda_default.yaml"))


def load_preset(device_name: str, world_size: int) -> OverlapConfig:
    cfg = load_config(preset_path(device_name, world_size))
    cfg.check_world_size(world_size)
    return cfg


def _op_dict(cfg: OpConfig, base: OpConfig | None = None) -> dict:
    out = {}
    for f in dataclasses.fields(OpConfig):
        if f.name == "op":
            continue
        value = getattr(cfg, f.name)
        if base is None or getattr(base, f.name) != value:
            out[f.name] = value
    return out


def to_dict(cfg: OverlapConfig) -> dict:
    ops = {}
    for op in OPS:
        preset: OpPreset = getattr(cfg, op)
        entry = _op_dict(preset.default)
        if preset.by_m:
            entry["by_m"] = [{"m_max": b.m_max, **_op_dict(b.config, preset.default)} for b in preset.by_m]
        ops[op] = entry
    out = {"node": dataclasses.asdict(cfg.node), "ops": ops}
    if cfg.model is not None:
        out["model"] = dataclasses.asdict(cfg.model)
    return out


def dump_config(cfg: OverlapConfig, path: str | Path, *, header: str = "") -> None:
    """Write `cfg` as a YAML preset that `load_config` accepts."""
    import yaml

    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    Path(path).write_text(comment + text)
