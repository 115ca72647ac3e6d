"""Fit the MTP draft layer to the target's own outputs (self-distillation on detached states).

An honest draft for tests and benchmarks when no in-domain draft exists: sample
continuations from the target itself, then train MTP layer 0 with cross-entropy to predict
x_{t+2} from (h_t, x_{t+1}), where h_t is the trunk's final-normed hidden state computed
without gradient (the detached-hidden-state objective of the RL trainer, DESIGN.md "Draft
training"). The trunk, the embedding and the shared output head never change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sidecar.engine.model import Qwen3WithMTP
from sidecar.engine.torch_engine import TorchEngine
from sidecar.types import GenerationRequest, SamplingParams


@dataclass(kw_only=True, slots=True)
class DraftFitConfig:
    """How much self-generated data to fit on, and how long."""

    num_sequences: int = 64
    """Continuations sampled from the target."""
    prompt_length: int = 4
    """Random prompt tokens before each continuation."""
    new_tokens: int = 48
    """Tokens generated per continuation."""
    temperature: float = 0.0
    """Sampling temperature of the continuations (0 = the target's greedy outputs)."""
    steps: int = 200
    """Adam steps over the whole set (full batch)."""
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_sequences", "prompt_length", "new_tokens", "steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


def target_continuations(model: Qwen3WithMTP, cfg: DraftFitConfig) -> torch.Tensor:  # (N, P + new) int64
    """Random prompts followed by the target's own continuations (plain decoding)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = torch.randint(0, model.config.vocab_size, (cfg.num_sequences, cfg.prompt_length), generator=gen)
    engine = TorchEngine(model, speculation_k=0, max_batch_size=cfg.num_sequences)
    request = GenerationRequest(
        prompts=prompts.tolist(),
        sampling=SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.new_tokens, seed=cfg.seed),
        request_id="fit-draft",
    )
    samples = engine.generate(request)
    return torch.tensor([p + s.token_ids for p, s in zip(prompts.tolist(), samples, strict=True)])


def fit_draft(model: Qwen3WithMTP, cfg: DraftFitConfig) -> list[float]:
    """Train MTP layer 0 in place on the target's continuations; returns the loss per step."""
    if model.config.num_nextn_predict_layers == 0:
        raise ValueError("the model has no MTP layer to fit (num_nextn_predict_layers = 0)")
    device = model.output_weight().device
    ids = target_continuations(model, cfg).to(device)  # (N, T)
    with torch.no_grad():
        hidden = model.hidden_states(ids)  # (N, T, hidden), detached: the trunk is not trained
    targets = ids[:, 2:]  # x_{t+2} for t = 0..T-3
    weight = torch.zeros_like(targets, dtype=torch.float32)
    weight[:, max(cfg.prompt_length - 2, 0) :] = 1.0  # learn the continuations, not the random prompts
    params = list(model.mtp.layers[0].parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg.lr)
    losses: list[float] = []
    try:
        for _ in range(cfg.steps):
            logits = model.mtp_logits(ids, hidden, layer=0)[:, :-1].float()  # (N, T-2, V)
            ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
            loss = (ce * weight).sum() / weight.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss))
    finally:
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    return losses
