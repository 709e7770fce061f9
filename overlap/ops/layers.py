"""Sequence-parallel tensor-parallel layers over a given `group`: column/row linear and the Llama MLP.

Activations between layers are sequence-sharded: every rank holds rows [r*M/W, (r+1)*M/W) of the [M, H]
input and of the [M, H] output. Weights are stored as the ops take them, [in, out] row-major (the
transpose of nn.Linear's [out, in]):

    ColumnParallelLinear  x [M/W, H] -> y [M, N/W]:  y = all_gather(x) @ w,  w [H, N/W]
    RowParallelLinear     x [M, K/W] -> y [M/W, H]:  y = reduce_scatter(x @ w),  w [K/W, H]
    TPMLP                 x [M/W, H] -> y [M/W, H]:  fc2(act(fc1(x))); swiglu: fc1 = fused [gate | up]

`overlap=True` runs our AgGemm / GemmRs (pool regions built once here, from the preset's per-op config);
`overlap=False` builds the same module on plain collectives + torch.mm (`baseline="nccl"`, the
reference of every benchmark) or on PyTorch's async-TP fused ops (`baseline="torch_symm"`, CUDA only).
Forward and backward of a layer use separate op contexts (separate regions and flags). All ops
are issued on the caller's current stream; outputs and gradients are valid on it when they return.

`MLPReference` is the single-process oracle with the full weights; `shard_fc1` / `shard_fc2` /
`shard_rows` cut full tensors into this rank's pieces (gate and up sliced separately for SwiGLU).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tp_overlap.symm_mem.regions import PoolRequirements, requirements

from . import custom_ops
from .ag_gemm import AgGemm
from .gemm_rs import GemmRs
from .validate import OpInputError, check_at_most, check_divisible, check_tensor
from ..config.schema import ACTIVATIONS, ModelConfig, OverlapConfig
from ..config.presets import load_preset

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TPMLP", "MLPReference", "BASELINES",
           "shard_fc1", "shard_fc2", "shard_rows", "pool_requirements", "PoolRequirements"]

BASELINES = ("nccl", "torch_symm")


def pool_requirements(*, hidden: int, max_m: int, world_size: int, dtype: torch.dtype, num_layers: int = 2,
                      chunks_per_rank: int = 1, fp8: bool = False) -> PoolRequirements:
    """Exactly what `num_layers` overlapped layers of width `hidden` reserve in a pool:

        req = pool_requirements(hidden=4096, max_m=16384, world_size=W, dtype=torch.bfloat16)
        pool = SymmetricPool(req.size_bytes, num_signal_words=req.num_signal_words,
                             num_device_words=req.num_device_words, group=tp_group)

    Each layer holds one AgGemm region [max_m, hidden] (fp8: e4m3 rows and a [max_m, hidden/128] fp32 scale
    region) and one GemmRs region [W, max_m/W, hidden] (independent of the FFN width) with their flags;
    `chunks_per_rank` is the preset's ag_gemm value (the fused AllGather consumer keeps a flag per chunk).
    """
    check_divisible("max_m", max_m, world_size, "the group size")
    layer = (AgGemm.regions(name="layer", world_size=world_size, max_m=max_m, k=hidden, dtype=dtype,
                            chunks_per_rank=chunks_per_rank, fp8=fp8)
             + GemmRs.regions(name="layer", world_size=world_size, max_m=max_m, n=hidden, dtype=dtype))
    return requirements(layer) * num_layers


def _check_shared(shared, *, name, max_m, hidden, dtype, fp8) -> None:
    mine = (max_m, hidden, dtype, shared.fp8 if fp8 is None else bool(fp8))
    theirs = (shared.max_m, shared.hidden, shared.dtype, shared.fp8)
    if mine != theirs:
        raise OpInputError(f"{name}: (max_m, hidden, dtype, fp8) = {mine}, but its shared= ops were built for "
                           f"{theirs}")


def _make_ops(*, group, pool, config, max_m, hidden, local, dtype, overlap, baseline, device, name,
              save_gathered, kind, fp8, shared) -> custom_ops.LayerOps:
    if fp8 and not overlap:
        raise OpInputError(f"{name}: fp8=True runs our FP8 ops: it needs overlap=True (the baselines are bf16)")
    if overlap and shared is not None:
        _check_shared(shared, name=name, max_m=max_m, hidden=hidden, dtype=dtype, fp8=fp8)
        return custom_ops.OverlapLayerOps(
            group=group, pool=shared.pool, max_m=max_m, hidden=hidden, local=local, dtype=dtype, config=shared.config,
            ag_name=shared.ag.name, rs_name=shared.rs.name, save_gathered=save_gathered, shared=shared,
            role="fc1_dgrad" if kind == "column" else "fc2_dgrad", fp8=shared.fp8)
    if overlap:
        if pool is None:
            raise OpInputError(f"{name}: overlap=True needs pool= (a SymmetricPool on group)")
        if config is None:
            name_of = torch.cuda.get_device_name(pool.device) if pool.device.type == "cuda" else "cpu"
            config = load_preset(name_of, dist.get_world_size(group))
        fp8 = config.fp8 if fp8 is None else fp8   # None: the preset's `fp8` key
        ag_role, rs_role = ("fwd", "bwd") if kind == "column" else ("bwd", "fwd")
        return custom_ops.OverlapLayerOps(
            group=group, pool=pool, max_m=max_m, hidden=hidden, local=local, dtype=dtype, config=config,
            ag_name=f"{name}.{ag_role}.ag", rs_name=f"{name}.{rs_role}.rs", save_gathered=save_gathered,
            role="fc1_dgrad" if kind == "column" else "fc2_dgrad", fp8=fp8)
    if baseline == "nccl":
        return custom_ops.NcclLayerOps(group=group)
    if baseline == "torch_symm":
        return custom_ops.TorchSymmLayerOps(group=group, device=device)
    raise OpInputError(f"{name}: baseline={baseline!r}; allowed: {' | '.join(BASELINES)}")


class _ParallelLinear(nn.Module):
    """Shared construction: validation, the op contexts, the registry id, the weight [in, out] shard.

    Keywords: group (the TP group, required); max_m (largest token count M, a multiple of W; each call
    runs the preset's op and role settings for its own M, `by_m` buckets included); dtype; pool (SymmetricPool
    on `group`, required when overlap=True; the layer reserves `<name>.fwd.*` / `<name>.bwd.*` regions in it,
    the caller owns and closes it); config (OverlapConfig; None = the preset for this GPU and TP size); overlap; baseline ("nccl" |
    "torch_symm", used when overlap=False); save_gathered ("view" | "copy", see custom_ops); fp8 (the
    forward and input-grad GEMMs in FP8 e4m3 with 1x128 / 128x128 scales, the AllGathers moving e4m3 rows
    and their scales; weight grads in bf16 on the dequantised gathered inputs; overlap=True only; None: the
    config's `fp8` key); device
    (default the pool's, else the current CUDA device, else CPU); name (prefix of regions and messages);
    shared (a custom_ops.SharedOps: this layer calls its AgGemm / GemmRs and reserves nothing; its pool,
    config and fp8 are the layer's; save_gathered must be "copy").
    Forward and backward can be captured in a CUDA graph and replayed (every op is capturable).
    Nothing is allocated or exchanged after construction; `close()` drops the op contexts. `weight` starts
    as N(0, 1/in_features) from the default generator: copy the real shard in (TPMLP.load_full_weights).
    """

    kind = ""

    def __init__(self, in_features: int, out_features: int, *, group: dist.ProcessGroup, max_m: int,
                 dtype: torch.dtype = torch.bfloat16, pool=None, config: OverlapConfig | None = None,
                 overlap: bool = True, baseline: str = "nccl", save_gathered: str = "view", fp8: bool | None = None,
                 device: torch.device | str | None = None, name: str | None = None, shared=None):
        super().__init__()
        if group is None:
            raise OpInputError("group= is required (pass the TP process group explicitly)")
        self.name = name or self.kind
        for arg, value in (("in_features", in_features), ("out_features", out_features), ("max_m", max_m)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise OpInputError(f"{self.name}: {arg} must be a positive int, got {value!r}")
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        sharded = "out_features" if self.kind == "column" else "in_features"
        check_divisible(f"{self.name}: {sharded}", out_features if self.kind == "column" else in_features,
                        self.world_size, "the group size")
        check_divisible(f"{self.name}: max_m", max_m, self.world_size, "the group size")
        pool = shared.pool if shared is not None and pool is None else pool
        if device is None:
            device = pool.device if pool is not None else (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if pool is not None and overlap and pool.device != self.device:
            raise OpInputError(f"{self.name}: pool is on {pool.device}, device= is {self.device}")
        self.group, self.max_m, self.dtype, self.overlap = group, max_m, dtype, bool(overlap)
        self.in_features, self.out_features = in_features, out_features
        hidden = in_features if self.kind == "column" else out_features
        local = (out_features if self.kind == "column" else in_features) // self.world_size
        self.hidden, self.local = hidden, local
        self.ops = _make_ops(group=group, pool=pool, config=config, max_m=max_m, hidden=hidden, local=local,
                             dtype=dtype, overlap=overlap, baseline=baseline, device=self.device,
                             name=self.name, save_gathered=save_gathered, kind=self.kind, fp8=fp8, shared=shared)
        self.ops.name = self.name
        self.layer_id = custom_ops.register_layer_ops(self.ops)
        # A layer dropped without close() must not pin its op contexts (streams, pool views) forever.
        self._finalizer = weakref.finalize(self, custom_ops.unregister_layer_ops, self.layer_id)
        shape = (hidden, local) if self.kind == "column" else (local, hidden)
        # N(0, 1/in_features) like a fresh shard of the full layer; load real weights with copy_()
        self.weight = nn.Parameter(torch.randn(shape, device=self.device).mul_(in_features ** -0.5).to(dtype))

    def close(self) -> None:
        """Drop the op contexts' pool references and the registry entry (the pool is the caller's)."""
        self._finalizer()
        self.ops.close()

    def check_errors(self) -> None:
        """Raise if a bounded device-side wait expired (synchronises; call at step boundaries)."""
        if isinstance(self.ops, custom_ops.OverlapLayerOps):
            self.ops.check_errors()

    def _check_input(self, x: torch.Tensor, width: int, rows_times: int) -> None:
        check_tensor(f"{self.name} input", x, dtype=self.dtype, device=self.device, shape=(None, width))
        m = x.shape[0] * rows_times
        check_divisible(f"{self.name}: M", m, self.world_size, "the group size")
        check_at_most(f"{self.name}: M", m, self.max_m, "max_m of this layer")

    def extra_repr(self) -> str:
        impl = "overlap" if self.overlap else type(self.ops).__name__
        return (f"{self.in_features}->{self.out_features}, world={self.world_size}, {impl}, "
                f"weight={tuple(self.weight.shape)}")


class ColumnParallelLinear(_ParallelLinear):
    """y [M, out_features/W] = all_gather(x [M/W, in_features]) @ weight [in_features, out_features/W].

    Backward: dx = reduce_scatter(dy @ weight^T) (GEMM+RS), dweight = gathered_x^T @ dy, with gathered_x
    saved by the forward (no second AllGather; see custom_ops for `save_gathered`).
    """

    kind = "column"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x, self.in_features, self.world_size)
        return torch.ops.tp_overlap.column_forward(x, self.weight, self.layer_id)[0]


class RowParallelLinear(_ParallelLinear):
    """y [M/W, out_features] = reduce_scatter(x [M, in_features/W] @ weight [in_features/W, out_features]).

    Backward: dx = all_gather(dy) @ weight^T (AG+GEMM, the gather overlapped with that GEMM),
    dweight = x^T @ all_gather(dy) (the local input and the gathered grad of the same call).
    """

    kind = "row"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x, self.in_features // self.world_size, 1)
        return torch.ops.tp_overlap.row_forward(x, self.weight, self.layer_id)


class TPMLP(nn.Module):
    """Llama MLP, sequence-parallel: x [M/W, hidden] -> [M/W, hidden] on every rank of `group`.

    swiglu: fc1 = ColumnParallelLinear(hidden, 2*ffn_hidden) holding this rank's [gate | up] slices,
    y = fc2(silu(gate) * up); gelu: fc1 = ColumnParallelLinear(hidden, ffn_hidden), y = fc2(gelu(fc1(x))).
    fc2 = RowParallelLinear(ffn_hidden, hidden). Keywords as ColumnParallelLinear; `pool` must have
    room for `pool_requirements(hidden=..., max_m=..., world_size=..., dtype=...)` when overlap=True.
    """

    def __init__(self, hidden: int, ffn_hidden: int, *, activation: str = "swiglu", name: str = "mlp",
                 **layer_kwargs):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise OpInputError(f"activation={activation!r}; allowed: {' | '.join(ACTIVATIONS)}")
        self.hidden, self.ffn_hidden, self.activation = hidden, ffn_hidden, activation
        width = 2 * ffn_hidden if activation == "swiglu" else ffn_hidden
        group = layer_kwargs.get("group")
        if group is not None:  # checked here so the message names ffn_hidden, not fc1's width
            check_divisible("ffn_hidden", ffn_hidden, dist.get_world_size(group), "the group size")
        self.fc1 = ColumnParallelLinear(hidden, width, name=f"{name}.fc1", **layer_kwargs)
        try:
            self.fc2 = RowParallelLinear(ffn_hidden, hidden, name=f"{name}.fc2", **layer_kwargs)
        except BaseException:
            self.fc1.close()  # leave no registry entry behind (its pool regions stay reserved)
            raise
        self.world_size, self.rank = self.fc1.world_size, self.fc1.rank
        self.offload = None  # activation offload: (OffloadEngine, position), set by overlap.offload.enable_offload

    @classmethod
    def from_model_config(cls, model: ModelConfig, **kwargs) -> "TPMLP":
        return cls(model.hidden, model.ffn_hidden, activation=model.activation, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offload is not None:  # activation offload (overlap/offload/engine.py)
            engine, position = self.offload
            return engine.forward(position, self, x)
        h = self.fc1(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.fc2(h)

    @torch.no_grad()
    def load_full_weights(self, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor) -> None:
        """Copy this rank's shards of the full weights ([hidden, width], [ffn_hidden, hidden])."""
        self.fc1.weight.copy_(shard_fc1(fc1_weight, self.rank, self.world_size, self.activation))
        self.fc2.weight.copy_(shard_fc2(fc2_weight, self.rank, self.world_size))

    def check_errors(self) -> None:
        self.fc1.check_errors()
        self.fc2.check_errors()

    def close(self) -> None:
        self.fc1.close()
        self.fc2.close()


# ----- the single-process oracle and the sharding helpers -------------------------------------------------
class MLPReference(nn.Module):
    """The same MLP with full weights on one process: fc1_weight [hidden, width], fc2_weight [ffn, hidden].

    Weights are N(0, 1/fan_in) from a CPU generator seeded with `seed`, so every rank builds the same ones.
    """

    def __init__(self, hidden: int, ffn_hidden: int, *, activation: str = "swiglu", seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise OpInputError(f"activation={activation!r}; allowed: {' | '.join(ACTIVATIONS)}")
        self.activation = activation
        width = 2 * ffn_hidden if activation == "swiglu" else ffn_hidden
        gen = torch.Generator().manual_seed(seed)
        fc1 = torch.randn(hidden, width, generator=gen) / hidden ** 0.5
        fc2 = torch.randn(ffn_hidden, hidden, generator=gen) / ffn_hidden ** 0.5
        self.fc1_weight = nn.Parameter(fc1.to(dtype=dtype, device=device))
        self.fc2_weight = nn.Parameter(fc2.to(dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.fc1_weight
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return h @ self.fc2_weight


def shard_fc1(full: torch.Tensor, rank: int, world_size: int, activation: str = "swiglu") -> torch.Tensor:
    """This rank's fc1 columns: [gate slice | up slice] for swiglu, one contiguous slice for gelu."""
    parts = full.chunk(2, dim=1) if activation == "swiglu" else (full,)
    for part in parts:
        check_divisible("fc1 width", part.shape[1], world_size, "the group size")
    return torch.cat([part.chunk(world_size, dim=1)[rank] for part in parts], dim=1).contiguous()


def shard_fc2(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of the fc2 weight [ffn_hidden, hidden] -> [ffn_hidden/W, hidden]."""
    check_divisible("ffn_hidden", full.shape[0], world_size, "the group size")
    return full.chunk(world_size, dim=0)[rank].contiguous()


def shard_rows(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's sequence shard of an [M, ...] activation."""
    check_divisible("M", x.shape[0], world_size, "the group size")
    return x.chunk(world_size, dim=0)[rank].contiguous()
