"""Whole-model conversion: `parallelize(model, group=..., max_tokens=...)` turns a `transformers` Llama-family
model into a sequence-parallel TP model whose every AllGather and ReduceScatter is overlapped (convert.py);
the plan of roles (plan.py), the converted attention (attention.py) and norm (norm.py), the sequence-parallel
collectives (sequence.py), checkpoints under the original names (state.py)."""

from .convert import ParallelModel, parallelize
from .plan import ROLES, llama_plan

__all__ = ["parallelize", "ParallelModel", "llama_plan", "ROLES"]
