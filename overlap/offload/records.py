"""What the offload engine keeps per saved tensor: the record of one moved to a host slot, the record of
one to recompute, and the matcher that picks a saved tensor without holding it (overlap/offload/engine.py)."""

from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["Offloaded", "Recomputed", "identity_matcher"]

_RECORD_SERIAL = itertools.count(1)  # owners must be unique: engines may share slots (same names)


class Offloaded:
    """A saved tensor moved to a host slot; `device` until released, `fetched` once brought back."""

    def __init__(self, engine, layer: int, name: str, t: torch.Tensor, slot):
        self.layer, self.name, self.shape, self.dtype = layer, name, t.shape, t.dtype
        self.slot = slot
        self.owner = f"{engine.name} step {engine.steps} L{layer}.{name} (record {next(_RECORD_SERIAL)})"
        self.generation = slot.acquire(self.owner)
        self.host = slot.view(t.shape, t.dtype)
        self.device, self.landed, self.fetched, self.fetched_event = t.detach(), None, None, None
        self.consumers = 1  # unpacks still to come (a recompute of `a` adds one to h's record)
        weakref.finalize(self, _release_slot, slot, self.owner)


def _release_slot(slot, owner: str) -> None:
    if slot.owner == owner and not slot.pool.closed:
        slot.owner = None  # a graph dropped without backward: its slot is free again


class Recomputed:
    """A saved tensor recomputed at unpack as activation(source), `source` a kept tensor or an Offloaded."""

    def __init__(self, source, activation: str):
        self.source, self.activation = source, activation
        if isinstance(source, Offloaded):
            source.consumers += 1


def identity_matcher(t: torch.Tensor):
    """A matcher for `t` itself (same address and shape) that keeps no reference to `t`.

    torch keeps the pack hook of every tensor saved under `saved_tensors_hooks` (PySavedVariableHooks
    holds pack_hook_ until the saved variable is released, i.e. after that node's backward), so anything
    the hook's closure holds lives as long as the autograd graph: only plain ints here."""
    ptr, shape = t.data_ptr(), tuple(t.shape)
    return lambda u: u.data_ptr() == ptr and tuple(u.shape) == shape
