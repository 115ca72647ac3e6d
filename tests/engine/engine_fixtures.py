"""Model builders shared by the engine tests (tiny, from configs; no downloads)."""

from __future__ import annotations

import torch

from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import SamplingParams


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


def hf_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:  # (..., V) -> (..., V)
    """The filtered sampling distribution by Hugging Face's own logits warpers (the oracle for
    temperature -> top-k -> top-p); greedy is one-hot on the argmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if sp.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scores = TemperatureLogitsWarper(sp.temperature)(None, logits.clone())
    if sp.top_k:
        scores = TopKLogitsWarper(sp.top_k)(None, scores)
    if sp.top_p < 1:
        scores = TopPLogitsWarper(sp.top_p)(None, scores)
    return scores.softmax(-1)
