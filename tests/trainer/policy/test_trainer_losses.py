"""GRPO/DAPO losses against numbers worked out by hand (in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.policy.losses import (
    GRPOConfig,
    OverlongConfig,
    group_advantages,
    group_keep_mask,
    k3_kl,
    mismatch_metrics,
    overlong_penalty,
    policy_loss,
    sample_advantages,
)


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.5, 1.0]])
    cfg = GRPOConfig(std_eps=1e-6)
    adv = group_advantages(rewards, cfg)
    # group 0: mean 1/3, centred (2/3, -1/3, -1/3), unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3
    s = math.sqrt(1.0 / 3.0) + 1e-6
    assert adv[0].tolist() == pytest.approx([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s], abs=1e-6)
    # group 1: all equal -> centred zeros (0 / eps = 0)
    assert adv[1].tolist() == [0.0, 0.0, 0.0]
    # group 2: mean 0.5, centred (-0.5, 0, 0.5), unbiased std = sqrt(0.5 / 2) = 0.5
    assert adv[2].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-5)
    # Dr. GRPO: centring only
    assert group_advantages(rewards, GRPOConfig(normalize_std=False))[0].tolist() == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3], abs=1e-7
    )
    # dynamic filtering keeps groups 0 and 2 only
    assert group_keep_mask(rewards).tolist() == [True, False, True]
    adv_flat, keep = sample_advantages(rewards, cfg)
    assert keep.tolist() == [True] * 3 + [False] * 3 + [True] * 3
    assert adv_flat[6:].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-5)
    assert sample_advantages(rewards, GRPOConfig(filter_equal_groups=False))[1].all()


def _example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # sample 0: A = +1, ratios 1.5, 1.0, 0.5, all tokens count
    # sample 1: A = -2, ratios 1.5, 0.5, (padding)
    old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.5, 1.0, 0.5], [1.5, 0.5, 1.0]])).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logp, old, adv, mask


def test_policy_loss_clipping_both_sides_token_level() -> None:
    logp, old, adv, mask = _example()
    out = policy_loss(logp, old, adv, mask, GRPOConfig(eps_low=0.2, eps_high=0.28))
    # per token -min(r A, clip(r, 0.8, 1.28) A):
    #   s0: r=1.5 -> -min(1.5, 1.28) = -1.28;  r=1 -> -1;  r=0.5 -> -min(0.5, 0.8) = -0.5
    #   s1: r=1.5 -> -min(-3, -2.56) = 3;      r=0.5 -> -min(-1, -1.6) = 1.6
    # token level: (-1.28 - 1 - 0.5 + 3 + 1.6) / 5 = 0.364
    assert out.loss.item() == pytest.approx(0.364, abs=1e-6)
    assert out.metrics["clip_frac_high"] == pytest.approx(1 / 5)  # s0 t0 (r > 1.28, A > 0)
    assert out.metrics["clip_frac_low"] == pytest.approx(1 / 5)  # s1 t1 (r < 0.8, A < 0)
    out.loss.backward()
    # d loss / d logp = -r A / 5 where unclipped, 0 where clipped, 0 on padding
    expected = torch.tensor([[0.0, -0.2, -0.1], [0.6, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_policy_loss_sequence_level() -> None:
    logp, old, adv, mask = _example()
    out = policy_loss(logp, old, adv, mask, GRPOConfig(eps_low=0.2, eps_high=0.28, token_level=False))
    # s0 mean = -2.78 / 3; s1 mean = 4.6 / 2 = 2.3; average of the two
    assert out.loss.item() == pytest.approx((-2.78 / 3 + 2.3) / 2, abs=1e-6)


def test_filtered_group_contributes_nothing() -> None:
    logp, old, adv, mask = _example()
    keep = torch.tensor([True, False])  # drop sample 1 as if its group were filtered
    out = policy_loss(logp, old, adv, mask * keep[:, None], GRPOConfig(eps_low=0.2, eps_high=0.28))
    assert out.loss.item() == pytest.approx((-1.28 - 1 - 0.5) / 3, abs=1e-6)


def test_k3_kl_and_penalty() -> None:
    logp = torch.log(torch.tensor([[0.25, 0.5]]))
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    # r = ref - logp = ln 2 and 0: k3 = 2 - ln 2 - 1 and 0
    assert k3_kl(logp, ref).tolist()[0] == pytest.approx([1 - math.log(2), 0.0], abs=1e-6)
    adv = torch.zeros(1)
    out = policy_loss(logp, logp.detach(), adv, torch.ones(1, 2), GRPOConfig(kl_coef=0.5), ref_logprobs=ref)
    assert out.loss.item() == pytest.approx(0.5 * (1 - math.log(2)) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, logp, adv, torch.ones(1, 2), GRPOConfig(kl_coef=0.5))


def test_overlong_penalty_by_hand() -> None:
    cfg = OverlongConfig(max_len=10, buffer_len=4, penalty=1.0)
    # no penalty up to 6, ramp (6 - L) / 4 up to 10, -1 beyond
    got = overlong_penalty(torch.tensor([5, 6, 8, 10, 11]), cfg)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])


def test_mismatch_metrics() -> None:
    train = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.1]]))
    m = mismatch_metrics(train, rollout, torch.tensor([[1, 1, 0]]))
    # ratios 1.0 and 0.8 (the third token is masked out)
    assert m["mismatch_abs_ratio_mean"] == pytest.approx(0.1, abs=1e-6)
    assert m["mismatch_abs_ratio_max"] == pytest.approx(0.2, abs=1e-6)
    assert m["mismatch_logprob_abs_mean"] == pytest.approx(-math.log(0.8) / 2, abs=1e-6)
    assert m["mismatch_logprob_abs_max"] == pytest.approx(-math.log(0.8), abs=1e-6)


def test_mismatch_gap_mean_and_p99_by_hand() -> None:
    """101 compared tokens whose gaps are 0, 0.01, ..., 1.00 nats (signs alternating, order shuffled,
    padding and masked tokens carrying huge gaps): mean 0.5, p99 0.99 (linear interpolation between
    order statistics: rank 0.99 * 100 = 99 exactly), max 1.0."""
    gaps = torch.arange(101, dtype=torch.float64) / 100
    signed = gaps * torch.where(torch.arange(101) % 2 == 0, 1.0, -1.0).double()
    order = torch.randperm(101, generator=torch.Generator().manual_seed(0))
    rollout = -torch.rand(3, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 2.0
    mask = torch.zeros(3, 40)
    where = torch.randperm(120, generator=torch.Generator().manual_seed(2))[:101]
    mask.view(-1)[where] = 1.0
    train = rollout + 50.0  # masked-out tokens: a 50-nat gap that must not count
    train.view(-1)[where] = rollout.view(-1)[where] + signed[order]
    m = mismatch_metrics(train, rollout, mask)
    assert m["mismatch_logprob_abs_mean"] == pytest.approx(0.5, abs=1e-12)
    assert m["mismatch_logprob_abs_p99"] == pytest.approx(0.99, abs=1e-12)
    assert m["mismatch_logprob_abs_max"] == pytest.approx(1.0, abs=1e-12)
    # negative control: one masked 50-nat token let in (102 gaps: p99 at rank 0.99 * 101 = 99.99,
    # between 0.99 and 1.00; the mean (50.5 + 50) / 102)
    mask.view(-1)[next(i for i in range(120) if i not in set(where.tolist()))] = 1.0
    leaked = mismatch_metrics(train, rollout, mask)
    assert leaked["mismatch_logprob_abs_p99"] == pytest.approx(0.9999, abs=1e-9)
    assert leaked["mismatch_logprob_abs_mean"] == pytest.approx(100.5 / 102, abs=1e-9)
    assert leaked["mismatch_logprob_abs_max"] == pytest.approx(50.0, abs=1e-9)
    empty = mismatch_metrics(train, rollout, torch.zeros(3, 40))
    assert empty["mismatch_logprob_abs_mean"] == empty["mismatch_logprob_abs_p99"] == 0.0


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="eps_low"):
        GRPOConfig(eps_low=1.5)
    with pytest.raises(ValueError, match="buffer_len"):
        OverlongConfig(max_len=4, buffer_len=8)


def test_truncated_importance_weights_by_hand() -> None:
    """Asynchronous RL: tokens sampled by an older policy are weighted by min(pi_prox / pi_behaviour,
    cap). On-policy ratio 1 (old = current), so each token's loss is -w * A and its gradient
    with respect to its log-prob is -w * A / tokens."""
    logp = torch.log(torch.tensor([[0.5, 0.4, 0.2, 0.1]])).requires_grad_()
    old = logp.detach()
    # behaviour probabilities: w = 0.5/0.25 = 2 (at the cap), 0.4/0.1 = 4 (truncated to 2),
    # 0.2/0.4 = 0.5, 0.1/0.1 = 1
    behaviour = torch.log(torch.tensor([[0.25, 0.1, 0.4, 0.1]]))
    adv, mask = torch.tensor([1.5]), torch.ones(1, 4)
    out = policy_loss(logp, old, adv, mask, GRPOConfig(importance_cap=2.0), behaviour_logprobs=behaviour)
    w = torch.tensor([2.0, 2.0, 0.5, 1.0])
    assert float(out.loss.detach()) == pytest.approx(float(-(w * 1.5).sum() / 4), abs=1e-6)
    out.loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx((-w * 1.5 / 4).tolist(), abs=1e-6)
    assert out.metrics["is_weight_mean"] == pytest.approx(5.5 / 4, abs=1e-6)
    assert out.metrics["is_weight_clipped_frac"] == pytest.approx(1 / 4)  # only the 4 was cut (2 is not above)


def test_importance_weights_are_one_when_the_behaviour_policy_is_the_trainers() -> None:
    """Lag 0: behaviour log-probs equal the proximal ones, every weight is exactly 1 and the loss
    and gradient are those of the uncorrected surrogate."""
    torch.manual_seed(0)
    base = torch.randn(3, 5)
    adv, mask = torch.tensor([1.0, -0.5, 0.25]), (torch.rand(3, 5) > 0.3).float()
    old = base - 0.1 * torch.randn(3, 5)
    a = base.clone().requires_grad_()
    b = base.clone().requires_grad_()
    plain = policy_loss(a, old, adv, mask, GRPOConfig())
    corrected = policy_loss(b, old, adv, mask, GRPOConfig(), behaviour_logprobs=old.clone())
    assert float(corrected.loss.detach()) == float(plain.loss.detach())
    plain.loss.backward()
    corrected.loss.backward()
    assert a.grad is not None and b.grad is not None
    assert torch.equal(a.grad, b.grad)
    assert corrected.metrics["is_weight_mean"] == pytest.approx(float(mask.sum() / mask.sum()))
    assert corrected.metrics["is_weight_clipped_frac"] == 0.0


def test_an_importance_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="importance_cap must be >= 1"):
        GRPOConfig(importance_cap=0.5)
