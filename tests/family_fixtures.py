"""Tiny random checkpoints of the dense families as transformers writes them (no downloads).

Each case is a transformers model class with a config of `SHAPE`, built under a seed, with random
q/k/v biases and norm gains (transformers initialises biases to zero and norms to one, which would
hide a missing bias or a misplaced norm); `save_pretrained` of it is the checkpoint a user has.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers

SHAPE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "qwen2-untied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": False}),
    "qwen2-tied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "llama-tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"tie_word_embeddings": True, "rope_parameters": LLAMA3},
    ),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Random biases and norms (transformers zeroes biases and sets norms to 1 at init)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)


@functools.cache
def hf_model(case: str, seed: int = 0) -> Any:
    config_cls, model_cls, overrides = CASES[case]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(SHAPE | overrides))).eval()
    randomise(model, seed)
    return model
