"""Tensor-parallel self-attention for a `transformers` Llama-family attention module, sequence-parallel.

    x [M/W, H] -> qkv = all_gather(x) @ [wq | wk | wv] (one ColumnParallelLinear: this rank's heads of q, k, v,
    the AllGather overlapped)  -> rotary, attention over this rank's heads (the model's own functions and
    attention implementation: eager, sdpa, flash, flex) -> o_proj: reduce_scatter(attn @ wo) [M/W, H]
    (a RowParallelLinear, the ReduceScatter overlapped).

Heads are split over the group: rank r holds query heads [r nq/W, (r+1) nq/W) and the matching key/value
heads (grouped-query attention keeps its ratio nq/nkv on every rank). The batch and sequence of the step are
read from the rotary tables (`position_embeddings`, [B or 1, S, head_dim]): M = B*S tokens, in (b, s) order.
Biases (q/k/v: this rank's slices; o_proj: the full bias added to this rank's rows, its gradient summed over
the group) are added outside the overlapped ops. A KV cache (generation) is not supported.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..ops.layers import ColumnParallelLinear, RowParallelLinear
from ..ops.validate import OpInputError
from .sequence import sum_grad

__all__ = ["TPAttention", "attention_shapes"]


def attention_shapes(attn: nn.Module, world_size: int, name: str) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of a transformers attention module, or a refusal naming it."""
    config = getattr(attn, "config", None)
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    head_dim = getattr(attn, "head_dim", None)
    if not all(isinstance(v, int) for v in (heads, kv_heads, head_dim)):
        raise OpInputError(f"{name}: {type(attn).__name__} is not a transformers Llama-family attention (no "
                           f"config.num_attention_heads / num_key_value_heads or head_dim)")
    for what, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count % world_size:
            raise OpInputError(f"{name}: {what} = {count} is not divisible by the TP size {world_size}: each rank "
                               f"must hold whole heads")
    return heads, kv_heads, head_dim


class TPAttention(nn.Module):
    """Replaces a Llama / Mistral / Qwen2 attention module; called as the decoder layer calls the original:
    `forward(hidden_states [M/W, H], position_embeddings=(cos, sin), attention_mask=..., **kwargs)` returns
    (output [M/W, H], attention weights or None). Weights: `qkv.weight` [H, (nq + 2 nkv)/W * head_dim] (this
    rank's q, k, v columns), `o_proj.weight` [nq/W * head_dim, H]; load them with `load_full`."""

    def __init__(self, attn: nn.Module, *, name: str, group, collectives, layer_kwargs: dict):
        super().__init__()
        world = collectives.world_size
        heads, kv_heads, head_dim = attention_shapes(attn, world, name)
        hidden = attn.q_proj.in_features
        self.name, self.collectives = name, collectives
        self.config, self.layer_idx = attn.config, getattr(attn, "layer_idx", None)
        self.head_dim, self.scaling = head_dim, attn.scaling
        self.num_key_value_groups = heads // kv_heads
        self.attention_dropout, self.is_causal = attn.attention_dropout, getattr(attn, "is_causal", True)
        self.sliding_window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
        self.widths = [heads // world * head_dim, kv_heads // world * head_dim, kv_heads // world * head_dim]
        self._functions = _model_functions(attn, name)
        self.qkv = ColumnParallelLinear(hidden, sum(self.widths) * world, group=group, name=f"{name}.qkv",
                                        **layer_kwargs)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, group=group, name=f"{name}.o_proj",
                                        **layer_kwargs)
        self.qkv_bias = _bias_like(attn.q_proj, sum(self.widths), self.qkv.weight)
        self.o_bias = _bias_like(attn.o_proj, hidden, self.o_proj.weight)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            raise OpInputError(f"{self.name}: the converted model trains; generation with a KV cache is not "
                               f"supported")
        if position_embeddings is None:
            raise OpInputError(f"{self.name}: needs position_embeddings=(cos, sin), as the model passes them")
        qkv = self.qkv(hidden_states)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        cos, sin = position_embeddings
        seq = cos.shape[-2]
        batch = qkv.shape[0] // seq
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in qkv.split(self.widths, dim=1))
        apply_rotary, attention = self._functions
        q, k = apply_rotary(q, k, cos, sin)
        extra = {"sliding_window": self.sliding_window} if self.sliding_window is not None else {}
        out, weights = attention()(self, q, k, v, attention_mask, scaling=self.scaling,
                                   dropout=self.attention_dropout if self.training else 0.0, **extra, **kwargs)
        out = self.o_proj(out.reshape(batch * seq, -1))
        if self.o_bias is not None:
            out = out + sum_grad(self.o_bias, self.collectives.id)
        return out, weights

    @torch.no_grad()
    def load_full(self, attn: nn.Module) -> None:
        """Copy this rank's shards of the original module's q/k/v/o weights (nn.Linear [out, in]) and biases."""
        rank, world = self.collectives.rank, self.collectives.world_size
        parts = [_rows_of(proj.weight, rank, world) for proj in (attn.q_proj, attn.k_proj, attn.v_proj)]
        self.qkv.weight.copy_(torch.cat(parts, dim=0).t())
        self.o_proj.weight.copy_(_rows_of(attn.o_proj.weight.t(), rank, world))
        if self.qkv_bias is not None:
            biases = [_rows_of(proj.bias, rank, world) for proj in (attn.q_proj, attn.k_proj, attn.v_proj)]
            self.qkv_bias.copy_(torch.cat(biases))
        if self.o_bias is not None:
            self.o_bias.copy_(attn.o_proj.bias)

    def check_errors(self) -> None:
        self.qkv.check_errors()
        self.o_proj.check_errors()

    def close(self) -> None:
        self.qkv.close()
        self.o_proj.close()


def _rows_of(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=0)[rank]


def _bias_like(linear: nn.Linear, width: int, weight: torch.Tensor) -> nn.Parameter | None:
    if getattr(linear, "bias", None) is None:
        return None
    return nn.Parameter(torch.zeros(width, dtype=weight.dtype, device=weight.device))


def _model_functions(attn: nn.Module, name: str):
    """The rotary and the attention-implementation lookup of the module's own modeling file, so that the
    converted model runs the same functions as the original (whatever `_attn_implementation` says)."""
    source = sys.modules.get(type(attn).__module__)
    apply_rotary = getattr(source, "apply_rotary_pos_emb", None)
    registry = getattr(source, "ALL_ATTENTION_FUNCTIONS", None)
    eager = getattr(source, "eager_attention_forward", None)
    if apply_rotary is None or registry is None or eager is None:
        raise OpInputError(f"{name}: {type(attn).__name__} comes from {type(attn).__module__}, which has no "
                           f"apply_rotary_pos_emb / ALL_ATTENTION_FUNCTIONS / eager_attention_forward: not a "
                           f"Llama-family attention this runtime knows")
    config = attn.config
    return apply_rotary, lambda: registry.get_interface(config._attn_implementation, eager)
