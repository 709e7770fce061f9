"""A converted model's weights under the unconverted model's names and shapes, and back.

The converted layers hold this rank's shards in the ops' layout ([in, out] row-major):
    attention `<a>.qkv.weight` [H, (nq + 2 nkv)/W * hd] (this rank's q | k | v columns), `<a>.qkv_bias`,
              `<a>.o_proj.weight` [nq/W * hd, H], `<a>.o_bias` [H]
    mlp       `<m>.fc1.weight` [H, 2 F/W] (this rank's gate | up columns), `<m>.fc2.weight` [F/W, H]
and the original names are `<a>.{q,k,v,o}_proj.{weight,bias}` ([out, in]) and `<m>.{gate,up,down}_proj.weight`.
Every other entry (embeddings, norms, the head, buffers) keeps its name and is the same on every rank.
`full_state_dict` gathers over the group (a collective: every rank calls it); `load_full_state_dict` takes
the same full dict on every rank and copies each rank's shards. Parameters sharded by FSDP2 over another
mesh dimension (DTensors) are gathered whole first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.validate import OpInputError

__all__ = ["full_state_dict", "load_full_state_dict"]


def full_state_dict(tp, *, grads: bool = False) -> dict[str, torch.Tensor | None]:
    model = tp.module
    if grads:
        local = {name: p.grad for name, p in model.named_parameters()}
    else:
        local = dict(model.state_dict())
    full: dict = {}
    for name, tensor in local.items():
        owner, role = _owner(tp, name)
        if role is None:
            full[name] = _whole(tensor)
            continue
        full.update(_gather_entry(tp, owner, role, name[len(owner) + 1:], _whole(tensor)))
    return full


def load_full_state_dict(tp, state: dict[str, torch.Tensor]) -> None:
    model = tp.module
    own = dict(model.state_dict(keep_vars=True))
    taken = set()
    with torch.no_grad():
        for name, target in own.items():
            owner, role = _owner(tp, name)
            keys, value = _shard_entry(tp, owner, role, name, target, state)
            missing = [k for k in keys if k not in state]
            if missing:
                raise OpInputError(f"load_full_state_dict: no {', '.join(missing)} in the given state dict")
            target.copy_(value)
            taken.update(keys)
    unexpected = sorted(set(state) - taken)
    if unexpected:
        raise OpInputError(f"load_full_state_dict: entries the model does not have: {', '.join(unexpected[:8])}"
                           f"{' ...' if len(unexpected) > 8 else ''}")


def _owner(tp, name: str) -> tuple[str, str | None]:
    """(converted module, its role) a state entry belongs to, or ("", None)."""
    for owner, role in tp.roles.items():
        if role in ("attention", "mlp") and name.startswith(owner + "."):
            return owner, role
    return "", None


def _whole(tensor):
    if tensor is not None and hasattr(tensor, "full_tensor"):   # an FSDP2 (DTensor) shard
        tensor = tensor.full_tensor()
    return tensor


def _ranks(tp, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's tensor of the same shape (an all_gather over the model's group)."""
    world = dist.get_world_size(tp.group)
    out = tp.collectives.dist_all_gather(tensor.detach().reshape(tensor.shape[0], -1) if tensor.dim() else tensor)
    return list(out.view(world, *tensor.shape).unbind(0))


def _gather_entry(tp, owner: str, role: str, key: str, tensor) -> dict:
    if tensor is None:
        return {name: None for name in _full_names(tp, owner, role, key)}
    parts = _ranks(tp, tensor)
    if role == "mlp":
        if key == "fc1.weight":   # [H, 2F/W] per rank: gate | up columns
            gates, ups = zip(*(p.chunk(2, dim=1) for p in parts))
            return {f"{owner}.gate_proj.weight": torch.cat(gates, 1).t(),
                    f"{owner}.up_proj.weight": torch.cat(ups, 1).t()}
        if key == "fc2.weight":
            return {f"{owner}.down_proj.weight": torch.cat(parts, 0).t()}
    attn = tp.module.get_submodule(owner)
    if key in ("qkv.weight", "qkv_bias"):
        dim = 1 if key == "qkv.weight" else 0
        split = [p.split(attn.widths, dim=dim) for p in parts]
        suffix = "weight" if key == "qkv.weight" else "bias"
        full = {}
        for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            value = torch.cat([s[i] for s in split], dim)
            full[f"{owner}.{proj}.{suffix}"] = value.t() if dim == 1 else value
        return full
    if key == "o_proj.weight":
        return {f"{owner}.o_proj.weight": torch.cat(parts, 0).t()}
    if key == "o_bias":
        return {f"{owner}.o_proj.bias": tensor}
    raise OpInputError(f"{owner}.{key}: an entry of a converted {role} that has no full form")


def _full_names(tp, owner: str, role: str, key: str) -> list[str]:
    names = {"fc1.weight": ["gate_proj.weight", "up_proj.weight"], "fc2.weight": ["down_proj.weight"],
             "qkv.weight": ["q_proj.weight", "k_proj.weight", "v_proj.weight"],
             "qkv_bias": ["q_proj.bias", "k_proj.bias", "v_proj.bias"], "o_proj.weight": ["o_proj.weight"],
             "o_bias": ["o_proj.bias"]}[key]
    return [f"{owner}.{name}" for name in names]


def _shard_entry(tp, owner: str, role: str | None, name: str, target, state) -> tuple[list[str], torch.Tensor]:
    """(the full entries this converted entry is cut from, this rank's value)."""
    if role is None:
        return [name], state.get(name)
    key = name[len(owner) + 1:]
    keys = _full_names(tp, owner, role, key)
    if any(k not in state for k in keys):
        return keys, None
    rank, world = dist.get_rank(tp.group), dist.get_world_size(tp.group)
    mine = [state[k].chunk(world, dim=0)[rank] for k in keys]   # [out, in] rows of this rank
    if key == "fc1.weight" or key == "qkv.weight":
        return keys, torch.cat(mine, dim=0).t()
    if key == "qkv_bias":
        return keys, torch.cat(mine, dim=0)
    if key in ("fc2.weight", "o_proj.weight"):
        return keys, state[keys[0]].t().chunk(world, dim=0)[rank]
    return keys, state[keys[0]]   # o_bias: the whole bias
