"""Tiny models shared by the engine tests (built from configs; no downloads)."""

from __future__ import annotations

import pytest
import torch

from sidecar.engine.model import ModelConfig, Qwen3WithMTP, build_model


def aligned_draft_model(config: ModelConfig, seed: int, eps: float = 0.002) -> Qwen3WithMTP:
    """A target that is nearly a bigram model, and an MTP layer that copies it by construction.

    The trunk's attention and MLP outputs are scaled by `eps`, so h_t ~ norm(embed(x_t)). The
    MTP layer keeps only the embedding half of eh_proj (identity) and zeroes its own attention
    and MLP outputs, so its logits are lm_head(norm(embed(x_{t+1}))): the target's prediction at
    t+1 up to the eps terms. Acceptance is high but not perfect.
    """
    model = build_model(config, seed=seed)
    h = config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(eps)
            layer.mlp.down_proj.weight.mul_(eps)
        for mtp in model.mtp.layers:
            mtp.eh_proj.weight.zero_()
            mtp.eh_proj.weight[:, :h] = torch.eye(h)
            mtp.self_attn.o_proj.weight.zero_()
            mtp.mlp.down_proj.weight.zero_()
    return model


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return ModelConfig.tiny()


@pytest.fixture(scope="session")
def random_model(tiny_config: ModelConfig) -> Qwen3WithMTP:
    """A random target with a random (misaligned) MTP layer."""
    return build_model(tiny_config, seed=1)


@pytest.fixture(scope="session")
def aligned_model(tiny_config: ModelConfig) -> Qwen3WithMTP:
    return aligned_draft_model(tiny_config, seed=2)
