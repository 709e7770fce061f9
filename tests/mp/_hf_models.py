"""Tiny transformers models for the parallelize tests: every rank builds the same full model from a seed."""

from __future__ import annotations

import torch

VOCAB = 96


def tiny(family: str = "llama", *, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
         ffn: int = 48, seed: int = 0, dtype: torch.dtype = torch.float32, **extra):
    """A random-init causal LM of `family` (llama | mistral | qwen2) with hidden = heads * head_dim."""
    import transformers

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, name) for name in classes[family])
    config = config_cls(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=ffn,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        max_position_embeddings=128, attn_implementation="eager", **extra)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():   # norms and biases away from their init so that a wrong gradient of them shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=gen).to(dtype) * 0.1)
    return model


def batch(step: int, *, batch_size: int = 2, seq: int = 6) -> torch.Tensor:
    """The token ids of a step: fresh random tokens, the same on every rank."""
    return torch.randint(0, VOCAB, (batch_size, seq), generator=torch.Generator().manual_seed(1000 + step))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
