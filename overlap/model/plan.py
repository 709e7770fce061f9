"""Which module of a model plays which role in the tensor-parallel conversion, checked before anything is
built. A plan maps module-name patterns (`*` is one name component: `model.layers.*.mlp`) to roles:

    attention  a Llama-family attention (q_proj, k_proj, v_proj, o_proj): q/k/v one column-parallel layer
               (AllGather overlapped), o_proj row-parallel (ReduceScatter overlapped)
    mlp        gate_proj, up_proj, down_proj with SiLU: gate/up one column-parallel layer, down_proj row-parallel
    norm       an RMSNorm on this rank's rows (its weight's gradient summed over the group)
    split      the module whose first input (the hidden states [B, S, H]) is split into this rank's rows
    gather     the module whose first input (this rank's rows) is gathered back to [B, S, H]

`llama_plan(model)` is the plan of `transformers`' Llama, Mistral and Qwen2 models (`*ForCausalLM` or the
bare `*Model`): the token dimension is split at the first decoder layer and gathered before the final norm,
so the head and the loss run on every rank on the whole sequence (no vocabulary-parallel loss).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.validate import OpInputError
from .attention import attention_shapes

__all__ = ["ROLES", "llama_plan", "resolve_plan"]

ROLES = ("attention", "mlp", "norm", "split", "gather")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


def llama_plan(model: nn.Module) -> dict[str, str]:
    """The built-in plan for a transformers Llama-family model (with or without its causal-LM head)."""
    for prefix in ("model.", ""):
        stack = model.get_submodule(prefix + "layers") if _has(model, prefix + "layers") else None
        if isinstance(stack, nn.ModuleList) and len(stack):
            break
    else:
        raise OpInputError(f"{type(model).__name__}: no decoder layers (`model.layers` or `layers`, a ModuleList) "
                           f"for the built-in Llama plan; pass plan= naming the modules")
    plan = {f"{prefix}layers.0": "split", f"{prefix}layers.*.self_attn": "attention",
            f"{prefix}layers.*.mlp": "mlp", f"{prefix}layers.*.input_layernorm": "norm",
            f"{prefix}layers.*.post_attention_layernorm": "norm"}
    if _has(model, prefix + "norm"):
        plan[f"{prefix}norm"] = "gather"
    return plan


def resolve_plan(model: nn.Module, plan: dict[str, str], world_size: int) -> dict[str, str]:
    """{module name: role} for every module the plan names, each checked for its role; refuses (naming the
    module) an entry that matches nothing, a role it cannot play, or a module that is not what the role needs."""
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for pattern, role in plan.items():
        if role not in ROLES:
            raise OpInputError(f"plan[{pattern!r}] = {role!r}; allowed roles: {' | '.join(ROLES)}")
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        names = [name for name in modules if name and regex.match(name)]
        if not names:
            raise OpInputError(f"plan[{pattern!r}] matches no module of {type(model).__name__}")
        for name in names:
            if resolved.setdefault(name, role) != role:
                raise OpInputError(f"{name}: the plan gives it two roles, {resolved[name]} and {role}")
            _CHECKS.get(role, lambda *a: None)(modules[name], name, world_size)
    if list(resolved.values()).count("split") != 1:
        raise OpInputError(f"the plan needs exactly one 'split' module (where the tokens are split over the group); "
                           f"it has {list(resolved.values()).count('split')}")
    return resolved


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _check_parts(module: nn.Module, name: str, parts: tuple[str, ...], allowed_extra: tuple[str, ...] = ()) -> None:
    for part in parts:
        if not isinstance(getattr(module, part, None), nn.Linear):
            raise OpInputError(f"{name}: a {type(module).__name__} without an nn.Linear {part!r}; this role needs "
                               f"{', '.join(parts)}")
    unknown = [child for child, sub in module.named_children()
               if child not in parts + allowed_extra and any(True for _ in sub.parameters())]
    if unknown or any(True for _ in module.parameters(recurse=False)):
        what = f"module(s) {', '.join(unknown)}" if unknown else "parameters of its own"
        raise OpInputError(f"{name}: {type(module).__name__} has {what} the conversion does not know; it would run "
                           f"without them. Give it another role, or leave it out of the plan")


def _check_attention(module: nn.Module, name: str, world_size: int) -> None:
    _check_parts(module, name, _ATTENTION_PARTS)
    attention_shapes(module, world_size, name)
    for part in ("q_proj", "k_proj", "v_proj"):
        if (getattr(module, part).bias is None) != (module.q_proj.bias is None):
            raise OpInputError(f"{name}: q/k/v must all have a bias or none ({part} differs)")


def _check_mlp(module: nn.Module, name: str, world_size: int) -> None:
    _check_parts(module, name, _MLP_PARTS)
    for part in _MLP_PARTS:
        if getattr(module, part).bias is not None:
            raise OpInputError(f"{name}.{part}: has a bias; the converted MLP has none (mlp_bias=False models only)")
    ffn = module.down_proj.in_features
    if ffn % world_size:
        raise OpInputError(f"{name}: intermediate size {ffn} is not divisible by the TP size {world_size}")
    probe = torch.linspace(-4, 4, 17)
    act = getattr(module, "act_fn", None)
    if act is None or not torch.allclose(act(probe), F.silu(probe)):
        raise OpInputError(f"{name}: its activation is not SiLU; the converted MLP is SwiGLU (silu(gate) * up)")


def _check_norm(module: nn.Module, name: str, world_size: int) -> None:
    from .norm import rms_norm
    weight, eps = getattr(module, "weight", None), norm_eps(module)
    params = list(module.parameters())
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or len(params) != 1 or eps is None:
        raise OpInputError(f"{name}: {type(module).__name__} is not an RMSNorm with one weight and an epsilon")
    probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    with torch.no_grad():
        theirs, mine = module(probe).float(), rms_norm(probe, weight, eps).float()
    if not torch.allclose(theirs, mine, rtol=1e-3, atol=1e-3):
        raise OpInputError(f"{name}: {type(module).__name__} does not compute weight * x / rms(x) (checked on a "
                           f"probe); the converted norm would differ")


def norm_eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


_CHECKS = {"attention": _check_attention, "mlp": _check_mlp, "norm": _check_norm}
