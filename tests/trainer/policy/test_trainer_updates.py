"""How the trainer turns a rollout batch into updates: micro-batches (gradient accumulation),
several updates per batch (PPO epochs / mini-batches) and learning-rate schedules.

Oracles: the unsplit batch's gradients and update (micro-batches must reproduce them; float32
tolerance stated below, since only the summation order differs); the same updates made by hand
with `train_step` on the slices the shuffle picked; the closed-form schedule.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sidecar.model.checkpoint import model_state_dict
from sidecar.model.model import ModelConfig, build_model
from trainer.draft.objective import DraftConfig
from trainer.policy.losses import GRPOConfig
from trainer.policy.policy import Policy, TrainBatch
from trainer.schedules import LRScheduleConfig

MC = ModelConfig.tiny(max_position_embeddings=64)
STATE = model_state_dict(build_model(MC, seed=11))
# float32 tolerance of "identical update": micro-batching changes only the order in which the
# per-token terms are summed (relative error ~1e-7 per addition); measured differences are ~1e-8
# on gradients of magnitude ~1e-2.
ATOL, RTOL = 1e-6, 1e-5


def _policy(**cfg: object) -> Policy:
    torch.manual_seed(0)
    return Policy(MC, Policy.Config(seed=5, **cfg), {k: v.clone() for k, v in STATE.items()})  # type: ignore[arg-type]


def _batch(rows: int = 7, seq: int = 24, seed: int = 0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MC.vocab_size, (rows, seq), generator=gen)
    mask = torch.zeros(rows, seq - 1)
    for i in range(rows):  # prompts of 4-7 tokens, responses of varying length, one filtered row
        start = 3 + i % 4
        mask[i, start : start + 5 + (3 * i) % (seq - start - 5)] = 1.0
    mask[2] = 0.0
    advantages = torch.randn(rows, generator=gen)
    return TrainBatch(tokens=tokens, mask=mask, advantages=advantages)


def _grads(policy: Policy) -> dict[str, torch.Tensor]:
    modules = {"trunk": policy.model, "draft": policy.draft}
    return {
        f"{m}.{n}": p.grad.clone()
        for m, mod in modules.items()
        for n, p in mod.named_parameters()  # type: ignore[union-attr]
        if p.grad is not None
    }


@pytest.mark.parametrize("token_level", [True, False], ids=["token-level", "sample-level"])
def test_micro_batches_give_the_unsplit_update(token_level: bool) -> None:
    grpo = GRPOConfig(token_level=token_level)
    whole, split = _policy(grpo=grpo), _policy(grpo=grpo, micro_batch_rows=3)  # 3 + 3 + 1 rows
    batch = _batch()
    batch.old_logprobs = whole.logprobs(batch.tokens) + 0.05 * torch.randn(batch.mask.shape)  # ratios != 1
    m_whole, m_split = whole.backward(batch), split.backward(batch)
    g_whole, g_split = _grads(whole), _grads(split)
    assert g_whole.keys() == g_split.keys() and any(k.startswith("draft.") for k in g_whole)
    for name in g_whole:
        torch.testing.assert_close(g_split[name], g_whole[name], atol=ATOL, rtol=RTOL, msg=name)
    for key in ("loss", "pg_loss", "clip_frac_high", "clip_frac_low", "ratio_mean", "tokens", "draft_loss"):
        assert m_split[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-6), key
    whole.step(), split.step()
    for (name, a), (_, b) in zip(whole.model.named_parameters(), split.model.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL, msg=name)


def test_several_updates_per_batch_are_the_hand_made_updates() -> None:
    batch = _batch(rows=8, seed=1)
    auto, hand = _policy(), _policy()
    batch.old_logprobs = auto.logprobs(batch.tokens)
    with pytest.raises(ValueError, match="old_logprobs"):
        auto.train_updates(TrainBatch(tokens=batch.tokens, mask=batch.mask, advantages=batch.advantages), epochs=2)
    metrics = auto.train_updates(batch, epochs=2, mini_batches=2, seed=3)
    assert metrics["updates"] == 4 and auto.step_count == 4

    gen = torch.Generator().manual_seed(3)  # the documented shuffle: one permutation per epoch
    first_ratio = None
    for _ in range(2):
        for chunk in torch.randperm(8, generator=gen).tensor_split(2):
            m = hand.train_step(batch.select(chunk))
            first_ratio = m["ratio_mean"] if first_ratio is None else first_ratio
    assert first_ratio == pytest.approx(1.0, abs=1e-6)  # the first update starts on-policy
    for (name, a), (_, b) in zip(auto.model.named_parameters(), hand.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    # later updates moved the policy: it no longer gives the sampling policy's log-probs
    assert (auto.logprobs(batch.tokens) - batch.old_logprobs).abs().max() > 1e-4


def test_schedule_factors_follow_the_closed_form() -> None:
    cos = LRScheduleConfig(warmup_steps=2, decay="cosine", min_lr_ratio=0.1)
    assert [cos.factor(u, 12) for u in (0, 1)] == [0.5, 1.0]
    assert cos.factor(2, 12) == pytest.approx(1.0)
    assert cos.factor(7, 12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos.factor(12, 12) == pytest.approx(0.1) and cos.factor(50, 12) == pytest.approx(0.1)
    lin = LRScheduleConfig(decay="linear", total_steps=4)
    assert [lin.factor(u, 1000) for u in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert LRScheduleConfig().factor(100, 10) == 1.0
    with pytest.raises(ValueError, match="min_lr_ratio"):
        LRScheduleConfig(min_lr_ratio=2.0)


def test_policy_and_draft_lrs_follow_their_schedules_and_resume(tmp_path: Path) -> None:
    from muon import HybridOptimizerConfig

    trunk = LRScheduleConfig(warmup_steps=2, decay="linear")
    draft = LRScheduleConfig(decay="cosine", min_lr_ratio=0.5)
    kw = {
        "optimizer": HybridOptimizerConfig(lr=1e-3),
        "draft": DraftConfig(optimizer=HybridOptimizerConfig(lr=2e-3), lr_schedule=draft),
        "lr_schedule": trunk,
        "total_updates": 6,
    }
    policy = _policy(**kw)
    seen = [policy.train_step(_batch(seed=s)) for s in range(3)]
    assert [m["lr"] for m in seen] == pytest.approx([1e-3 * trunk.factor(u, 6) for u in range(3)])
    assert [m["draft_lr"] for m in seen] == pytest.approx([2e-3 * draft.factor(u, 6) for u in range(3)])
    policy.save(tmp_path / "ckpt")
    resumed = _policy(**kw)
    resumed.load(tmp_path / "ckpt")
    assert resumed.train_step(_batch(seed=9))["lr"] == pytest.approx(1e-3 * trunk.factor(3, 6))
