"""The frozen reference policy of the KL penalty, held on the trainer.

GRPO's k3 KL term (`trainer.policy.losses.k3_kl`) keeps the policy near a reference, usually the
policy the run started from. The reference is a second megatron-core trunk on the same
tensor-parallel layout as the policy, loaded once from a checkpoint and never updated (no
gradients, no optimizer, eval mode); it scores each step's samples in a forward of its own.
Cost: one more trunk in the trainer's memory and one more forward per step; no draft head.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from sidecar.model.model import ModelConfig
from trainer.policy import bridge, gpt, platform


class ReferencePolicy:
    """A frozen trunk: `logprobs(tokens)` at the rollout temperature, like `Policy.logprobs`."""

    def __init__(
        self, model_config: ModelConfig, tensors: dict[str, Tensor], *, tensor_parallel: int, temperature: float
    ) -> None:
        """Build on the process group and parallel state the `Policy` already set up."""
        self.model_config = model_config
        self.temperature = temperature
        hf = model_config.to_hf_dict()
        self.model = gpt.build_gpt_model(hf, tensor_parallel=tensor_parallel)
        bridge.load_trunk(self.model, tensors, hf)
        self.model.eval()
        self.model.requires_grad_(False)

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, tensor_parallel: int, temperature: float) -> ReferencePolicy:
        from sidecar.model.checkpoint import load_checkpoint

        model_config, tensors = load_checkpoint(path)
        return cls(model_config, tensors, tensor_parallel=tensor_parallel, temperature=temperature)

    def logprobs(self, tokens: Tensor) -> Tensor:  # tokens (B, S) -> (B, S-1) float32
        """log p_ref(tokens[:, t+1] | tokens[:, :t+1]), no grad."""
        with torch.no_grad():
            logits, _ = gpt.forward(self.model, tokens.to(platform.device()))
            return gpt.token_logprobs(logits[:, :-1], tokens[:, 1:].to(logits.device), self.temperature)
