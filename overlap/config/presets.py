"""The one YAML loader of the runtime: presets (configs/*.yaml) -> OverlapConfig, and back.

Every error names the file, the key, the bad value and what is allowed (`ConfigError`).
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

from ..gemm.blocks import gpu_slug   # the tables' and the presets' GPU names: one rule
from .offload import parse_offload_section
from .schema import (MODELS, OP_CLASSES, OPS, ROLES, ConfigError, ModelConfig, NodeConfig, OpPreset, OverlapConfig,
                     RoleConfig, _bad, _int_in)

__all__ = ["load_config", "parse_config", "to_dict", "preset_path", "load_preset", "dump_config", "gpu_slug",
           "migrate"]

_NODE_KEYS = {"gpu_name": str, "tp_size": (int, type(None)), "num_sms": (int, type(None)), "pool_bytes": int}
_OP_KEYS = {op: {f.name for f in dataclasses.fields(cls)} for op, cls in OP_CLASSES.items()}
_ROLE_KEYS = {f.name for f in dataclasses.fields(RoleConfig)}
FP8_RS_METHODS = ("decomposed", "pair")   # GemmRs(fp8=True): the FP8 GEMM per owner chunk (overlap/ops/gemm_rs.py)


def _check_keys(mapping, allowed, key, file) -> None:
    if not isinstance(mapping, dict):
        raise _bad(key or "<top>", mapping, "a mapping", file)
    for k in mapping:
        if k not in allowed:
            raise ConfigError(f"unknown key {k!r}; allowed: {', '.join(sorted(allowed))}", file=file,
                              key=f"{key}.{k}" if key else str(k), value=k, allowed=", ".join(sorted(allowed)))


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


def _make(cls, fields, key, file, validate):
    # validate field by field with the file and key before the dataclass sees the values
    probe = cls.__new__(cls)
    for name, value in {**{f.name: f.default for f in dataclasses.fields(cls)}, **fields}.items():
        object.__setattr__(probe, name, value)
    if hasattr(probe, "fill_defaults"):  # a default that follows the method (GemmRsConfig.num_comm_sms)
        probe.fill_defaults()
    validate(probe, key)
    return cls(**fields)


def _parse_buckets(raw, key, allowed, file, make) -> OpPreset:
    _check_keys(raw, allowed | {"by_m"}, key, file)
    fields = {k: v for k, v in raw.items() if k != "by_m"}
    default = make(fields, key)
    by_m, last = [], 0
    buckets = raw.get("by_m", [])
    if not isinstance(buckets, list):
        raise _bad(f"{key}.by_m", buckets, "a list of mappings with m_max", file)
    for i, item in enumerate(buckets):
        item_key = f"{key}.by_m[{i}]"
        _check_keys(item, allowed | {"m_max"}, item_key, file)
        if "m_max" not in item:
            raise ConfigError("missing key", file=file, key=f"{item_key}.m_max")
        _int_in(f"{item_key}.m_max", item["m_max"], last + 1, 1 << 40, file)
        last = item["m_max"]
        merged = {**fields, **{k: v for k, v in item.items() if k != "m_max"}}
        if merged.get("method", "decomposed") != "decomposed" and "lead_fraction" not in item:
            merged.pop("lead_fraction", None)  # a bucket that switches method drops decomposed-only fields
        by_m.append((item["m_max"], make(merged, item_key)))
    return OpPreset(default=default, by_m=tuple(by_m))


def _parse_op(op, raw, num_sms, file) -> OpPreset:
    cls = OP_CLASSES[op]

    def make(fields, key):
        if "method" not in fields:
            raise ConfigError("missing key", file=file, key=f"{key}.method")
        return _make(cls, fields, key, file, lambda probe, k: probe.validate(num_sms=num_sms, file=file, key=k))
    return _parse_buckets(raw, f"ops.{op}", _OP_KEYS[op], file, make)


def _parse_role(role, raw, file) -> OpPreset:
    return _parse_buckets(raw, f"roles.{role}", _ROLE_KEYS, file,
                          lambda fields, key: _make(RoleConfig, fields, key, file,
                                                    lambda probe, k: probe.validate(role, file)))


def migrate(raw: dict) -> dict:
    """Rewrite a preset of the earlier layout (one OpConfig class for both ops, role settings inside the
    ops) into the current one; a current preset comes back unchanged. The rules:

    * ops.ag_gemm.lead_wgrad (and its by_m overrides) -> roles.fc2_dgrad.lead_wgrad;
    * ops.gemm_rs.bulk_wgrad -> roles.fc1_dgrad.bulk_wgrad;
    * ops.ag_gemm.num_comm_sms and ops.gemm_rs.chunks_per_rank are dropped (never read by those ops);
    * gemm_rs `decomposed` with num_comm_sms 0 ran the W = 2 pair schedule at TP2 (it is `pair` now) and
      otherwise its reduction on max(sm_margin, 8) programs (now written as num_comm_sms);
    * gemm_rs `epilogue_reduce` with num_comm_sms > 0: the field was ignored, it becomes 0;
    * a gemm_rs section without num_comm_sms takes its method's default (`GemmRsConfig`: 0 for
      epilogue_reduce and pair, 16 otherwise), as any current preset does.
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("ops"), dict):
        return raw
    raw = {**raw, "ops": {k: dict(v) if isinstance(v, dict) else v for k, v in raw["ops"].items()}}
    roles = {k: dict(v) for k, v in (raw.get("roles") or {}).items()}
    tp_size = (raw.get("node") or {}).get("tp_size")
    for op, field_name, role in (("ag_gemm", "lead_wgrad", "fc2_dgrad"), ("gemm_rs", "bulk_wgrad", "fc1_dgrad")):
        section = raw["ops"].get(op)
        if not isinstance(section, dict):
            continue
        if field_name in section:
            roles.setdefault(role, {})[field_name] = section.pop(field_name)
        for item in section.get("by_m", []) or []:
            if isinstance(item, dict) and field_name in item:
                roles.setdefault(role, {}).setdefault("by_m", []).append(
                    {"m_max": item.get("m_max"), field_name: item.pop(field_name)})
    ag = raw["ops"].get("ag_gemm")
    for section in [ag] + (ag.get("by_m", []) if isinstance(ag, dict) else []):
        if isinstance(section, dict):
            section.pop("num_comm_sms", None)
    rs = raw["ops"].get("gemm_rs")
    for section in [rs] + (rs.get("by_m", []) if isinstance(rs, dict) else []):
        if not isinstance(section, dict):
            continue
        section.pop("chunks_per_rank", None)
        method = section.get("method", rs.get("method") if isinstance(rs, dict) else None)
        if method == "decomposed" and section.get("num_comm_sms", 0) == 0 and "num_comm_sms" in section:
            if tp_size == 2:
                section["method"] = "pair"
            else:
                section["num_comm_sms"] = max(section.get("sm_margin", 0), 8)
        if method == "epilogue_reduce" and section.get("num_comm_sms"):
            section["num_comm_sms"] = 0
    if roles:
        raw["roles"] = roles
    return raw


def parse_config(raw, *, file: str = "<config>") -> OverlapConfig:
    raw = migrate(raw)
    _check_keys(raw, {"node", "ops", "roles", "model", "offload", "fp8"}, "", file)
    if "node" not in raw or "ops" not in raw:
        raise ConfigError("a preset needs the sections 'node' and 'ops'", file=file)
    node = _parse_node(raw["node"], file)
    _check_keys(raw["ops"], set(OPS), "ops", file)
    missing = [op for op in OPS if op not in raw["ops"]]
    if missing:
        raise ConfigError(f"missing op sections {missing}", file=file, key="ops")
    ops = {op: _parse_op(op, raw["ops"][op], node.num_sms, file) for op in OPS}
    roles_raw = raw.get("roles") or {}
    _check_keys(roles_raw, set(ROLES), "roles", file)
    roles = {role: _parse_role(role, value, file) for role, value in roles_raw.items()}
    model = _parse_model(raw["model"], file) if raw.get("model") is not None else None
    offload = None
    if raw.get("offload") is not None:
        offload = parse_offload_section(raw["offload"], file=file)
    fp8 = raw.get("fp8", False)
    if not isinstance(fp8, bool):
        raise ConfigError(f"got {fp8!r}; allowed: true | false", file=file, key="fp8")
    if fp8:
        rs = ops["gemm_rs"]
        bad = sorted({c.method for c in (rs.default, *(c for _, c in rs.by_m))} - set(FP8_RS_METHODS))
        if bad:
            raise ConfigError(f"true needs ops.gemm_rs.method in {' | '.join(FP8_RS_METHODS)} (the FP8 GEMM "
                              f"runs per owner chunk); got {', '.join(bad)}", file=file, key="fp8")
    return OverlapConfig(node=node, roles=roles, model=model, offload=offload, fp8=fp8, source=file, **ops)


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
        raise ConfigError(exc.detail, file=file, key=exc.key, value=exc.value, allowed=exc.allowed) from None


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


def preset_path(device_name: str, world_size: int) -> Path:
    """The preset for (device, TP size): exact file, else cuda_default.yaml (GPU) or cpu.yaml."""
    base = resources.files("tp_overlap.configs")
    slug = gpu_slug(device_name)
    if slug == "cpu":
        return Path(str(base / "cpu.yaml"))
    exact = base / f"{slug}_tp{world_size}.yaml"
    return Path(str(exact)) if exact.is_file() else Path(str(base / "cuda_default.yaml"))


def load_preset(device_name: str, world_size: int) -> OverlapConfig:
    cfg = load_config(preset_path(device_name, world_size))
    cfg.check_world_size(world_size)
    return cfg


def _fields_dict(value, base=None) -> dict:
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
            if base is None or getattr(base, f.name) != getattr(value, f.name)}


def _preset_dict(preset: OpPreset) -> dict:
    entry = _fields_dict(preset.default)
    if preset.by_m:
        entry["by_m"] = [{"m_max": m_max, **_fields_dict(v, preset.default)} for m_max, v in preset.by_m]
    return entry


def to_dict(cfg: OverlapConfig) -> dict:
    out = {"node": dataclasses.asdict(cfg.node), "ops": {op: _preset_dict(getattr(cfg, op)) for op in OPS}}
    if cfg.roles:
        out["roles"] = {role: _preset_dict(p) for role, p in cfg.roles.items()}
    if cfg.model is not None:
        out["model"] = dataclasses.asdict(cfg.model)
    if cfg.offload is not None and hasattr(cfg.offload, "as_dict"):
        out["offload"] = cfg.offload.as_dict()
    if cfg.fp8:
        out["fp8"] = True
    return out


def dump_config(cfg: OverlapConfig, path: str | Path, *, header: str = "") -> None:
    """Write `cfg` as a YAML preset that `load_config` accepts."""
    import yaml

    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    Path(path).write_text(comment + text)
