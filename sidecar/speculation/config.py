"""The controller's configuration and the small types it exchanges with the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(kw_only=True, slots=True)
class SpeculationControllerConfig:
    """Knobs of the adaptive controller (defaults are what the engine uses)."""

    max_speculation_k: int
    """Largest k the controller may choose (the 'auto' mode's maximum)."""
    cost_window: int = 5
    """Measurements per (batch bucket, width) whose median is the cost estimate (one probe's
    `min_cost_samples` fresh steps are the majority: a width the controller does not choose is
    measured only by probes, and one measured in a slow minute must not stay dear for long)."""
    min_cost_samples: int = 3
    """Measurements before a width's own cost is trusted over one predicted from the bucket's
    other widths or the nearest bucket (one step's time on a shared machine can be far off)."""
    min_gain: float = 0.03
    """Relative gain over plain decoding that a k > 0 must predict to be chosen, and the relative
    loss within which joining rows are never refused a draft (see the module docstring, "Margin";
    `SpeculationController.may_draft`).
    It covers the model's noise only: stragglers (at greedy batch 4, k = 1 gains ~1.04x per step
    and can lose 4-8% end to end) are priced by `SpeculationController.straggler_factor`."""
    acceptance_halflife: float = 256.0
    """Verify rounds (rows that drafted, summed over steps) after which old acceptance evidence
    weighs half (tracks a drifting draft). Counted in rounds, not engine steps: a plain step brings
    no evidence and ages none, and batch 1 keeps as much evidence as batch 4. Aged per step (64),
    batch 1 kept ~92 rounds, a standard error of ~0.05 on an acceptance of 0.5 and ~5% on tau:
    enough to take a 9% gain of k = 3 to plain for ~23% of the steps with exact costs (simulated:
    `test_acceptance_noise_at_batch_1_does_not_send_a_winning_k_to_plain`; 0.6% at 256 rounds),
    and a stretch at plain forgot the draft's rounds and drifted to the prior. 256 rounds (~370
    of evidence) halve the error; batch 4 keeps what it had (64 steps). The rate of stop tokens
    ages by emitted tokens alike."""
    version_discount: float = 0.01
    """Weight kept by the previous weight version's acceptance counts after a push: at the
    steady-state evidence of ~370 rounds (acceptance_halflife / ln 2) about one engine step's
    worth at batch 4. Measured (BENCHMARKS.md, "Adaptive speculation"): an RL push moves tau by less
    than one step's sampling noise, so the old version is a good prior, while a push that breaks
    the draft must show within a few steps."""
    spread_rows: int = 64
    """Finished rows (of `MIN_ROW_DRAFTS`+ drafts) whose acceptance at draft position 1 estimates
    how much rows differ (`AcceptanceEstimate.spread`; the four rows of one batch are too few)."""
    stop_prior_tokens: float = 8.0
    """Emitted tokens' worth of the overall stop-token rate behind the rate at each output
    position (`StopHazard`): a position seen less than that leans on the overall rate (a few
    rows' worth; 32 had held the rate where the RL workload's rows end at ~0.5 of its ~0.9 for
    the first generations)."""
    prior_acceptance: float = 0.6
    """Acceptance assumed at draft position 1 before any evidence (later positions: the previous
    position's estimate)."""
    prior_strength: float = 2.0
    """Pseudo-rounds behind each position's prior."""
    prior_verify_slope: float = 0.15
    """Extra verify cost per extra token, as a fraction of a plain step, until two widths are measured."""
    prior_draft_cost: float = 0.1
    """Cost of one draft step as a fraction of a plain step until a draft is measured."""
    probe_every: int = 16
    """Steps between probes of a neighbouring k (per bucket); the interval doubles while probes
    do not change the best k, up to `max_probe_every` (a probe of a worse k costs throughput).
    From a bucket at plain decoding a k > 0 predicted within `min_gain` of plain is probed every
    `probe_every` steps, one predicted to lose more less often, in proportion to its loss
    (`SpeculationController.plain_probe_interval`). A k not yet measured `min_cost_samples` times in
    the bucket is probed every `learn_every` steps instead."""
    max_probe_every: int = 256
    learn_every: int = 4
    """Steps between probes while a bucket learns its options' costs (a new batch size), and the
    least spacing of any two probes."""
    refuse_every: int = 16
    """Every `refuse_every`-th admission in a row that `SpeculationController.may_draft` would refuse a
    draft keeps it (so that a bucket at plain can measure that this changed)."""
    guard_rows: int = 96
    """Row-rounds (sum of batch sizes) of model-chosen k > 0 steps whose realised rate the guard
    compares with plain decoding: acceptance is random, so one row's few steps say little."""
    guard_min_steps: int = 8
    """... and at least this many steps (cost noise)."""
    guard_ratio: float = 0.95
    """Back off when realised tokens/s per row < guard_ratio x plain's."""
    guard_outlier: float = 2.0
    """In the guard's window a step counts at most this multiple of the window's median step time:
    the plain cost it compares with is a median that ignores a garbage collection or a host
    hiccup several times a step's time, and the realised rate must ignore it too (one 5x step in 8
    read a 1.34x gain as 0.89x plain). A wrong cost model is slow on every step, and still trips."""
    backoff_steps: int = 32
    """Steps at k = 0 after the guard trips (doubles on consecutive trips)."""
    max_backoff_steps: int = 512
    cost_bias: float = 1.0
    """TEST HOOK: multiplies every predicted k > 0 step cost. < 1 claims speculation is cheaper
    than measured: the guard must catch it. Keep 1.0 in production."""

    def __post_init__(self) -> None:
        if self.max_speculation_k < 0:
            raise ValueError(f"max_speculation_k must be >= 0, got {self.max_speculation_k}")
        for name in ("acceptance_halflife", "prior_strength", "stop_prior_tokens", "cost_bias"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("version_discount", "prior_verify_slope", "prior_draft_cost", "min_gain"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.prior_acceptance < 1:
            raise ValueError(f"prior_acceptance must be in (0, 1), got {self.prior_acceptance}")
        if not 0 < self.guard_ratio <= 1:
            raise ValueError(f"guard_ratio must be in (0, 1], got {self.guard_ratio}")
        if not self.guard_outlier >= 1:
            raise ValueError(f"guard_outlier must be >= 1, got {self.guard_outlier}")
        for name in (
            "cost_window",
            "min_cost_samples",
            "spread_rows",
            "probe_every",
            "max_probe_every",
            "learn_every",
            "refuse_every",
            "guard_rows",
            "guard_min_steps",
            "backoff_steps",
            "max_backoff_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class RowState(NamedTuple):
    """What the controller knows of one row of a batch."""

    length: int
    """Tokens of output so far (where a stop token is likely: `StopHazard`)."""
    left: int | None = None
    """Tokens the row may still emit (its length cap; None: the batch's `tokens_left`)."""


@dataclass(kw_only=True, slots=True)
class SpeculationDecision:
    """One step's choice and why (GetInfo / GetStats / Prometheus show the latest one)."""

    k: int
    reason: str
    """'model' (best predicted k; k = 0 also when joining rows were admitted without a draft,
    `SpeculationController.may_draft`), 'probe' (measuring a neighbour or plain), 'guard' (backed off
    after realised throughput fell below plain), 'collapsed' (k = 0: the served version's draft
    collapsed, `SpeculationController.hold`, until the next weight version), 'off' (max k is 0)."""
    batch_size: int
    expected_speedup: float = 1.0
    """Predicted tokens/s of k over plain decoding's, at this batch size (1.0 when unknown)."""
    detail: str = ""
    """Human-readable explanation (the numbers behind `reason`)."""


def batch_bucket(batch: int) -> int:
    """Buckets of batch sizes sharing cost estimates: exact up to 4, then steps of ~1.25x.

    Costs move with the batch (compute-bound CPUs: ~linearly), so buckets are narrow enough that
    two sizes in one bucket differ by at most 25%."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if batch <= 4:
        return batch
    edge = 4.0
    while edge < batch:
        edge = math.ceil(edge * 1.25)
    return int(edge)
