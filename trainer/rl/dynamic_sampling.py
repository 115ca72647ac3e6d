"""DAPO dynamic sampling with refill, and DAPO overlong reward shaping, over scored groups.

DAPO (Yu et al. 2025, arXiv:2503.14476, section 3.2) drops groups whose G rewards are all equal
(zero advantage, no gradient) and *keeps sampling* until the batch holds the configured number of
groups that carry signal. Dropping without refilling (what a mask alone does) makes the effective
batch shrink as the policy gets good or bad at a prompt. Here each refill round draws fresh
prompts for the missing groups, with a bounded number of rounds; a step that stays short is
reported, never silent. Overlong shaping (section 3.4) adds `trainer.policy.losses.overlong_penalty` to
the reward of responses in the last `buffer_len` tokens before the maximum length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from sidecar.types import Sample
from trainer.policy.losses import OverlongConfig, group_keep_mask, overlong_penalty
from trainer.rl.tasks import Problem


@dataclass(kw_only=True, slots=True)
class Group:
    """One prompt's G samples with their (shaped) rewards."""

    prompt: list[int]
    samples: list[Sample]
    """Sorted by sample index."""
    rewards: Tensor
    """(G,) float32 reward used for the advantage (task reward + overlong penalty)."""
    task_rewards: Tensor
    """(G,) float32 task reward alone (what `reward/train_mean` reports)."""
    problem: Problem | None = None
    """What the prompt asks (to reward a regenerated group)."""
    reward_terms: dict[str, Tensor] = field(default_factory=dict)
    """(G,) each reward term's values by name, for a task with several terms (their weighted sum
    is `task_rewards`); empty for a task with one."""
    loss_masks: list[list[int]] | None = None
    """Per sample, 1 on the tokens the loss counts (a multi-turn episode's own turns) and 0 on the
    environment's observations; None: every generated token counts."""

    @property
    def informative(self) -> bool:
        """Not all G rewards equal: the group carries a policy gradient."""
        return bool(group_keep_mask(self.rewards[None, :])[0])


def shaped_rewards(task_rewards: Tensor, lengths: Tensor, overlong: OverlongConfig | None) -> Tensor:  # (G,), (G,)
    """Task rewards plus DAPO's soft overlong penalty (None: unshaped)."""
    if overlong is None:
        return task_rewards.float()
    return task_rewards.float() + overlong_penalty(lengths, overlong)


@dataclass(kw_only=True, slots=True)
class Selection:
    """The groups a step trains on, and how they were found."""

    groups: list[Group]
    """Exactly `wanted` groups: informative ones first (first round, then refills), padded with
    the first round's uninformative groups when the refills fell short (masked out of the loss)."""
    informative: int
    """How many of `groups` carry signal."""


def select_groups(first: list[Group], refills: list[Group], wanted: int, filter_equal: bool) -> Selection:
    """The step's groups: with `filter_equal`, informative groups of all rounds (in order) up to
    `wanted`, then first-round uninformative groups to keep the batch's shape; without it, the
    first round as it came."""
    if not filter_equal:
        return Selection(groups=first[:wanted], informative=sum(g.informative for g in first[:wanted]))
    useful = [g for g in first + refills if g.informative][:wanted]
    filler = [g for g in first if not g.informative][: wanted - len(useful)]
    return Selection(groups=useful + filler, informative=len(useful))


def group_samples(prompts: list[list[int]], samples: list[Sample], per_prompt: int) -> list[list[Sample]]:
    """Samples (sorted by prompt, sample index) split into one list per prompt."""
    out: list[list[Sample]] = [[] for _ in prompts]
    for s in samples:
        out[s.prompt_index].append(s)
    if any(len(g) != per_prompt for g in out):
        raise ValueError(f"expected {per_prompt} samples per prompt, got {[len(g) for g in out]}")
    return out
