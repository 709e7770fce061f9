"""`parallelize`: a whole `transformers` Llama-family model converted in place to sequence-parallel tensor
parallelism over `group`, every AllGather and ReduceScatter of every block overlapped with its GEMM.

    tp = parallelize(model, group=tp_group, max_tokens=batch * seq)
    loss = model(input_ids=ids, labels=ids).loss      # same call, same loss on every rank of the group
    loss.backward(); optimizer.step()
    tp.close()                                        # or `with parallelize(...) as tp:`

What it does (the plan: overlap/model/plan.py; the built-in one for Llama, Mistral and Qwen2):
* the hidden states are split into this rank's rows of the B*S tokens at the first decoder layer and
  gathered back before the final norm (the head and the loss run on every rank);
* attention: q/k/v one column-parallel layer (this rank's heads; the AllGather of its input overlapped with
  the GEMM), o_proj row-parallel (the ReduceScatter overlapped); MLP: gate/up one column-parallel layer,
  down_proj row-parallel; RMSNorms on local rows, their weight gradients summed over the group;
* one SymmetricPool for the model with one AllGather and one ReduceScatter region shared by every block
  (blocks run one after another on a stream): the pool does not grow with depth
  (`ParallelModel.pool_bytes`); a column layer keeps its gathered input for its backward (as the
  unconverted model keeps its input);
* the weights are this rank's shards of the model's own (every rank must build or load the same full
  model); `ParallelModel.full_state_dict()` gives them back under the original names and shapes.
Everything that cannot be converted is refused before the pool exists, naming the module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tp_overlap.symm_mem.pool import SymmetricPool

from ..config import envs
from ..config.presets import load_preset
from ..ops.custom_ops import SharedOps
from ..ops.layers import TPMLP, pool_requirements
from ..ops.validate import OpInputError, check_divisible
from .attention import TPAttention
from .norm import SequenceParallelRMSNorm
from .plan import llama_plan, norm_eps, resolve_plan
from .sequence import GroupCollectives, gather_rows, split_rows
from .state import full_state_dict, load_full_state_dict

__all__ = ["parallelize", "ParallelModel"]


def parallelize(model: nn.Module, *, group: dist.ProcessGroup, max_tokens: int, plan: dict[str, str] | None = None,
                config=None, overlap: bool = True, baseline: str = "nccl", name: str = "model") -> "ParallelModel":
    """Convert `model` in place (see the module docstring); returns the handle that owns its pool.

    group: the TP process group (ranks of one node); max_tokens: the largest B*S of a step (a multiple of the
    group size; sizes the pool); plan: {module-name pattern: role} (default `llama_plan(model)`); config: an
    OverlapConfig (default the preset for this GPU and TP size; its `by_m` buckets apply per step);
    overlap=False: the same conversion on plain collectives (`baseline` "nccl" or "torch_symm"), no pool.
    """
    if group is None:
        raise OpInputError("group= is required (pass the TP process group explicitly)")
    world = dist.get_world_size(group)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise OpInputError(f"max_tokens must be a positive int (the largest B*S of a step), got {max_tokens!r}")
    check_divisible("max_tokens", max_tokens, world, "the TP group size")
    roles = resolve_plan(model, plan if plan is not None else llama_plan(model), world)
    hidden, dtype, device = _model_geometry(model, roles)
    return ParallelModel(model, roles, group=group, max_tokens=max_tokens, hidden=hidden, dtype=dtype,
                         device=device, config=config, overlap=overlap, baseline=baseline, name=name)


def _model_geometry(model: nn.Module, roles: dict[str, str]) -> tuple[int, torch.dtype, torch.device]:
    """(hidden size, dtype, device) the planned layers share, or a refusal naming the one that differs."""
    seen = {}
    for name, role in roles.items():
        module = model.get_submodule(name)
        if role in ("attention", "mlp"):
            linear = module.q_proj if role == "attention" else module.gate_proj
            seen[name] = (linear.in_features, linear.weight.dtype, linear.weight.device)
    if not seen:
        raise OpInputError("the plan names no attention or mlp module: nothing to parallelize")
    first, geometry = next(iter(seen.items()))
    for name, other in seen.items():
        if other != geometry:
            raise OpInputError(f"{name}: (hidden, dtype, device) = {other}, {first} has {geometry}; every planned "
                               f"layer must share them")
    return geometry


class ParallelModel:
    """What `parallelize` built: the converted model (`module`), its pool and shared ops, the hooks that
    split and gather the tokens. `close()` (or leaving a `with` block) removes them and closes the pool;
    the converted modules cannot run after it."""

    def __init__(self, model, roles, *, group, max_tokens, hidden, dtype, device, config, overlap, baseline, name):
        self.module, self.roles, self.group, self.max_tokens = model, roles, group, max_tokens
        self.pool = self.shared = None
        self._hooks, self._layers, self._shape = [], [], None
        self.collectives = GroupCollectives(group)
        try:
            if overlap:
                config = config if config is not None else _preset(device, self.collectives.world_size)
                self.pool = _pool_for(config, hidden=hidden, max_tokens=max_tokens, dtype=dtype, device=device,
                                      group=group)
                self.shared = SharedOps(group=group, pool=self.pool, max_m=max_tokens, hidden=hidden, dtype=dtype,
                                        config=config, fp8=config.fp8, name=name)
                self.collectives.ag = self.shared.ag
            kwargs = dict(max_m=max_tokens, dtype=dtype, device=device, overlap=overlap, baseline=baseline,
                          shared=self.shared, save_gathered="copy")
            replacements = {n: self._convert(n, r, kwargs) for n, r in roles.items() if r not in ("split", "gather")}
        except BaseException:
            self.close()
            raise
        for module_name, new in replacements.items():
            parent, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
        if getattr(getattr(model, "config", None), "use_cache", False):
            model.config.use_cache = False   # it trains: no KV cache (TPAttention refuses one)
        self._install_hooks()

    @property
    def pool_bytes(self) -> int:
        """Bytes of the model's pool (0 with overlap=False): independent of the number of blocks."""
        return self.pool.arena_bytes if self.pool is not None else 0

    def _convert(self, name: str, role: str, kwargs: dict) -> nn.Module:
        module = self.module.get_submodule(name)
        if role == "norm":
            return SequenceParallelRMSNorm(module, eps=norm_eps(module), group_id=self.collectives.id)
        if role == "attention":
            new = TPAttention(module, name=name, group=self.group, collectives=self.collectives, layer_kwargs=kwargs)
            self._layers.append(new)
            new.load_full(module)
            return new
        new = TPMLP(module.gate_proj.in_features, module.down_proj.in_features, activation="swiglu", name=name,
                    group=self.group, **kwargs)
        self._layers.append(new)
        new.load_full_weights(torch.cat([module.gate_proj.weight.t(), module.up_proj.weight.t()], dim=1),
                              module.down_proj.weight.t())
        return new

    # ----- the token dimension --------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        for module_name, role in self.roles.items():
            if role in ("split", "gather"):
                hook = self._split if role == "split" else self._gather
                handle = self.module.get_submodule(module_name).register_forward_pre_hook(hook, with_kwargs=True)
                self._hooks.append(handle)

    def _split(self, module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        self._shape = tuple(x.shape)
        rows = split_rows(x.reshape(-1, x.shape[-1]), self.collectives.id)
        return ((rows, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": rows})

    def _gather(self, module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        full = gather_rows(x, self.collectives.id).view(self._shape)
        return ((full, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": full})

    # ----- checkpoints, errors, lifetime ---------------------------------------------------------------
    def full_state_dict(self, *, grads: bool = False) -> dict[str, torch.Tensor]:
        """The unconverted model's state dict (names and shapes), gathered over the group on every rank (a
        collective); grads=True: the parameters' gradients instead (None where a parameter has none)."""
        return full_state_dict(self, grads=grads)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load an unconverted model's state dict (every rank passes the same): each rank copies its shards."""
        load_full_state_dict(self, state)

    def check_errors(self) -> None:
        """Raise if a bounded device-side wait expired (synchronises; call at step boundaries)."""
        if self.shared is not None:
            self.shared.check_errors()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for layer in self._layers:
            layer.close()
        for owner in (self.shared, self.collectives, self.pool):
            if owner is not None:
                owner.close()
        self._hooks, self._layers, self.shared, self.pool = [], [], None, None

    def __enter__(self) -> "ParallelModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _preset(device: torch.device, world_size: int):
    return load_preset(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", world_size)


def _pool_for(config, *, hidden, max_tokens, dtype, device, group) -> SymmetricPool:
    chunks = max(cfg.chunks_per_rank for cfg in [config.ag_gemm.default] + [c for _, c in config.ag_gemm.by_m])
    req = pool_requirements(hidden=hidden, max_m=max_tokens, world_size=dist.get_world_size(group), dtype=dtype,
                            num_layers=1, chunks_per_rank=chunks, fp8=config.fp8)
    return SymmetricPool(req.size_bytes, group=group, device=device, num_signal_words=req.num_signal_words,
                         num_device_words=req.num_device_words, timeout_s=envs.timeout_s())
