"""RL objectives: GRPO with the DAPO options, KL to a reference, and training–inference mismatch.

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300) replaces PPO's critic with group-relative
advantages: G samples per prompt, each sample's advantage is its reward standardised within its
group, and every token of the sample carries that advantage in a PPO clipped surrogate.

DAPO (Yu et al. 2025, arXiv:2503.14476) adds four changes, each an option here:

- Clip-higher: asymmetric clip range [1 - eps_low, 1 + eps_high] with eps_high > eps_low, so that
  low-probability tokens can gain mass (prevents entropy collapse).
- Dynamic sampling: groups whose rewards are all equal have zero advantage and no gradient; they are
  filtered out (`group_keep_mask`), and the RL loop refills the batch.
- Token-level policy-gradient loss: average over all tokens of the batch instead of first over the
  tokens of each sample, so long samples are not down-weighted.
- Overlong reward shaping: a soft length penalty in the last `buffer_len` tokens before the maximum
  response length (`overlong_penalty`).

The KL penalty to a reference policy uses Schulman's k3 estimator, exp(r) - r - 1 with
r = log pi_ref - log pi (unbiased, non-negative). The importance ratio between the trainer's
recomputed log-probs and the rollout engine's log-probs is reported as a metric (`mismatch_metrics`):
with identical weights it is 1 up to numerics (README, invariant 2). Under asynchronous RL the
samples come from an older policy, and `policy_loss` weights each token by its truncated
importance weight against the sampling policy (decoupled PPO, Hilton et al. 2021,
arXiv:2110.00641, with truncation as in AReaL, arXiv:2505.24298).

All functions are pure over tensors; shapes are given in comments (B samples, T response tokens,
N groups of G samples, B = N * G).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.policy.moe import ROUTING_REPLAY_MODES, RoutingReplay


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    """Knobs of the GRPO/DAPO policy loss. Defaults follow DAPO."""

    eps_low: float = 0.2
    """Lower clip: ratios below 1 - eps_low stop contributing gradient when A < 0."""
    eps_high: float = 0.28
    """Upper clip (DAPO clip-higher): ratios above 1 + eps_high stop contributing when A > 0."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group's standard deviation (GRPO); False keeps only
    the mean-centring (Dr. GRPO)."""
    std_eps: float = 1e-6
    """Added to the group std before dividing (guards all-equal groups)."""
    token_level: bool = True
    """DAPO token-level normalisation (mean over all tokens of the batch); False: GRPO's mean over
    each sample's tokens, then over samples."""
    filter_equal_groups: bool = True
    """DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no signal)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the reference policy; 0 disables it (DAPO's default)."""
    importance_cap: float = 2.0
    """Asynchronous RL (`rollout.max_policy_lag` > 0) only: each token's surrogate is weighted by
    min(pi_prox / pi_behaviour, importance_cap), pi_behaviour the log-probs the sidecar reported
    when it sampled the token (an older policy), pi_prox the trainer's current one (decoupled
    PPO with truncated importance sampling); unused at lag 0, where the two policies agree."""
    routing_replay: RoutingReplay = "off"
    """Mixture-of-experts policies: "rollout" asks the sidecars for each sample's routes (the
    experts the sampler chose for every token in every sparse layer) and replays them in the
    trainer's forwards, the routing weights recomputed from the live router (Rollout Routing
    Replay, arXiv:2510.11370; `trainer.policy.moe`), so the log-probs the loss takes are the sampler's;
    "off" routes live. Without replay the trainer's router picks other experts for some tokens
    (numerics, batch composition) and its log-probs drift from the sampler's far more than a dense
    model's. Needs an MoE policy and sidecars that return routes."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if not self.std_eps > 0.0:
            raise ValueError(f"std_eps must be > 0, got {self.std_eps}")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"kl_coef must be >= 0 (0 disables the KL penalty), got {self.kl_coef}")
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(f"routing_replay must be one of {ROUTING_REPLAY_MODES}, got {self.routing_replay!r}")
        if not self.importance_cap >= 1.0:
            raise ValueError(
                f"importance_cap must be >= 1 (it truncates importance weights, which are 1 on-policy), "
                f"got {self.importance_cap}"
            )


@dataclass(kw_only=True, slots=True)
class OverlongConfig:
    """DAPO soft overlong punishment (eq. 13): no penalty up to max_len - buffer_len, then a
    linear ramp down to -penalty at max_len, and -penalty beyond."""

    max_len: int
    """L_max: the longest response the rollout allows."""
    buffer_len: int
    """L_cache: length of the ramp before L_max."""
    penalty: float = 1.0
    """Penalty at (and beyond) L_max."""

    def __post_init__(self) -> None:
        if self.max_len <= 0:
            raise ValueError(f"max_len must be > 0, got {self.max_len}")
        if not 0 < self.buffer_len <= self.max_len:
            raise ValueError(f"buffer_len must be in (0, max_len={self.max_len}], got {self.buffer_len}")
        if not self.penalty >= 0.0:
            raise ValueError(f"penalty must be >= 0, got {self.penalty}")


def overlong_penalty(lengths: Tensor, cfg: OverlongConfig) -> Tensor:  # lengths: (B,) response lengths
    """The DAPO length penalty (<= 0) to add to each sample's reward. Returns (B,) float32."""
    lengths = lengths.to(torch.float32)
    start = float(cfg.max_len - cfg.buffer_len)
    ramp = (start - lengths) / cfg.buffer_len * cfg.penalty
    zero = torch.zeros_like(lengths)
    out = torch.where(lengths <= start, zero, ramp)
    return torch.where(lengths > cfg.max_len, torch.full_like(lengths, -cfg.penalty), out)


def group_advantages(rewards: Tensor, cfg: GRPOConfig) -> Tensor:  # rewards: (N, G)
    """Group-relative advantages (N, G): (r - mean_g) / (std_g + eps), std unbiased (Bessel),
    or only r - mean_g when `normalize_std` is False."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (groups, samples_per_group >= 2), got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float32)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not cfg.normalize_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=True) + cfg.std_eps)


def group_keep_mask(rewards: Tensor) -> Tensor:  # rewards: (N, G)
    """DAPO dynamic sampling: (N,) bool, False for groups whose rewards are all equal."""
    return (rewards != rewards[:, :1]).any(dim=1)


def sample_advantages(rewards: Tensor, cfg: GRPOConfig) -> tuple[Tensor, Tensor]:  # rewards: (N, G)
    """Per-sample advantages (N*G,) and keep mask (N*G,) bool, group-major (sample g of group n
    at n*G + g). With `filter_equal_groups` the samples of all-equal groups are dropped."""
    adv = group_advantages(rewards, cfg)
    keep = group_keep_mask(rewards) if cfg.filter_equal_groups else torch.ones(rewards.shape[0], dtype=torch.bool)
    keep = keep[:, None].expand_as(rewards)
    return (adv * keep).reshape(-1), keep.reshape(-1)


@dataclass(kw_only=True, slots=True)
class PolicyLossOutput:
    """The scalar loss to backpropagate and detached float metrics."""

    loss: Tensor
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class BatchTotals:
    """Counts of a whole batch that the loss of any part of it is divided by.

    Gradient accumulation: when every micro-batch divides by the *whole* batch's counts, the
    micro-batches' losses (and gradients, and additive metrics) sum to the whole batch's.
    """

    tokens: float
    """Response tokens that count in the loss (mask sum)."""
    samples: float
    """Samples with at least one such token."""

    @classmethod
    def of(cls, mask: Tensor) -> BatchTotals:  # mask: (B, T) 0/1
        return cls(tokens=float(mask.sum()), samples=float((mask.sum(dim=1) > 0).sum()))


def _aggregate(per_token: Tensor, mask: Tensor, token_level: bool, totals: BatchTotals) -> Tensor:
    # per_token, mask: (B, T); mask is float 0/1
    if token_level:
        return (per_token * mask).sum() / max(totals.tokens, 1.0)
    per_sample = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
    present = (mask.sum(dim=1) > 0).to(per_token.dtype)
    return (per_sample * present).sum() / max(totals.samples, 1.0)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:  # both (B, T) -> (B, T)
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(r) - r - 1, r = ref - logp."""
    r = ref_logprobs - logprobs
    return torch.exp(r) - r - 1.0


def policy_loss(
    logprobs: Tensor,  # (B, T) current policy log-probs of the sampled tokens (with grad)
    old_logprobs: Tensor,  # (B, T) log-probs of the policy that the ratio is taken against
    advantages: Tensor,  # (B,) one advantage per sample
    mask: Tensor,  # (B, T) 1 on response tokens that count, 0 on prompt/padding/filtered samples
    cfg: GRPOConfig,
    ref_logprobs: Tensor | None = None,  # (B, T) reference policy log-probs, needed if kl_coef > 0
    totals: BatchTotals | None = None,
    behaviour_logprobs: Tensor | None = None,  # (B, T) the sampling policy's, when it is not `old`'s
) -> PolicyLossOutput:
    """The clipped surrogate of GRPO/DAPO, aggregated per `cfg.token_level`.

    Per token: -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), ratio = exp(logp - old).
    With `behaviour_logprobs` (asynchronous RL: the samples came from an older policy), each
    token's term is multiplied by the truncated importance weight
    w = min(exp(old - behaviour), cfg.importance_cap) (decoupled PPO: `old` is the proximal policy
    the ratio is clipped around, the weight corrects for having sampled from another one).
    `totals`: the whole batch's counts when this is one micro-batch of it (None: this batch's own);
    the loss and every metric except `tokens` are then this micro-batch's share, which sum up.
    """
    mask = mask.to(logprobs.dtype)
    totals = totals or BatchTotals.of(mask)
    adv = advantages.to(logprobs.dtype)[:, None]
    ratio = torch.exp(logprobs - old_logprobs.detach())
    clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    weights = None
    if behaviour_logprobs is not None:
        raw = torch.exp(old_logprobs.detach() - behaviour_logprobs.detach().to(logprobs.dtype))
        weights = raw.clamp(max=cfg.importance_cap)
        per_token = per_token * weights
    loss = _aggregate(per_token, mask, cfg.token_level, totals)
    n = max(totals.tokens, 1.0)
    with torch.no_grad():
        clipped_high = ((ratio > 1.0 + cfg.eps_high) & (adv > 0)).to(mask.dtype)
        clipped_low = ((ratio < 1.0 - cfg.eps_low) & (adv < 0)).to(mask.dtype)
        metrics = {
            "pg_loss": float(loss.detach()),
            "clip_frac_high": float((clipped_high * mask).sum() / n),
            "clip_frac_low": float((clipped_low * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "tokens": float(mask.sum()),
        }
        if weights is not None:
            metrics["is_weight_mean"] = float((weights * mask).sum() / n)
            metrics["is_weight_clipped_frac"] = float(((raw > cfg.importance_cap).to(mask.dtype) * mask).sum() / n)
    if cfg.kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's log-probs); pass them or set 0")
        kl = _aggregate(k3_kl(logprobs, ref_logprobs.detach()), mask, cfg.token_level, totals)
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = float(kl.detach())
    metrics["loss"] = float(loss.detach())
    return PolicyLossOutput(loss=loss, metrics=metrics)


MISMATCH_QUANTILE = 0.99
"""The per-token log-prob gap's reported quantile (`mismatch_logprob_abs_p99`): torch.quantile's
linear interpolation between order statistics (numpy's default), over every compared token."""


def mismatch_metrics(
    train_logprobs: Tensor,  # (B, T) trainer's recomputed log-probs
    rollout_logprobs: Tensor,  # (B, T) log-probs the rollout engine reported for the same tokens
    mask: Tensor,  # (B, T) 1 on response tokens
) -> dict[str, float]:
    """Training–inference mismatch: statistics of |ratio - 1|, ratio = exp(train - rollout), and of
    the per-token log-prob gap |train - rollout| (its mean, its p99 and its maximum, in nats)."""
    with torch.no_grad():
        m = mask.to(torch.bool)
        diff = (train_logprobs.detach().to(torch.float64) - rollout_logprobs.to(torch.float64))[m]
        return mismatch_of_gaps(diff)


def mismatch_of_gaps(diff: Tensor) -> dict[str, float]:  # (N,) train - rollout of every compared token
    """`mismatch_metrics` of the compared tokens' log-prob differences (one flat tensor: a data-parallel
    reduction gathers every replica's and calls this once, so its p99 is the whole batch's, exactly)."""
    if diff.numel() == 0:
        return {
            "mismatch_abs_ratio_mean": 0.0,
            "mismatch_abs_ratio_max": 0.0,
            "mismatch_logprob_abs_mean": 0.0,
            "mismatch_logprob_abs_p99": 0.0,
            "mismatch_logprob_abs_max": 0.0,
        }
    diff = diff.to(torch.float64)
    dev = (torch.exp(diff) - 1.0).abs()
    gap = diff.abs()
    return {
        "mismatch_abs_ratio_mean": float(dev.mean()),
        "mismatch_abs_ratio_max": float(dev.max()),
        "mismatch_logprob_abs_mean": float(gap.mean()),
        "mismatch_logprob_abs_p99": float(torch.quantile(gap, MISMATCH_QUANTILE)),
        "mismatch_logprob_abs_max": float(gap.max()),
    }
