"""Fit the MTP draft to the target's own outputs (self-distillation on detached states).

An honest draft for tests and benchmarks when no in-domain draft exists: sample
continuations from the target itself, then train the MTP layers with the RL trainer's own
objective (`trainer.draft.objective.draft_loss`: forward KL(p || q) to the target's
distribution on detached trunk states, teacher-forced chain positions), so the benchmarks
measure the draft the product trains. The trunk, the embedding and the shared output head
never change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.model import Qwen3WithMTP
from sidecar.types import GenerationRequest, SamplingParams
from trainer.draft.objective import DraftConfig, MTPDraft, draft_loss


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
    chain_depth: int = 0
    """Chain steps trained (DraftConfig.chain_depth: 0 = one per MTP layer; more trains the last
    layer on its own outputs, as the engine reuses it for drafts beyond the layers)."""

    def __post_init__(self) -> None:
        for name in ("num_sequences", "prompt_length", "new_tokens", "steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.chain_depth < 0:
            raise ValueError(f"chain_depth must be >= 0 (0: one step per MTP layer), got {self.chain_depth}")


def init_draft_from_embedding(model: Qwen3WithMTP) -> None:
    """Start MTP layer 0 as the "bigram" draft: logits = lm_head(norm(embed(x_{t+1}))).

    The projection (eh_proj) passes the normed next-token embedding through and drops h_t; the layer's
    attention and MLP outputs start at zero (residual identity). Training then adds context.
    """
    mtp, h = model.mtp_layer(0), model.config.hidden_size
    embedding = slice(h, 2 * h) if mtp.hidden_first else slice(0, h)  # the projection's embedding half
    with torch.no_grad():
        mtp.proj.weight.zero_()
        mtp.proj.weight[:, embedding] = torch.eye(h)
        mtp.self_attn.o_proj.weight.zero_()
        for name, p in mtp.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.startswith("mlp.") and name.endswith("down_proj.weight"):  # every expert's, if it routes
                p.zero_()


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


def fit_draft(
    model: Qwen3WithMTP, cfg: DraftFitConfig, progress: Callable[[int, float], None] | None = None
) -> list[float]:
    """Train the MTP layers in place on the target's continuations; returns the loss per step.

    The loss is the trainer's (`draft_loss`, objective "kl"). `progress(step, loss)` is called
    after every step (tools print it).
    """
    if model.config.num_nextn_predict_layers == 0:
        raise ValueError("the model has no MTP layer to fit (num_nextn_predict_layers = 0)")
    device = model.output_weight().device
    ids = target_continuations(model, cfg).to(device)  # (N, T)
    with torch.no_grad():
        hidden = model.hidden_states(ids)  # (N, T, hidden), detached: the trunk is not trained
        target_logits = model.logits(hidden)  # (N, T, V)
    mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    mask[:, max(cfg.prompt_length - 1, 0) :] = 1.0  # tokens[:, 1:] from the continuation on, not the random prompt
    draft = MTPDraft(model.config, layers=model.draft_layers)
    objective = DraftConfig(objective="kl", chain_depth=cfg.chain_depth)
    weight = model.output_weight()

    def head(h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, weight.detach())

    params = list(model.mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg.lr)
    losses: list[float] = []
    temperature = cfg.temperature if cfg.temperature > 0 else 1.0
    try:
        for _ in range(cfg.steps):
            loss, _metrics = draft_loss(
                draft, objective, ids, hidden, target_logits, mask, model.model.embed_tokens, head, temperature
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if progress is not None:
                progress(len(losses), losses[-1])
    finally:
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    return losses
