"""Choosing from sweeps, pure functions unit-tested on CPU: from a k-factor sweep the best config per op and
M bucket, the tuned preset and the k gate; for the GEMM block tuner (launch.gemm_tune) its plan -- which
candidates each shape class tries (and every bf16 and FP8 candidate), in which order the points are
measured, what a point costs -- and the block table it writes (`write_table`, also launch.gemm_bench --fp8's)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from tp_overlap.config.schema import OpPreset, OverlapConfig

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


# --- The GEMM block tuner's plan ---------------------------------------------------------------------------

# M values in the order the tuner measures them: the two ends first (wave quantisation at 1024, throughput
# at 16384), then the middle, then the rest. The table answers an unmeasured M with the entry nearest in
# log2(M) (overlap/gemm/blocks.py), so a run cut short after the first passes still covers every M.
M_ORDER = (1024, 16384, 4096, 2048, 8192)

# Candidates per shape class (Hopper: TMA descriptors; 128x256x64 tiles with 8 warps or two consumer
# warpgroups of warp specialisation (4 warps + `ws`: Triton splits only 4-warp kernels); 3-4 stages within
# 227 KB; `es2` halves the epilogue's staging to afford a 4th stage; `fl` flattens the tile and K loops
# so that the next tile's loads overlap this tile's epilogue (short K); `o2` two CTAs per SM hide each
# other's epilogue; `sk` stream-K splits the last partial wave by K steps (few tiles: 48-96 tiles on 132
# SMs)). Every name compiles without spills for sm_90 with Triton 3.6 and 3.7 in both layouts.
# The Gluon kernel (kernels/gemm_gluon.py: host descriptors, a TMA warp and a consumer warpgroup per 64 rows), tried
# in every class: 128x64 tiles give narrow shapes twice the tiles of 128x128 ones; `sk1` cuts a partial last
# wave's tiles by K (overlap/gemm/gluon_launch.py split_plan; a no-op where the waves are full); 192-row tiles
# (three consumer warpgroups) make 132 tiles of 4096x768 and 2048x1536 (one full wave).
GLUON_CANDIDATES = ("128x256x64w4s3gl", "128x128x64w4s4gl", "128x128x64w4s6gl", "128x64x64w4s8gl",
                    "128x256x64w4s3sk1gl", "128x128x64w4s6sk1gl", "128x64x64w4s8sk1gl", "192x128x64w4s4gl",
                    "192x128x64w4s4sk1gl")
# Tiles of widths that are not powers of two, or 64 rows (kernels/gemm_gluon_boxes.py: B in two boxes): at the
# few-tile shapes they give about one full wave where power-of-two tiles leave SMs idle or run too small (128
# tiles of 1024x768 at 64x96, of 1024x1536 at 64x192 or 128x96, of 2048x1280 at 128x160). Deep rings pay
# there: 64x128 tiles of 1024x768x4096 took 21.6 / 18.1 / 17.2 us with 5 / 7 / 8 stages (cuBLAS: 10).
GLUON_BOX_CANDIDATES = ("64x96x64w4s8gl", "64x96x64w4s10gl", "64x128x64w4s7gl", "64x128x64w4s8gl", "64x160x64w4s7gl",
                        "64x192x64w4s6gl", "128x96x64w4s7gl", "128x160x64w4s4gl", "128x160x64w4s5gl",
                        "128x192x64w4s4gl")
GEMM_CLASSES = {
    # fewer 128x256 tiles than SMs: the last (only) wave is partial
    "few_tiles": ("128x128x64w8s4", "128x128x64w4s4", "64x128x64w4s4o2", "128x128x64w8s4sk1", "128x256x64w8s3sk1",
                  "64x128x64w4s4sk1", "128x256x64w8s3", "128x128x64w4s3es2o2") + GLUON_CANDIDATES + GLUON_BOX_CANDIDATES,
    # K <= 2048: the epilogue is a large share of each tile's time
    "short_k": ("128x256x64w8s3", "128x256x64w8s3fl", "128x256x64w4s3ws", "128x256x64w8s4es2", "128x128x64w8s4fl",
                "128x128x64w4s3es2o2", "128x256x64w8s3sk1") + GLUON_CANDIDATES,
    # many tiles, long K: throughput
    "large": ("128x256x64w8s3", "128x256x64w8s3g16", "128x256x64w4s3ws", "256x128x64w8s3", "128x256x64w8s4es2",
              "128x256x64w8s3fl") + GLUON_CANDIDATES,
}
SHORT_K = 2048
# Split-K (kernels/gemm_splitk.py, `sp<S>`): each tile's K over S units, which the hardware schedules two or
# three to an SM (96 KB / 64 KB of shared memory each), so 48-400 output tiles still fill 132 SMs evenly.
# Tried besides the class's list where 128x128 tiles fill at most SPLIT_K_WAVES waves and K is long
# enough to split: the narrow-N shapes (qkv at TP 4/8, N 768-2560) at M <= 4096, whatever their class.
SPLIT_K_CANDIDATES = tuple(f"{tile}sp{splits}" for tile in ("128x128x64w4s3", "128x64x64w4s4", "64x64x64w4s4")
                           for splits in (2, 4, 8))
SPLIT_K_WAVES = 3
SPLIT_K_MIN_K = 1024
# Stream-K (`sk1`) besides a many-tile class's list where 128x256 tiles fill one to three waves and the last
# is partial (llama70b.qkv at TP 8, M 4096: 160 tiles = one wave and 28 tiles, which plain tiles pay as two
# waves): the last wave's tiles are split by K steps over every SM. The rule counts 128x256 tiles for both
# candidates (128x128 ones have twice as many, so their last wave is partial there too unless it is full).
STREAM_K_CANDIDATES = ("128x256x64w8s3sk1", "128x128x64w8s4sk1")
STREAM_K_WAVES = 3
# Every bf16 candidate: the union of the classes' lists and the split-K and stream-K ones (what
# launch.compile_check --candidates compiles).
GEMM_CANDIDATES = tuple(dict.fromkeys(name for names in (*GEMM_CLASSES.values(), SPLIT_K_CANDIDATES,
                                                         STREAM_K_CANDIDATES) for name in names))
# The FP8 GEMM's (kernels/gemm_fp8.py; BLOCK_K is the scale group), timed by launch.gemm_bench --fp8.
# 128x128 tiles with 8 warps hold the accumulator and one fresh product per thread (162 registers); 128x256
# spills. Two CTAs per SM (`o2`, 64x128 or 128x64 tiles, 4 warps) let one CTA scale its product into the
# accumulator while the other's MMAs run: within one CTA Triton waits for each MMA before the scaling.
FP8_CANDIDATES = (
    "128x128x128w8s4", "128x128x128w8s4g16", "128x128x128w8s3", "64x128x128w4s4o2", "64x128x128w4s3o2",
    "64x128x128w4s4g16o2", "128x64x128w4s4o2",
    # the Gluon kernel (kernels/gemm_fp8_gluon.py: TMA, waiter and scaler warps, two consumer warpgroups)
    "128x128x128w4s4gl", "128x128x128w4s5gl", "128x64x128w4s5gl",
    # 256 wide: two 128-column sub-tiles a K group, a fourth less L2 traffic per product; whole tiles only
    "128x256x128w4s3gl",
    # warp-specialised FP8 ("...w4s4ws") is left out: compiled for the H200 by Triton 3.6 it gave wrong tiles
    # (relative error 0.28-0.77 and NaN against the dequantised product, results/gemm_fp8_h200.json)
)
_SECONDS_PER_CALL = 7e-4     # L2 flush, device hold (300 us), synchronisation and launch around one timed call
_SECONDS_PER_POINT = 0.15    # operands, the cuBLAS reference, one checked call per candidate
_ASSUMED_FLOPS = 600e12      # a pessimistic bf16 rate for the estimate


def _tiles(m: int, n: int, block_n: int) -> int:
    """Output tiles of out[m, n] with BLOCK_M 128."""
    return -(-m // 128) * -(-n // block_n)


def shape_class(m: int, n: int, k: int, sms: int) -> str:
    """The candidate class of out[m, n] = a[m, k] @ b[k, n] on `sms` SMs (GEMM_CLASSES)."""
    if _tiles(m, n, 256) < sms:
        return "few_tiles"
    return "short_k" if k <= SHORT_K else "large"


def splits_k(m: int, n: int, k: int, sms: int) -> bool:
    """Whether the split-K candidates are tried for out[m, n] = a[m, k] @ b[k, n] on `sms` SMs."""
    return _tiles(m, n, 128) <= SPLIT_K_WAVES * sms and k >= SPLIT_K_MIN_K


def streams_k(m: int, n: int, k: int, sms: int) -> bool:
    """Whether the stream-K candidates are tried for out[m, n] = a[m, k] @ b[k, n] on `sms` SMs: 128x256
    tiles fill between one and STREAM_K_WAVES waves, the last one partial."""
    tiles = _tiles(m, n, 256)
    return sms < tiles <= STREAM_K_WAVES * sms and tiles % sms != 0


def gemm_candidates(m: int, n: int, k: int, sms: int, extra=()) -> tuple[str, ...]:
    """The class's candidates, the split-K ones where they fit (`splits_k`), the stream-K ones where they fit
    (`streams_k`), then `extra` (e.g. the current table's choice), without repeats."""
    split = SPLIT_K_CANDIDATES if splits_k(m, n, k, sms) else ()
    stream = STREAM_K_CANDIDATES if streams_k(m, n, k, sms) else ()
    return tuple(dict.fromkeys(GEMM_CLASSES[shape_class(m, n, k, sms)] + split + stream + tuple(extra)))


def tune_order(points, ms_order=M_ORDER):
    """`points` (tuples whose first three items are m, n, k) in measuring order: by M's rank in `ms_order`
    (M values not in it last, ascending), then by n * k, stable otherwise."""
    rank = {m: i for i, m in enumerate(ms_order)}
    return sorted(points, key=lambda p: (rank.get(p[0], len(rank)), 0 if p[0] in rank else p[0], p[1] * p[2]))


def point_seconds(m: int, n: int, k: int, variants: int, reps: int, warmup: int = 2) -> float:
    """Estimated wall time of one tuning point: `variants` timed (reps + warmup) times each."""
    return _SECONDS_PER_POINT + variants * (reps + warmup) * (2 * m * n * k / _ASSUMED_FLOPS + _SECONDS_PER_CALL)


def write_table(path: str | Path, entries: dict, *, gpu: str, num_sms_: int, source: dict,
                operand_bytes: int = 2) -> None:
    """The YAML table (format: overlap/gemm/blocks.py), one flow-style entry per line, sorted."""
    import yaml

    kind = "FP8 GEMM (kernels/gemm_fp8.py; `gl` blocks: kernels/gemm_fp8_gluon.py)" if operand_bytes == 1 \
        else "GEMM (kernels/gemm.py; `gl` blocks: kernels/gemm_gluon.py, or gemm_gluon_boxes.py for two B boxes)"
    lines = [f"# Block table of the persistent Triton {kind} on {gpu} (format and fallback:",
             "# overlap/gemm/blocks.py). vs_cublas = reference time / Triton time, device time.",
             f"gpu: {gpu}", f"num_sms: {num_sms_}"]
    if operand_bytes != 2:
        lines.append(f"operand_bytes: {operand_bytes}")
    lines += ["source: " + yaml.safe_dump(source, default_flow_style=True, width=1 << 20).strip(), "entries:"]
    for key in sorted(entries, key=lambda k: (k[0], k[2], k[3], k[1])):
        e = entries[key]
        ratios = "".join(f", {name}: {value:.4g}" for name, value in (("vs_cublas", e.vs_cublas),
                                                                       ("plain_vs_cublas", e.plain_vs_cublas))
                         if value is not None)
        lines.append(f"  - {{layout: {e.layout}, m: {e.m}, n: {e.n}, k: {e.k}, blocks: {e.blocks.name}, "
                     f"plain: {e.plain.name}{ratios}}}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
