"""Choosing from a k-factor sweep: the best config per op and M bucket, the tuned preset, the k gate.
Pure functions over the sweep's rows (unit-tested on CPU)."""

from __future__ import annotations

import dataclasses
import math

from overlap.config import OpPreset, OverlapConfig

__all__ = ["CONFIG_KEYS", "OP_KEYS", "best_configs", "config_row", "tuned_config", "gate_failures"]

CONFIG_KEYS = ("method", "sm_margin", "chunks_per_rank", "num_comm_sms", "lead_fraction")
OP_KEYS = {"ag_gemm": ("method", "sm_margin", "chunks_per_rank", "lead_fraction"),
           "gemm_rs": ("method", "sm_margin", "num_comm_sms")}


def config_row(cfg) -> dict:
    """The sweep columns of a config (a field the op does not have is None)."""
    return {key: getattr(cfg, key, None) for key in CONFIG_KEYS}


def _config_of(row) -> tuple:
    # rows written before lead_fraction existed ran without a lead
    return tuple(row.get(key, 0.0) if key == "lead_fraction" else row.get(key) for key in OP_KEYS[row["op"]])


def best_configs(rows: list[dict]) -> dict[str, list[tuple[int, dict]]]:
    """Per op, per M (increasing): the config with the lowest geometric mean over the layers at that M of
    t_op / (fastest t_op of that layer) -- ties go to the first measured."""
    out: dict[str, list] = {}
    for op in ("ag_gemm", "gemm_rs"):
        op_rows = [r for r in rows if r["op"] == op and r.get("t_op_ms")]
        for m in sorted({r["M"] for r in op_rows}):
            at_m = [r for r in op_rows if r["M"] == m]
            fastest = {}
            for r in at_m:
                key = (r["layer"], r["K"], r["N"])
                fastest[key] = min(fastest.get(key, math.inf), r["t_op_ms"])
            scores: dict[tuple, list] = {}
            for r in at_m:
                ratio = r["t_op_ms"] / fastest[(r["layer"], r["K"], r["N"])]
                scores.setdefault(_config_of(r), []).append(math.log(ratio))
            best = min(scores, key=lambda c: sum(scores[c]) / len(scores[c]))
            out.setdefault(op, []).append((m, dict(zip(OP_KEYS[op], best))))
    return out


def tuned_config(base: OverlapConfig, best: dict, *, device_name: str, world: int,
                 num_sms: int | None) -> OverlapConfig:
    """`base` with by_m buckets per swept op: bucket m_max = each measured M but the largest, whose
    choice becomes the default; consecutive equal choices merge, buckets equal to the default go."""
    presets = {}
    for op, choices in best.items():
        seed = getattr(base, op).default
        cfgs = [(m, seed.with_method(fields.get("method", seed.method),
                                     **{k: v for k, v in fields.items() if k != "method"}))
                for m, fields in choices]
        default, buckets = cfgs[-1][1], []
        for m, cfg in cfgs[:-1]:
            if buckets and buckets[-1][1] == cfg:
                buckets[-1] = (m, cfg)
            else:
                buckets.append((m, cfg))
        if buckets and buckets[-1][1] == default:
            buckets.pop()
        presets[op] = OpPreset(default=default, by_m=tuple(buckets))
    node = dataclasses.replace(base.node, gpu_name=device_name, tp_size=world,
                               num_sms=num_sms if num_sms else base.node.num_sms)
    return dataclasses.replace(base, node=node, **presets)


def gate_failures(rows: list[dict], max_k: float, best: dict | None = None) -> list[str]:
    """Messages for op rows whose k_comm or k_comp exceeds max_k (or is not finite)."""
    chosen = {(op, m): tuple(f.values()) for op, items in (best or {}).items() for m, f in items}
    out = []
    for r in rows:
        if r["op"] not in ("ag_gemm", "gemm_rs"):
            continue
        if best is not None and chosen.get((r["op"], r["M"])) != _config_of(r):
            continue
        bad = [f"{name}={r[name]:.3f}" for name in ("k_comm", "k_comp")
               if not math.isfinite(r[name]) or r[name] > max_k]
        if bad:
            fields = ", ".join(f"{k}={r.get(k)}" for k in OP_KEYS[r["op"]])
            out.append(f"{r['op']} {r['layer']} M={r['M']} K={r['K']} N={r['N']} ({fields}): {', '.join(bad)} "
                       f"> max_k {max_k}")
    return out
