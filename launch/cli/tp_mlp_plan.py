"""`tp_overlap.launch.tp_mlp`'s arguments checked against the placement, before any process group, pool or GPU allocation:
every error is one UsageError / ConfigError line that says what is wrong and what to give instead, the same
on every rank (they all see the same arguments and placement)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import torch

from tp_overlap.config.schema import MODELS, OPS, ModelConfig
from tp_overlap.ops.layers import BASELINES, pool_requirements
from tp_overlap.ops.validate import OpInputError, check_method_runs, triton_interpreted
from tp_overlap.config.presets import FP8_RS_METHODS, load_config, load_preset

from .common import UsageError, distinct, require
from .limits import require_fits

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GPU_TOKENS, CPU_TOKENS = (16384,), (256,)
FFN_STEP = 64   # a suggested ffn_hidden is a multiple of 64 x W: whole 64-column blocks on every rank


def _models(args, cfg, cuda: bool) -> list[ModelConfig]:
    if args.model:
        names = args.model.split(",")
        unknown = [n for n in names if n not in MODELS]
        require(not unknown, f"--model: unknown model {', '.join(map(repr, unknown))}; known: {', '.join(MODELS)}")
        distinct("--model", names, "model")
        models = [ModelConfig.named(name) for name in names]
    elif cfg.model is not None:
        models = [cfg.model]
    else:
        models = [ModelConfig.named("llama8b" if cuda else "tiny")]
    if args.activation:
        models = [dataclasses.replace(m, activation=args.activation) for m in models]
    return models


def _shown(path: str) -> str:
    """A preset's path as a user would type it: relative to the checkout for the package's own presets."""
    root = Path(__file__).resolve().parents[2]  # the checkout (launch/cli/ is two levels down)
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return path


def _check_model_fits(model: ModelConfig, world: int, preset: str) -> None:
    if model.ffn_hidden % world == 0:
        return
    fits = [name for name, dims in MODELS.items() if dims["ffn_hidden"] % world == 0]
    ffn = math.ceil(model.ffn_hidden / (FFN_STEP * world)) * FFN_STEP * world
    choice = f"--model {','.join(fits)} fits; or give" if fits else "no built-in model fits; give"
    raise UsageError(f"{model.name}: ffn_hidden={model.ffn_hidden} is not divisible by the TP size {world} (each rank "
                     f"holds ffn_hidden/{world} columns); {choice} a model of your own in a preset's model section: "
                     f"copy {_shown(preset)}, add `model: {{name: mine, hidden: {model.hidden}, "
                     f"ffn_hidden: {ffn}}}` and pass it with --config")


def _check_tokens(args, tokens, world: int) -> None:
    bad = [m for m in tokens if m % world]
    if not bad:
        return
    example = ",".join(str(math.ceil(m / world) * world) for m in tokens)
    given = f"--tokens={bad[0]}" if args.tokens else f"the default M={bad[0]}"
    raise UsageError(f"{given} is not divisible by the TP size {world} (each rank holds M/{world} rows); give "
                     f"multiples of {world}, e.g. --tokens {example}")


def _check_memory(args, models, tokens, baselines, cfg, where) -> None:
    """Lower bound per rank: the one pool (every point's regions) plus, for the largest point, each variant's
    weight shards and their gradients, one gathered input [M, H] and one fc1 output [M, fc1 columns]."""
    dtype, world = DTYPES[args.dtype], where.world_size
    size = dtype.itemsize
    pool = sum(pool_requirements(hidden=mo.hidden, max_m=m, world_size=world, dtype=dtype, fp8=fp8,
                                 chunks_per_rank=cfg.op_config("ag_gemm", m).chunks_per_rank).size_bytes
               for mo in models for m in tokens for fp8 in ([False, True] if args.fp8 else [False]))
    variants = 1 + args.fp8 + len(baselines)
    largest = 0
    for mo in models:
        fc1 = (2 if mo.activation == "swiglu" else 1) * mo.ffn_hidden // world
        weights = (mo.hidden * fc1 + mo.ffn_hidden // world * mo.hidden) * size
        largest = max(largest, max(variants * 2 * weights + m * (mo.hidden + fc1) * size for m in tokens))
    names = ",".join(mo.name for mo in models)
    require_fits(f"--model {names} --tokens {','.join(map(str, tokens))}", pool + largest, where,
                 "give a smaller --tokens (or --model)")


def _check_preset_runs(args, cfg, tokens, where) -> None:
    """The ops' construction checks, before any group or pool: every config a call of each M can reach (the
    layers are built with max_m = M) must run on this device, and with --fp8 be a method the FP8 ops run."""
    for m in tokens:
        for config in cfg.gemm_rs.reachable(m, where.world_size) if args.fp8 else ():
            require(config.method in FP8_RS_METHODS,
                    f"--fp8: the preset's gemm_rs method for some M <= {m} is {config.method}; FP8 needs "
                    f"{' or '.join(FP8_RS_METHODS)} (set ops.gemm_rs.method, or a by_m bucket, in a --config YAML)")
        for op in OPS:
            for config in getattr(cfg, op).reachable(m, where.world_size):
                try:
                    check_method_runs(f"ops.{op} at M={m}", config, where.device)
                except OpInputError as exc:
                    cpu = where.device.type != "cuda" and args.config
                    raise UsageError(f"{'--config ' + _shown(cfg.source) if args.config else 'the preset'} cannot "
                                     f"run here: {exc}" + ("; or leave --config out: on CPU the default preset is "
                                                           "configs/cpu.yaml" if cpu else "")) from None


def _check_fp8_runs(args, where) -> None:
    if args.fp8 and where.device.type != "cuda" and not triton_interpreted():
        raise UsageError("--fp8 on CPU runs the FP8 kernels (Triton) under the Triton interpreter: put "
                         "TRITON_INTERPRET=1 in the environment (TRITON_INTERPRET=1 python -m tp_overlap.launch."
                         "tp_mlp --fp8 ...), or leave --fp8 out")


def _baselines(args, cuda: bool) -> list[str]:
    default = ["nccl", "torch_symm"] if cuda and not args.cuda_graphs else ["nccl"]
    baselines = args.baselines.split(",") if args.baselines else default
    unknown = [b for b in baselines if b not in BASELINES]
    require(not unknown, f"--baselines: unknown {', '.join(map(repr, unknown))}; allowed: {', '.join(BASELINES)}")
    distinct("--baselines", baselines, "baseline")
    require(cuda or "torch_symm" not in baselines, "--baselines torch_symm needs CUDA devices")
    if "nccl" not in baselines:
        baselines.insert(0, "nccl")  # the numerics check and the speedup are against it
    return baselines


def plan(args, where) -> SimpleNamespace:
    """Everything a run needs that the arguments and the placement decide (a `_dist.Placement`)."""
    cuda = where.device.type == "cuda"
    require(args.steps > 0, f"--steps must be > 0, got {args.steps}")
    require(args.warmup is None or args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}")
    bad = [m for m in args.tokens or () if m <= 0]
    require(not bad, f"--tokens must be > 0, got {','.join(map(str, bad))}")
    distinct("--tokens", args.tokens or (), "M")
    require(math.isfinite(args.sustained) and args.sustained >= 0,
            f"--sustained must be a finite number of seconds >= 0, got {args.sustained}")
    require(cuda or not args.cuda_graphs, "--cuda-graphs needs CUDA devices")
    require(cuda or not args.trace_dir, "--trace-dir needs CUDA devices (it profiles GPU streams)")
    cfg = load_config(args.config) if args.config else load_preset(where.device_name, where.world_size)
    cfg.check_world_size(where.world_size)
    args.fp8 = args.fp8 or cfg.fp8   # the preset's `fp8: true` adds the FP8 variant too
    require(not args.fp8 or args.dtype == "bf16", "--fp8 needs --dtype bf16 (the FP8 GEMMs write bf16)")
    _check_fp8_runs(args, where)
    models = _models(args, cfg, cuda)
    tokens = args.tokens or (GPU_TOKENS if cuda else CPU_TOKENS)
    baselines = _baselines(args, cuda)
    for model in models:
        _check_model_fits(model, where.world_size, cfg.source)
    _check_tokens(args, tokens, where.world_size)
    _check_preset_runs(args, cfg, tokens, where)
    _check_memory(args, models, tokens, baselines, cfg, where)
    return SimpleNamespace(cfg=cfg, models=models, tokens=tokens, baselines=baselines,
                           warmup=args.warmup if args.warmup is not None else (20 if cuda else 2))
