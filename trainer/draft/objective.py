"""The one draft-training objective of specrl: a draft on the target's *detached* states.

Two draft kinds, one objective (`draft_loss`): the MTP layers (`MTPDraft`, below) and a separate
EAGLE-3 draft (`Eagle3Head`: the engine's `sidecar.model.eagle3` module with the teacher-forced
chain; its input is the target's low/middle/high taps instead of the final hidden state, its
output head its own, over a draft vocabulary the target's distribution is restricted to).

Used by the RL trainer (`trainer.policy.policy` trains the head online on the policy's rollouts) and by
the self-distillation of `specrl draft-init`, tools and benchmarks (`trainer.draft.fit`), so the
draft users get is the draft the benchmarks measure. Pure PyTorch (no megatron): the engines'
model (`sidecar.model`) loads what it trains.

Architecture (DeepSeek-V3 multi-token prediction, arXiv:2412.19437 §2.2; COMMON naming contract):
for draft layer j and position t,

    x_t   = eh_proj(cat([enorm(embed(tok_{t+j+1})), hnorm(h_t)], -1))      # embedding FIRST
    o_t   = DecoderLayer(x)_t   (causal over the layer's own positions, rotary at t+j+1)
    q_t   = softmax(lm_head(shared_head.norm(o_t)) / T)                     # predicts tok_{t+j+2}

with h = the trunk's final-norm hidden states for j = 0 and the previous layer's ``o`` for j > 0
(chain drafting). The embedding and the output head are the trunk's, used *detached*: the draft
owns only its own parameters. The layers are the engine's own ``MTPLayer`` modules (plain
PyTorch, rotary from ``yarn``): one piece of code defines the draft function for trainer and
engine. They are replicated on every tensor-parallel rank (the draft is small) and their
parameter names are already the contract's sub-names (`bridge.export_draft` adds ``mtp.``).

Objective: **soft** by default — the forward KL(p || q) from the target's *detached* distribution
p = softmax(trunk_logits / T) at the position that predicts the same token, over the full
vocabulary. Why: with exact rejection sampling the per-token acceptance probability is
1 - TV(p, q) (Leviathan et al. 2023, arXiv:2211.17192), and TV(p, q) <= sqrt(KL(p || q) / 2)
(Pinsker), so KL(p || q) directly controls acceptance; the sampled tokens (``objective="hard"``,
cross-entropy on the rollout's tokens) are a one-sample Monte-Carlo estimate of the same
cross-entropy with far more variance, and the full distribution is already computed for the
policy's log-probs. (DistillSpec, Zhou et al. 2023, arXiv:2310.08461, reaches the same
conclusion for on-policy draft distillation.)

Isolation: every input from the trunk (hidden states, embeddings, lm_head weight, target logits)
is detached, so the draft loss has no path into the trunk and the policy gradient is bit-identical
with and without draft training (tested). Megatron's built-in MTP loss is not used: it adds its
gradient into the trunk's hidden states (``MTPLossAutoScaler``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from muon import HybridOptimizerConfig
from sidecar.model.eagle3 import Eagle3Draft
from sidecar.model.model import AnyMTPLayer, ModelConfig, mtp_layers
from trainer.schedules import LRScheduleConfig
from yarn import RotaryEmbedding


@dataclass(kw_only=True, slots=True)
class DraftConfig:
    """The draft, all in one place: which kind, whether and how it learns (its objective, its own
    optimizer, clip and schedule). The run config's `draft` section and `Policy.Config.draft`."""

    train: bool = True
    """Update the draft every step on detached states (the MTP layers, or the EAGLE-3 draft); the
    policy gradient is the same either way."""
    eagle3: Path | None = None
    """An EAGLE-3 draft directory (`specrl draft-init --draft-kind eagle3`) for a model without MTP
    layers: local sidecars serve it (`serve --draft`; start remote ones with the same directory),
    the trainer trains it online and every push carries it (`eagle3.*`, DRAFT selector). None: the
    model's own MTP layers."""
    objective: str = "kl"
    """"kl": forward KL to the target's detached distribution (default, see module docstring);
    "hard": cross-entropy on the sampled tokens."""
    loss_weight: float = 1.0
    """Scale of the draft loss (the draft has its own optimizer, so this is its step size knob)."""
    chain_depth: int = 0
    """Teacher-forced chain steps trained: 0 = one per MTP layer; n > layers also trains the last
    layer on its own outputs, as the engine reuses it when drafting k > layers tokens."""
    optimizer: HybridOptimizerConfig = field(default_factory=lambda: HybridOptimizerConfig(lr=1e-4))
    """The draft's own optimizer."""
    clip_grad: float = 1.0
    """Max gradient norm of the draft (its own clip)."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """The draft's learning-rate schedule, per optimizer update."""

    def __post_init__(self) -> None:
        if not self.clip_grad > 0.0:
            raise ValueError(f"draft.clip_grad must be > 0, got {self.clip_grad}")
        if self.objective not in ("kl", "hard"):
            raise ValueError(f"objective must be 'kl' or 'hard', got {self.objective!r}")
        if not self.loss_weight > 0.0:
            raise ValueError(f"loss_weight must be > 0, got {self.loss_weight}")
        if self.chain_depth < 0:
            raise ValueError(f"chain_depth must be >= 0 (0: one step per MTP layer), got {self.chain_depth}")


def init_draft_weights(module: nn.Module, std: float) -> None:
    """A fresh draft's parameters: normal(0, std) matrices, unit norm gains, zero biases
    (deterministic under torch.manual_seed)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)


class MTPDraft(nn.Module):
    """The draft head: the engine's own MTP layers (state-dict keys ``layers.{j}.*``).

    Reusing ``sidecar.model.model.mtp_layers`` makes the trainer's draft function the engine's by
    construction; this class adds the teacher-forced chain the trainer needs.
    """

    def __init__(self, config: ModelConfig, layers: nn.ModuleList | None = None) -> None:
        """A fresh head, or one over existing MTP `layers` (an engine model's `mtp.layers`: the
        parameters are shared, so training the draft trains the served layers)."""
        super().__init__()
        if config.num_nextn_predict_layers < 1:
            raise ValueError("num_nextn_predict_layers must be >= 1 to build a draft head")
        self.layers = layers if layers is not None else mtp_layers(config)
        self.rotary = RotaryEmbedding(config.rope_config())

    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) matrices, unit norm gains (deterministic under torch.manual_seed)."""
        init_draft_weights(self, std)

    def chain(
        self,
        tokens: Tensor,  # (B, S) int64 sample tokens
        hidden: Tensor,  # (B, S, H) trunk hidden after the final norm (detached by the caller)
        embed: Callable[[Tensor], Tensor],  # token ids (B, L) -> (B, L, H) trunk embeddings
        depth: int | None = None,
    ) -> list[Tensor]:
        """Outputs of draft steps j = 0..depth-1 over the whole sequence, teacher-forced.

        Step j uses layer min(j, n-1) and returns (B, S-1-j, H) (before shared_head.norm); its
        position t predicts tokens[:, t+j+2] (the last position of each step predicts past the end).
        """
        depth = len(self.layers) if depth is None else depth
        batch, seq = tokens.shape
        outs: list[Tensor] = []
        h = hidden
        for j in range(depth):
            length = seq - 1 - j
            if length <= 0:
                break
            layer = self.layer(j)
            positions = torch.arange(j + 1, j + 1 + length, device=tokens.device).expand(batch, length)
            cos, sin = self.rotary(positions)  # (B, L, d)
            x = layer.combine(embed(tokens[:, j + 1 : j + 1 + length]), h[:, :length])
            h = layer(x, cos, sin)
            outs.append(h)
        return outs

    def logits(self, j: int, out: Tensor, head: Callable[[Tensor], Tensor]) -> Tensor:  # (B, L, H) -> (B, L, V)
        """Output logits of draft step j through the shared output `head` (hidden -> full vocab)."""
        return head(self.layer(j).head_norm(out))

    def layer(self, j: int) -> AnyMTPLayer:
        """The MTP layer that draft step j uses: min(j, n-1) (chain drafting)."""
        return cast(AnyMTPLayer, self.layers[min(j, len(self.layers) - 1)])

    def restrict(self, target_logits: Tensor) -> Tensor:
        """The target's logits over the draft's vocabulary: all of it."""
        return target_logits


class Eagle3Head(Eagle3Draft):
    """The EAGLE-3 draft (`sidecar.model.eagle3`, the engine's and SGLang's module, the same
    parameter names) with what `draft_loss` asks of a draft besides the module's own teacher-forced
    `chain` (EAGLE-3's training-time test in the form the engine drafts). Its input is the target's
    low/middle/high taps (`trainer.policy.gpt.forward_taps`), not the final hidden state."""

    @classmethod
    def of(cls, draft: Eagle3Draft) -> Eagle3Head:
        """A trainable copy of a served draft (weights and token maps)."""
        head = cls(draft.config).to(device=draft.fc.weight.device, dtype=draft.fc.weight.dtype)
        head.load_state_dict(draft.state_dict())
        return head

    @property
    def layers(self) -> list[nn.Module]:
        """One draft layer (the midlayer), reused at every chain step."""
        return [self.midlayer]

    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) matrices, unit norm gains; the token maps (buffers) are kept."""
        init_draft_weights(self, std)

    def logits(self, j: int, out: Tensor, head: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """Draft logits over the draft vocabulary (its own lm_head; `head` is not used)."""
        return self.draft_logits(out)

    def restrict(self, target_logits: Tensor) -> Tensor:
        """The target's logits at the draft vocabulary's ids (d2t), renormalised by the softmax
        that follows: the distribution the draft can match (the full one when nothing is cut)."""
        if self.config.draft_vocab_size == self.config.vocab_size:
            return target_logits
        return target_logits.index_select(-1, self.draft_to_target())


DraftHead = MTPDraft | Eagle3Head
"""Either draft kind, as `draft_loss` trains it."""


def draft_step_tokens(cfg: DraftConfig, layers: int, mask: Tensor) -> list[float]:  # mask: (B, S-1)
    """Response tokens each draft step of `draft_loss` is averaged over, for the whole batch."""
    seq = mask.shape[1] + 1
    depth = cfg.chain_depth or layers
    return [float(mask[:, j + 1 : j + 1 + seq - 2 - j].sum()) for j in range(depth) if seq - 2 - j > 0]


def draft_loss(
    draft: DraftHead,
    cfg: DraftConfig,
    tokens: Tensor,  # (B, S) int64
    hidden: Tensor,  # (B, S, H) trunk final-norm hidden states (MTP), or (B, S, 3H) taps (EAGLE-3)
    target_logits: Tensor,  # (B, S, V) trunk logits, full vocabulary
    mask: Tensor,  # (B, S-1) 1 where tokens[:, 1:] are response tokens (the policy's loss mask)
    embed: Callable[[Tensor], Tensor],  # ids -> trunk embeddings (B, L, H)
    head: Callable[[Tensor], Tensor],  # (B, L, H) -> (B, L, V) the trunk's output head, weight detached
    temperature: float = 1.0,  # the rollout's; both distributions are softmax(logits / T), T = 1 if 0
    step_tokens: list[float] | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mean draft loss over response tokens, all draft steps; every trunk input is detached here
    (`head` must use a detached weight: `trainer.policy.gpt.shared_head`).

    `step_tokens`: the whole batch's token count of each draft step (`draft_step_tokens`) when this
    is one micro-batch of it; the loss and metrics are then this micro-batch's share and sum up."""
    hidden, target_logits = hidden.detach(), target_logits.detach()

    def detached_embed(ids: Tensor) -> Tensor:
        with torch.no_grad():
            return embed(ids)

    t = temperature if temperature > 0 else 1.0
    if cfg.objective == "hard" and draft.restrict(target_logits[:1, :1]).shape[-1] != target_logits.shape[-1]:
        raise ValueError(
            "objective 'hard' needs the full vocabulary: a reduced EAGLE-3 draft vocabulary cannot score "
            "tokens outside it; use objective 'kl'"
        )
    outs = draft.chain(tokens, hidden, detached_embed, depth=cfg.chain_depth or None)
    target_logits = draft.restrict(target_logits)
    seq = tokens.shape[1]
    total = hidden.new_zeros(())
    metrics: dict[str, float] = {}
    for j, out in enumerate(outs):
        n = seq - 2 - j  # positions whose target token tokens[:, t+j+2] exists
        if n <= 0:
            break
        m = mask[:, j + 1 : j + 1 + n].to(torch.float32)  # (B, n): is tokens[:, t+j+2] a response token
        logq = torch.log_softmax(draft.logits(j, out[:, :n], head).float() / t, dim=-1)
        if cfg.objective == "kl":
            logp = torch.log_softmax(target_logits[:, j + 1 : j + 1 + n].float() / t, dim=-1)
            per_tok = F.kl_div(logq, logp, reduction="none", log_target=True).sum(-1)  # KL(p || q), (B, n)
        else:
            per_tok = -logq.gather(-1, tokens[:, j + 2 : j + 2 + n, None])[..., 0]
        count = max(step_tokens[j], 1.0) if step_tokens is not None else m.sum().clamp_min(1.0)
        loss_j = (per_tok * m).sum() / count
        with torch.no_grad():
            agree = (logq.argmax(-1) == target_logits[:, j + 1 : j + 1 + n].argmax(-1)).float()
            metrics[f"draft_loss_{j}"] = float(loss_j)
            metrics[f"draft_top1_agree_{j}"] = float((agree * m).sum() / count)
        total = total + loss_j
    loss = cfg.loss_weight * total / max(len(outs), 1)
    metrics["draft_loss"] = float(loss.detach())
    return loss, metrics
