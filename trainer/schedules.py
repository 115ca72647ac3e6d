"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.

The usual LLM fine-tuning shape (warm-up protects Adam's second-moment estimates and Muon's
momentum in the first updates; decay to a floor ends the run at a small step). A schedule is a
multiplier of each optimizer group's base lr, applied through `torch.optim.lr_scheduler.LambdaLR`
on the `HybridOptimizer`, so Muon's and AdamW's groups move together and the scheduler's state
is checkpointed with the optimizer's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(kw_only=True, slots=True)
class LRScheduleConfig:
    """lr(update u) = base lr x factor(u), u counting optimizer updates from 0."""

    warmup_steps: int = 0
    """Updates of linear warm-up from base/(warmup_steps) to base (0: none)."""
    decay: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warm-up, down to `min_lr_ratio` x base at `total_steps`."""
    min_lr_ratio: float = 0.0
    """Floor of the decay, as a fraction of the base lr."""
    total_steps: int = 0
    """Updates the decay spans (warm-up included); 0: the run's own (steps x updates per batch)."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.total_steps < 0:
            raise ValueError(f"total_steps must be >= 0 (0: the run's length), got {self.total_steps}")
        if self.decay not in ("constant", "linear", "cosine"):
            raise ValueError(f"decay must be 'constant', 'linear' or 'cosine', got {self.decay!r}")

    def factor(self, update: int, total: int | None = None) -> float:
        """The lr multiplier of update `update` (0-based) in a run of `total` updates."""
        total = self.total_steps or total or 0
        if self.warmup_steps and update < self.warmup_steps:
            return (update + 1) / self.warmup_steps
        if self.decay == "constant" or total <= self.warmup_steps:
            return 1.0
        progress = min(1.0, (update - self.warmup_steps) / max(1, total - self.warmup_steps))
        shape = 1.0 - progress if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRScheduleConfig, total: int | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepping `optimizer`'s groups by `cfg.factor` (call `.step()` after each update)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: cfg.factor(update, total))
