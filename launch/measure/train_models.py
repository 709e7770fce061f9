"""The models `tp_overlap.launch.train` trains side by side: a `transformers` Llama built from a preset with a
fixed seed (random init, no download; the same weights on every rank of the group), and its tensor-parallel
variants, all sequence-parallel over the same group:

* ours      `tp_overlap.parallelize` (q/k/v and gate/up AllGather, o_proj and down_proj ReduceScatter
            overlapped with their GEMMs);
* dtensor   `parallelize_module` with the torchtitan-style plan of `dtensor_plan` (plain collectives);
* async_tp  the dtensor plan, every decoder layer under `torch.compile` with inductor's micro-pipeline TP
            pass (`_micro_pipeline_tp`), which replaces all_gather+matmul and matmul+reduce_scatter by
            PyTorch's fused symmetric-memory ops where it finds the patterns (CUDA only; `FusionCounter`
            records how many it fused, so a run shows whether async-TP fired at all).

Every variant splits the tokens at the first decoder layer and gathers them before the final norm, so the
embedding, the final norm, the head and the loss are the same replicated computation in all of them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["LlamaPreset", "PRESETS", "build_model", "copy_model", "dtensor_plan", "parallelize_dtensor",
           "enable_async_tp", "FusionCounter"]


@dataclass(frozen=True)
class LlamaPreset:
    """A LlamaForCausalLM shape, and the batch and sequence length of a step that suit it."""
    name: str
    vocab: int
    hidden: int
    ffn_hidden: int
    layers: int
    heads: int
    kv_heads: int
    batch: int
    seq: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        block = attention + 3 * self.hidden * self.ffn_hidden + 2 * self.hidden
        return 2 * self.vocab * self.hidden + self.layers * block + self.hidden

    def config(self, seq: int):
        from transformers import LlamaConfig
        # untied head: a tied one would make the embedding's gradient depend on how each variant splits it
        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn_hidden,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=max(seq, 2048),
                           tie_word_embeddings=False, use_cache=False)


PRESETS = {
    # heads 8, kv heads 4: TP 2 and 4 on CPU; a few seconds for a handful of steps on two cores
    "tiny": LlamaPreset("tiny", vocab=256, hidden=64, ffn_hidden=128, layers=2, heads=8, kv_heads=4, batch=2, seq=32),
    # Llama 3.2 1B's blocks (kv heads 8: TP 2, 4, 8) with a 32k vocabulary: the head and the loss run
    # replicated in every variant, so a 128k one would only dilute the comparison of the blocks
    "llama1b-ish": LlamaPreset("llama1b-ish", vocab=32000, hidden=2048, ffn_hidden=8192, layers=16, heads=32,
                               kv_heads=8, batch=4, seq=2048),
}


def build_model(preset: LlamaPreset, *, seq: int, dtype: torch.dtype, device: torch.device, seed: int,
                group: dist.ProcessGroup) -> nn.Module:
    """The full model, initialised from `seed` on `device`, then broadcast from the group's first rank: every
    rank holds the same weights whatever its device's random generator does."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(preset.config(seq))
    model = model.to(dtype).train()
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=src, group=group)
    return model


def copy_model(model: nn.Module) -> nn.Module:
    """An independent copy (the variants start from identical weights and never share a tensor)."""
    return copy.deepcopy(model)


def dtensor_plan(model: nn.Module) -> dict:
    """torchtitan's sequence-parallel plan, written for transformers' Llama module names.

    Between blocks the residual stream is this rank's slice of the sequence (dim 1) as a plain tensor.
    The attention and the MLP gather it once at their entry (PrepareModuleInput, Shard(1) -> Replicate) and
    receive a plain full-sequence tensor, so attention's `view(*input_shape, -1, head_dim)` sees the whole
    [B, S] and this rank's heads; q/k/v and gate/up are column-parallel on it, o_proj and down_proj
    row-parallel with a reduce-scatter back to Shard(1). Gathering inside q_proj instead
    (ColwiseParallel(input_layouts=Shard(1))) would give [B, S, ...] outputs against an input_shape of
    [B, S/W]: the view would fold W times the heads.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    gather = dict(desired_input_layouts=(Replicate(),), use_local_output=True)
    plan = {
        # the rotary tables and the causal mask are built from the whole sequence before the first layer
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True),
        "model.norm": PrepareModuleInput(input_layouts=(Shard(1),), **gather),
    }
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}."
        plan |= {
            # local output: the decoder layer adds it to the residual, a plain tensor
            prefix + "input_layernorm": SequenceParallel(use_local_output=True),
            prefix + "post_attention_layernorm": SequenceParallel(use_local_output=True),
            # the decoder layer passes the attention's input as a keyword, the MLP's positionally
            prefix + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                     desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                     use_local_output=True),
            prefix + "self_attn.q_proj": ColwiseParallel(),
            prefix + "self_attn.k_proj": ColwiseParallel(),
            prefix + "self_attn.v_proj": ColwiseParallel(),
            prefix + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            prefix + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), **gather),
            prefix + "mlp.gate_proj": ColwiseParallel(),
            prefix + "mlp.up_proj": ColwiseParallel(),
            prefix + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
    return plan


def parallelize_dtensor(model: nn.Module, *, group: dist.ProcessGroup, device: torch.device) -> nn.Module:
    """`model` converted in place by `parallelize_module` over a one-dimensional mesh of `group`."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = DeviceMesh.from_group(group, device.type)
    return parallelize_module(model, mesh, dtensor_plan(model))


class FusionCounter:
    """An inductor post-grad pass that runs after the micro-pipeline TP pass and counts, over every graph
    compiled, the fused symmetric-memory ops it produced and the collectives it left alone (functional
    collectives: `_c10d_functional.all_gather_into_tensor` ...). A plain callable
    (not a CustomGraphPass with a uuid) on purpose: inductor then bypasses its FX graph cache, so a cached
    graph from an earlier run cannot skip the count."""

    FUSED = ("fused_all_gather_matmul", "fused_all_gather_scaled_matmul", "fused_matmul_reduce_scatter",
             "fused_scaled_matmul_reduce_scatter")
    LEFT = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")

    def __init__(self):
        self.counts = {name: 0 for name in self.FUSED + self.LEFT}
        self.graphs = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            parts = str(node.target).split(".")   # e.g. symm_mem.fused_all_gather_matmul.default
            for name in self.FUSED + self.LEFT:
                if name in parts:
                    self.counts[name] += 1

    def summary(self) -> dict:
        fused = sum(self.counts[name] for name in self.FUSED)
        return {"graphs": self.graphs, "fused_ops": fused, "counts": dict(self.counts)}


def enable_async_tp(model: nn.Module, *, group: dist.ProcessGroup) -> FusionCounter:
    """Turn a dtensor-parallel model into torch's async-TP: symmetric memory for `group`, the micro-pipeline
    TP pass on, every decoder layer compiled (as torchtitan does: one compiled code serves every block, so
    compile time does not grow with depth). The compile itself happens at the first call."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory
    if torch.cuda.is_available() and hasattr(_symmetric_memory, "enable_symm_mem_for_group"):
        _symmetric_memory.enable_symm_mem_for_group(group.group_name)
    counter = FusionCounter()
    inductor_config._micro_pipeline_tp = True
    inductor_config.post_grad_custom_post_pass = counter
    for layer in model.model.layers:
        layer.compile()
    return counter
