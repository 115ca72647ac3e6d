"""DAPO as documented: dynamic sampling refills filtered groups up to the configured batch (bounded,
reported), overlong shaping changes the rewards the advantages see, and a frozen reference policy
supplies the KL penalty's log-probs.

The loop test runs `rl_step` against an in-memory fleet whose samples and rewards are fixed by a
rule (a problem is informative iff its number is divisible by 3), so the oracle is that rule
applied to every prompt the fleet was asked for.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.trainer.rl.loop_fakes import FakeFleet, RecordingPolicy, RuleTask
from trainer.draft.objective import DraftConfig
from trainer.policy.losses import OverlongConfig
from trainer.policy.policy import TrainBatch
from trainer.rl.config import RLConfig, RolloutConfig, SidecarsConfig
from trainer.rl.dynamic_sampling import Group, select_groups, shaped_rewards
from trainer.rl.loop import rl_step
from trainer.rl.rollouts import rollout_pipeline
from trainer.rl.run import Run
from trainer.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _group(informative: bool, tag: int) -> Group:
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0]) if informative else torch.zeros(4)
    return Group(prompt=[tag], samples=[], rewards=rewards, task_rewards=rewards)


@settings(max_examples=60, deadline=None)
@given(
    first=st.lists(st.booleans(), min_size=1, max_size=8),
    refills=st.lists(st.booleans(), max_size=12),
    filter_equal=st.booleans(),
)
def test_selection_keeps_the_batch_and_prefers_signal(
    first: list[bool], refills: list[bool], filter_equal: bool
) -> None:
    wanted = len(first)
    a = [_group(x, i) for i, x in enumerate(first)]
    b = [_group(x, 100 + i) for i, x in enumerate(refills)]
    chosen = select_groups(a, b, wanted, filter_equal)
    assert len(chosen.groups) == wanted  # the batch keeps its configured size
    if not filter_equal:
        assert chosen.groups == a
        return
    # oracle: informative groups in the order they were generated, then first-round filler
    useful = [g for g in a + b if g.informative][:wanted]
    assert chosen.groups[: len(useful)] == useful and chosen.informative == len(useful)
    assert all(not g.informative and g in a for g in chosen.groups[len(useful) :])


def test_overlong_shaping_follows_dapo() -> None:
    lengths = torch.tensor([10, 12, 14, 16, 20])
    shaped = shaped_rewards(torch.ones(5), lengths, OverlongConfig(max_len=16, buffer_len=4, penalty=1.0))
    assert shaped.tolist() == pytest.approx([1.0, 1.0, 0.5, 0.0, 0.0])
    assert shaped_rewards(torch.ones(2), torch.tensor([99, 1]), None).tolist() == [1.0, 1.0]


# ---- the loop, against an in-memory fleet -----------------------------------------------------
def _run(refill_rounds: int, steps: int = 1) -> tuple[FakeFleet, RecordingPolicy, list[dict[str, float]]]:
    cfg = RLConfig(
        model=Path("unused"),
        rollout=RolloutConfig(prompts_per_step=6, samples_per_prompt=4, max_new_tokens=4, refill_rounds=refill_rounds),
        sidecars=SidecarsConfig(addresses=["fake:1"]),
    )
    fleet, policy = FakeFleet(), RecordingPolicy()
    run = Run(cfg=cfg, policy=policy, sidecars=fleet, task=RuleTask(), tokenizer=TOK, run_dir=None)  # type: ignore[arg-type]
    with rollout_pipeline(run, 0, steps) as rollouts:
        return fleet, policy, [rl_step(run, s, rollouts) for s in range(steps)]


@pytest.mark.parametrize("refill_rounds", [0, 1, 3, 8])
def test_filtered_groups_are_refilled_up_to_the_batch(refill_rounds: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    fleet, policy, history = _run(refill_rounds, steps=3)
    for batch, metrics in zip(policy.batches, history, strict=True):
        assert batch.tokens.shape[0] == 6 * 4  # the configured batch, always
        counted = [
            TOK.decode([t for t in row.tolist() if t != TOK.pad_id])
            for row, m in zip(batch.tokens, batch.mask, strict=True)
            if m.sum() > 0
        ]
        counted_prompts = {text.split("a")[0].split("b")[0] for text in counted}
        assert all(int(p[1:]) % 3 == 0 for p in counted_prompts)  # only groups with signal count
        assert metrics["rollout/refill_rounds"] <= refill_rounds  # bounded
        # oracle: informative prompts among everything this step asked the fleet for
        assert metrics["rollout/kept_fraction"] * 6 == pytest.approx(min(6, len(counted) // 4))
    asked_informative = sum(int(p[1:]) % 3 == 0 for p in fleet.asked)
    assert fleet.calls == 3 + sum(int(m["rollout/refill_rounds"]) for m in history)
    if refill_rounds == 8:  # enough rounds: every step reaches the configured number of groups
        assert all(m["rollout/kept_fraction"] == 1.0 for m in history), history
        assert asked_informative >= 18
    if refill_rounds == 0:
        assert fleet.calls == 3 and all(m["rollout/refill_rounds"] == 0 for m in history)
    short = [m for m in history if m["rollout/kept_fraction"] < 1.0]
    if refill_rounds and short:  # a step left short says so
        assert "dynamic sampling found" in caplog.text


def test_reference_policy_is_frozen_and_feeds_the_kl() -> None:
    from sidecar.model.checkpoint import model_state_dict
    from sidecar.model.model import ModelConfig, build_model
    from trainer.policy.losses import GRPOConfig
    from trainer.policy.policy import Policy
    from trainer.policy.reference import ReferencePolicy

    mc = ModelConfig.tiny(max_position_embeddings=64)
    state = model_state_dict(build_model(mc, seed=4))
    policy = Policy(mc, Policy.Config(grpo=GRPOConfig(kl_coef=0.5), draft=DraftConfig(train=False)), dict(state))
    reference = ReferencePolicy(mc, dict(state), tensor_parallel=1, temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, mc.vocab_size, (4, 16), generator=gen)
    mask = torch.zeros(4, 15)
    mask[:, 5:] = 1.0
    start = reference.logprobs(tokens)
    assert torch.equal(start, policy.logprobs(tokens))  # the reference is the starting policy
    kls = []
    for _ in range(3):
        batch = TrainBatch(tokens=tokens, mask=mask, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
        batch.ref_logprobs = reference.logprobs(tokens)
        kls.append(policy.train_step(batch)["kl"])
    assert kls[0] == 0.0 and kls[-1] > 0.0  # k3 KL: zero at the reference, positive once moved away
    assert torch.equal(reference.logprobs(tokens), start)  # frozen
    assert not any(p.requires_grad for p in reference.model.parameters())
