"""Adaptive speculation: choose the draft length k of each engine step from measured costs.

Why: whether speculation pays depends on the hardware, the batch size and the draft's current
acceptance (BENCHMARKS.md, "Embedded engine": every static k from 1 to 7 lost 25-70% at batch
>= 16 on a CPU, while k = 3 won 1.5x on the demo's 8-row batches). So k is a decision made per
engine step, not a constant (DESIGN.md, "Speculation policy"):

    choose k in {0..K} maximising   E[tokens per row | k] / (cost(B, k) * stragglers(B, k, rows))
    E[tokens per row | k] = mean over the rows of 1 + sum_{i=1..k} S_i prod_{j<=i} alpha_j
                            (alpha_j: acceptance of draft position j given all before it
                            accepted; S_i: P(none of the step's first i tokens is a stop
                            token) at the row's output position, after which nothing is emitted)
    cost(B, k) = verify(B, k + 1) + draft(B, k)                        (seconds, measured)
    stragglers(B, k, rows) ~ 1 + z_B sigma_k / sqrt(r E[tokens | k])   (1 for k = 0; see below)

- **Costs** are measured online by the engine (`observe_step`: seconds of the draft phase and of
  the whole decode step, per batch-size bucket and k); the estimate of each (bucket, width) is
  the median of its last `cost_window` measurements (a garbage collection or a growing cache
  makes one step several times slower; an average would carry that for many steps). A width
  measured fewer than `min_cost_samples` times in a bucket is not trusted alone: it is
  interpolated / extrapolated linearly from the bucket's trusted widths (beyond the widest, the
  cheaper of that and the nearest measured bucket's cost relative to plain: a dear width must
  not price every longer draft out unmeasured), or, with plain the only trusted one, taken from
  the nearest measured bucket's cost relative to plain (else from the bucket's own few
  measurements, else a prior slope). The draft phase is measured per k the
  same way (it has a fixed part — the refresh of the MTP cache and the first draft head — so a
  cost per token would overprice long drafts from short ones), from steady drafting steps only:
  a step that resumes drafting after plain rounds also refreshes the skipped positions (the
  engine reports it as `catch_up`), a one-off cost of switching that had made batch 1 price
  k = 3 23% above its steady cost and refuse every draft. (A line fitted through all widths was
  tried: on a CPU the verify cost is concave in the width — the first draft adds the speculative
  sampling work — so the line overpriced long drafts and batch 1 chose k = 2 where k = 3 was best.)
- **Acceptance** per draft position is a discounted count of the rounds that reached the
  position and of those that accepted it (`observe_acceptance`), so it follows a drifting draft
  (the counts age by verify rounds: a plain step neither adds evidence nor ages it);
  a weight push (`on_weight_version`) multiplies the counts by `version_discount`: the old
  version's acceptance stays a prior worth about one engine step, the new version's rounds take over
  within ~4 engine steps of a push that changes acceptance (measured in BENCHMARKS.md,
  "Adaptive speculation"). Drafts verified after an accepted stop token are not evidence (the
  row ended; the engine cuts each row's report at its end).
- **Rows** (`RowState`, passed by the engine each step: output length and tokens left): a row's
  stop tokens come where rows end by output position (`StopHazard`,
  `AcceptanceEstimate.batch_tokens`). It matters where a batch runs until its last row: an RL
  batch's answers end within a few tokens of each other (BENCHMARKS.md, "Adaptive speculation",
  sixth session).
- **Stragglers**: acceptance differs between rows, so rows of a batch that would finish
  together under plain decoding finish at different steps under speculation, and the batch runs
  until its slowest row is done. When no request waits for a finished row's place (the engine
  passes `tokens_left`, the most tokens a row may still emit), a k > 0 step is priced by the
  expected excess of the slowest row's steps (`straggler_factor`: a normal approximation of the
  steps to emit the rows' remaining tokens, checked against a simulated batch in the tests). It is what made k = 1
  lose 4-8% end to end at greedy batch 4 while it gained 4% per step, and it ends a batch on
  plain decoding when few tokens are left. With a queue (continuous batching) it is 1.
- **Margin**: k > 0 is chosen only when it predicts at least `min_gain` more tokens per second
  than plain decoding: near break-even the prediction is within its own noise, and the MTP
  prefill of the prompt at admission and a catch-up refresh when drafting resumes are not in
  the per-step model. Plain wins the ties.
- **Exploration**: plain decoding (k = 0) is measured first in every bucket (it is the baseline
  of the guard); then every `probe_every` steps after the last probe's last step (the interval
  doubling up to `max_probe_every` unless the last probe made its k the best by `min_gain`:
  near a tie the best k flips between neighbours with or without a probe's help, and resetting
  on every flip had made probes 15-24% of the steps at batch 4-16, ~27% of the RL workload's
  batch-4 bucket) the controller runs the least recently measured of
  {best - 1, best + 1, 0, the best k > 0} for `min_cost_samples` steps in a row (the first of
  them after plain rounds is a catch-up, the others measure steady drafting; with a median of
  the last `cost_window` = 5 they replace what the last probe measured), so costs and acceptance
  of the neighbours stay fresh. The last one lets a bucket at plain decoding re-measure the
  draft length that would win, not only k = 1; and a bucket at plain adds every k > 0 it predicts
  within `min_gain` of plain, so that each takes its turn: after k = 1 and k = 3 were both measured
  in a slow stretch, k = 1's next probe made it the best k > 0, and k = 3, the true best (9% over
  plain at batch 1), was never re-measured (0 of 400 steps).
  A bucket at plain decoding does not wait the doubled interval for a k > 0 that it predicts
  near break-even: its options (k = 1, the best k > 0 and every k > 0 within `min_gain` of plain,
  in turn) come `probe_every` steps after the last probe while predicted within `min_gain` of plain, later in proportion to their
  predicted loss beyond that (`plain_probe_interval`), so each such probe costs about
  3 x min_gain / probe_every of the throughput (~0.6%). The
  asymmetry is the shape of the rate: flat near the best k > 0 (on the RL workload static k = 3-6
  are within 3% of each other), where probing more often buys little (tried: loss-scaled
  intervals for every option raised probes to 13-15% of the steps, and auto fell to 0.92-0.96x
  of the best static k on the RL workload in three sweeps), but a cliff between k = 0 and the
  best k > 0, where an estimate taken in a slow stretch costs the whole gain: at temperature 1,
  batch 1 (k = 3 gains 5-15%; its cost moves by 10-25% with the box's load for minutes at a
  time) such a bucket stayed at plain with k = 3 predicted within 3% of it for up to ~1,300
  steps, 0.88-0.91x of static k = 3 in grid runs (BENCHMARKS.md, "Adaptive speculation", fifth
  session). A neighbour measured fewer than `min_cost_samples` times in the bucket goes first,
  every `learn_every` steps, so that a new batch size trusts its own costs within its first
  few dozen steps (at batch 64 the doubling interval had taken 7 generations of 16 tokens to
  measure k = 1 three times, and until then every row kept a draft it never used). Rows that
  join a batch where every k > 0 was measured slower than plain by more than the margin carry
  no draft at all where keeping it (its prefill, a plain bucket's probes) costs more than the
  option to draft is worth under the bucket's cost noise (`may_draft`; every `refuse_every`-th
  such admission keeps its draft to re-measure).
- **Guard**: the model can be wrong (stale acceptance after a push, a cost that moved, a bug).
  Over the last `guard_rows` row-rounds (at least `guard_min_steps` steps) of model-chosen
  steps with k > 0 in a bucket, the realised tokens
  per second per row (a step counted at most `guard_outlier` x the window's median time, as the
  plain cost is a median) are compared with plain decoding's measured rate; below `guard_ratio` of it
  the bucket backs off to k = 0 for `backoff_steps` steps (doubling on each consecutive trip, up
  to `max_backoff_steps`) and then re-probes. `cost_bias` is the test hook that makes the model
  deliberately wrong.

Pure logic: no torch, no clock. The engine passes measured durations in, so tests drive it with
injected costs and acceptance.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from sidecar.engine.stop_hazard import StopHazard


@dataclass(kw_only=True, slots=True)
class SpeculationPolicyConfig:
    """Knobs of the adaptive controller (defaults are what the engine uses)."""

    max_k: int
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
    `SpeculationPolicy.may_draft`).
    It covers the model's noise only: the stragglers that a 10% margin used to stand for (at
    greedy batch 4, k = 1 gained ~1.04x per step and lost 4-8% end to end) are priced by
    `SpeculationPolicy.straggler_factor`."""
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
    (`SpeculationPolicy.plain_probe_interval`). A k not yet measured `min_cost_samples` times in
    the bucket is probed every `learn_every` steps instead."""
    max_probe_every: int = 256
    learn_every: int = 4
    """Steps between probes while a bucket learns its options' costs (a new batch size), and the
    least spacing of any two probes."""
    refuse_every: int = 16
    """Every `refuse_every`-th admission in a row that `SpeculationPolicy.may_draft` would refuse a
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
        if self.max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {self.max_k}")
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
    `SpeculationPolicy.may_draft`), 'probe' (measuring a neighbour or plain), 'guard' (backed off
    after realised throughput fell below plain), 'off' (max k is 0)."""
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


class _Samples:
    """The last few measurements of one cost; the estimate is their median."""

    __slots__ = ("_median", "values")

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self._median: float | None = None

    def add(self, value: float) -> None:
        self.values.append(value)
        self._median = None

    def __len__(self) -> int:
        return len(self.values)

    def median(self) -> float:
        if self._median is None:  # decide() reads every estimate each engine step: compute once
            self._median = statistics.median(self.values)
        return self._median


class AcceptanceEstimate:
    """Discounted per-position acceptance counts of one sidecar (all weight versions, discounted)."""

    def __init__(self, config: SpeculationPolicyConfig) -> None:
        self.config = config
        self.reached = [0.0] * config.max_k  # rounds that drafted position i with all before it accepted
        self.accepted = [0.0] * config.max_k  # ... of which position i was accepted
        self.stops = StopHazard(
            halflife=config.acceptance_halflife, prior_tokens=config.stop_prior_tokens, rate_prior=config.prior_strength
        )
        """Where rows emit their stop token (ages by emitted tokens, like acceptance by rounds)."""
        self._decay = 0.5 ** (1.0 / config.acceptance_halflife)
        self._rates: list[float] | None = None  # rates() until the counts change
        self.finished_rows: deque[tuple[int, int]] = deque(maxlen=config.spread_rows)
        """(drafts proposed at position 1, of which accepted) of the last finished rows."""
        self._spread: float | None = None  # spread() until a row finishes

    def observe(self, drafted: list[int], accepted: list[int]) -> None:
        """One engine step: per row, drafts proposed and drafts accepted (accepted <= drafted)."""
        self._rates = None
        for k, a in zip(drafted, accepted, strict=True):
            if not 0 <= a <= k:
                raise ValueError(f"accepted {a} must be in [0, drafted {k}]")
        age = self._decay ** sum(1 for k in drafted if k > 0)  # by the rounds that replace it
        for i in range(len(self.reached)):
            self.reached[i] *= age
            self.accepted[i] *= age
        for k, a in zip(drafted, accepted, strict=True):
            for i in range(min(a + 1, k, len(self.reached))):
                self.reached[i] += 1.0
                if i < a:
                    self.accepted[i] += 1.0

    def discount(self, factor: float) -> None:
        """Scale all evidence by `factor` (a weight push: the old version becomes a weak prior)."""
        self.reached = [r * factor for r in self.reached]
        self.accepted = [a * factor for a in self.accepted]
        self._rates = None

    def rates(self) -> list[float]:
        """alpha_i per draft position (posterior means; unseen positions inherit the previous one)."""
        if self._rates is None:
            out, prior = [], self.config.prior_acceptance
            n0 = self.config.prior_strength
            for r, a in zip(self.reached, self.accepted, strict=True):
                alpha = (a + n0 * prior) / (r + n0)
                out.append(alpha)
                prior = alpha
            self._rates = out
        return list(self._rates)

    def observe_row(self, drafted: int, accepted: int) -> None:
        """A row finished having proposed `drafted` drafts at position 1, `accepted` of them
        accepted. Rows with fewer than `MIN_ROW_DRAFTS` drafts (a row admitted without a draft, one
        that ran at plain) are not kept: they would push informative rows out of the pool."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} must be in [0, drafted {drafted}]")
        if drafted < MIN_ROW_DRAFTS:
            return
        self.finished_rows.append((drafted, accepted))
        self._spread = None

    def spread(self) -> float:
        """Relative standard deviation of acceptance between rows (`acceptance_spread`) over the
        last `spread_rows` finished rows: how much the prompts of this workload differ for the
        draft. Pooled over finished rows rather than taken from the batch's own running rows:
        with four rows of a few dozen drafts each the estimate swings between 0 and ~0.4 from one
        batch to the next where rows do not differ at all (`acceptance_spread`), and each swing
        re-priced k for the batch's remaining steps (at temperature 1, batch 4 on the bench
        model the per-batch estimate averaged 0.10-0.13 and kept k = 1, the best static k, out of
        half the steps: auto 1.05-1.13x plain against 1.13-1.16x pooled, in paired A/B runs;
        BENCHMARKS.md, "Adaptive speculation", fourth session). Kept across weight pushes: it describes the
        prompts more than the draft."""
        if self._spread is None:
            self._spread = acceptance_spread(list(self.finished_rows))
        return self._spread

    def observe_ends(self, emitted: int, ended: int, rows: list[tuple[int, int, bool]] | None = None) -> None:
        """One decode step emitted `emitted` tokens, `ended` of which were a stop token; `rows`, if
        known: per row (output length before the step, tokens emitted, ended by a stop token)."""
        if rows is None:
            self.stops.observe(emitted, ended)
            return
        if sum(n for _, n, _ in rows) != emitted or sum(1 for *_, stopped in rows if stopped) != ended:
            raise ValueError(f"rows {rows} do not add up to {emitted} tokens emitted, {ended} ended")
        self.stops.observe_rows(rows)

    def end_rate(self) -> float:
        """P(an emitted token ends its sequence), over all positions (`stops` has it by position)."""
        return self.stops.rate()

    def survival(self, upto: int) -> list[float]:
        """[P(a step's first j tokens hold no stop token) for j = 1..upto] at the overall rate
        ((1 - end_rate)^j, the same at every position)."""
        survive = 1.0 - self.end_rate()
        return [survive ** (j + 1) for j in range(upto)]

    def batch_tokens(self, rows: list[RowState] | None, upto: int) -> list[float]:
        """[E[tokens emitted per row per step] with k drafts, k = 0..upto], averaged over `rows`.

        Each row's stop tokens come where rows end by output position (`StopHazard.at`): the RL
        workload's answers end within a few tokens of each other, and the memoryless rate had
        predicted the rows near that end ~1.8 tokens per row and step more than they emitted
        (BENCHMARKS.md, "Adaptive speculation", sixth session). (Scaling each row's acceptance by
        its own record was tried and dropped: a row with a bad first few drafts was priced below
        plain, drafted no more, and so never showed otherwise — greedy batch 1 ran 60% of its
        steps at plain.) None: the overall stop-token rate at every position."""
        if rows is None:
            return [1.0] + [self.expected_tokens(k) for k in range(1, upto + 1)]
        alphas = self.rates()[:upto]
        hazard: dict[int, float] = {}
        total = [0.0] * (upto + 1)
        for row in rows:
            reach = survive = tokens = 1.0
            total[0] += 1.0
            for j, alpha in enumerate(alphas):
                position = row.length + j
                if position not in hazard:
                    hazard[position] = self.stops.at(position)
                reach *= alpha
                survive *= 1.0 - hazard[position]
                tokens += reach * survive
                total[j + 1] += tokens
        return [t / max(len(rows), 1) for t in total]

    def _reach(self, k: int, scale: float = 1.0) -> list[float]:
        """P(draft position i = 1..k is accepted) = prod_{j<=i} alpha_j (each alpha_j x `scale`,
        at most 1: a row accepting more or less than the average)."""
        out, run = [], 1.0
        for alpha in self.rates()[:k]:
            run *= min(alpha * scale, 1.0)
            out.append(run)
        return out

    def expected_tokens(self, k: int, scale: float = 1.0, survival: list[float] | None = None) -> float:
        """E[tokens emitted per row per step] with k drafts: 1 (bonus / plain) + the accepted
        drafts that come before the sequence's end (token i is emitted only if none of the i
        before it ended the sequence: `survival`[i - 1], at least k long; None: (1 - end_rate)^i).
        `scale`: see `_reach`."""
        if survival is None:
            survival = self.survival(k)
        return 1.0 + sum(p * s for p, s in zip(self._reach(k, scale), survival, strict=False))

    def tokens_by_k(self, upto: int, scale: float = 1.0, survival: list[float] | None = None) -> list[float]:
        """[`expected_tokens`(k, scale, survival) for k = 0..upto], in one pass."""
        if survival is None:
            survival = self.survival(upto)
        out = [1.0]
        for p, s in zip(self._reach(upto, scale), survival, strict=False):
            out.append(out[-1] + p * s)
        return out + [out[-1]] * (upto + 1 - len(out))

    def variances_by_k(self, upto: int) -> list[float]:
        """[`token_variance`(k) for k = 0..upto], in one pass."""
        out, mean, second = [0.0], 0.0, 0.0
        for i, p in enumerate(self._reach(upto)):
            mean, second = mean + p, second + (2 * i + 1) * p
            out.append(max(second - mean * mean, 0.0))
        return out + [out[-1]] * (upto + 1 - len(out))

    def token_variance(self, k: int) -> float:
        """Var[tokens per row per step] with k drafts (the number accepted, A = sum_i I_i with
        nested indicators: E[A^2] = sum_i (2i - 1) P(A >= i))."""
        reach = self._reach(k)
        mean = sum(reach)
        return max(sum((2 * i + 1) * p for i, p in enumerate(reach)) - mean * mean, 0.0)


@dataclass(kw_only=True, slots=True)
class _Bucket:
    """Cost estimates and guard state of one batch-size bucket."""

    window: int
    min_samples: int
    verify_samples: dict[int, _Samples] = field(default_factory=dict)
    """width k+1 -> seconds of the decode step without its draft phase."""
    draft_samples: dict[int, _Samples] = field(default_factory=dict)
    """k -> seconds of the draft phase of a steady drafting step (one that refreshed no more
    positions than the previous step's drafts leave: a step resuming after plain rounds also
    catches up the skipped positions, a one-off cost of switching, not of drafting)."""
    last_measured: dict[int, int] = field(default_factory=dict)
    """k -> step count when last measured."""
    steps: int = 0
    probe_interval: int = 0
    last_probe_step: int = 0
    last_probe_k: int = -1
    """The k of the last probe (if it is now the best, the probe changed the choice)."""
    backoff_until: int = 0
    backoff_len: int = 0
    burst: tuple[int, int] = (0, 0)
    """(k, steps left) of the probe being run (a probe is `min_cost_samples` steps in a row)."""
    refusals: int = 0
    """Consecutive admissions refused a draft (`may_draft`)."""
    guard_window: list[tuple[int, float, float]] = field(default_factory=list)
    """Recent model-chosen k > 0 steps: (rows, tokens per row, seconds)."""
    _trusted: tuple[dict[int, float], dict[int, float]] | None = None
    """(verify, draft) until the next observation (decide() reads them every engine step)."""
    _noise: float | None = None
    """`noise()` until the next observation."""

    def _trusted_costs(self) -> tuple[dict[int, float], dict[int, float]]:
        if self._trusted is None:
            n = self.min_samples
            self._trusted = (
                {w: v.median() for w, v in self.verify_samples.items() if len(v) >= (1 if w == 1 else n)},
                {k: v.median() for k, v in self.draft_samples.items() if len(v) >= n},
            )
        return self._trusted

    @property
    def verify(self) -> dict[int, float]:
        """Trusted widths (measured at least `min_samples` times; plain once) -> median seconds."""
        return self._trusted_costs()[0]

    @property
    def draft(self) -> dict[int, float]:
        """Trusted draft phases (k measured at least `min_samples` times) -> median seconds."""
        return self._trusted_costs()[1]

    def untrusted(self) -> tuple[dict[int, float], dict[int, float]]:
        """Medians of every measured width and draft length, however few the measurements
        (better than a prior when nothing trusted is known)."""
        return (
            {w: v.median() for w, v in self.verify_samples.items()},
            {k: v.median() for k, v in self.draft_samples.items()},
        )

    def noise(self) -> float:
        """A step's relative noise: the standard deviation of one verify measurement's log,
        estimated robustly (1.4826 x the median absolute deviation of the logs from their
        width's median, pooled over the widths this bucket measured at least three times; 0
        before that). The medians it qualifies ignore a slow outlier, so must this: at batch
        16-64 on the bench model the plain sd of a step's log was 0.06-0.14, about twice the
        MAD's 0.03-0.07, with a garbage collection or a first step in most windows."""
        if self._noise is None:
            deviations = []
            for samples in self.verify_samples.values():
                logs = [math.log(v) for v in samples.values if v > 0]
                if len(logs) >= 3:
                    centre = statistics.median(logs)
                    deviations += [abs(x - centre) for x in logs]
            self._noise = 1.4826 * statistics.median(deviations) if deviations else 0.0
        return self._noise

    def ratio_error(self, k: int) -> float:
        """Relative standard error of the cost of k drafts over plain's, from two medians (each
        ~1.25 sd / sqrt(n) of its n measurements; a width not measured here counts as one)."""
        n_k, n_0 = max(self.measured(k), 1), max(self.measured(0), 1)
        return 1.2533 * self.noise() * math.sqrt(1.0 / n_k + 1.0 / n_0)

    def measured(self, k: int) -> int:
        """Steps of k drafts whose cost this bucket has measured (up to its window)."""
        v = self.verify_samples.get(k + 1)
        return len(v) if v is not None else 0

    def observe(self, width: int, verify_seconds: float, draft_seconds: float | None) -> None:
        self._trusted = self._noise = None
        self.verify_samples.setdefault(width, _Samples(self.window)).add(verify_seconds)
        if draft_seconds is not None:
            self.draft_samples.setdefault(width - 1, _Samples(self.window)).add(draft_seconds)


def _rates(priced: list[tuple[float, float, float]]) -> list[float]:
    """Tokens per second per row from (tokens per row, step seconds, straggler factor) per k."""
    return [tokens / (seconds * factor) for tokens, seconds, factor in priced]


def _interpolate(costs: dict[int, float], x: int) -> float:
    """A cost at `x` from measured points (x -> seconds; `x` among them or at least two): linear
    between the neighbours, beyond them with the slope of the two nearest (never negative)."""
    if x in costs:
        return costs[x]
    xs = sorted(costs)
    lower = [w for w in xs if w < x]
    upper = [w for w in xs if w > x]
    if lower and upper:
        w0, w1 = lower[-1], upper[0]
        return costs[w0] + (x - w0) / (w1 - w0) * (costs[w1] - costs[w0])
    w0, w1 = (xs[-2], xs[-1]) if lower else (xs[0], xs[1])
    slope = max((costs[w1] - costs[w0]) / (w1 - w0), 0.0)
    anchor = w1 if lower else w0
    return max(costs[anchor] + slope * (x - anchor), 0.0)


@functools.lru_cache(maxsize=256)
def expected_max_of_normals(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1; ~1.03 for 4, ~2.34 for 64), by
    numerical integration of x * n * phi(x) * Phi(x)^(n-1)."""
    if n <= 1:
        return 0.0
    h, total = 0.005, 0.0
    for i in range(-2000, 2001):
        x = i * h
        phi = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        total += x * n * phi * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1)
    return total * h


def option_value(mean: float, sd: float) -> float:
    """E[max(G, 0)] for G ~ N(`mean`, `sd`^2): what keeping a choice is worth when it is taken
    only where it pays and its payoff is known to within `sd`."""
    if sd <= 0:
        return max(mean, 0.0)
    z = mean / sd
    return mean * 0.5 * (1 + math.erf(z / math.sqrt(2))) + sd * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


MIN_ROW_DRAFTS = 4
"""Drafts at position 1 below which a row's acceptance rate says too little to count in a spread."""


def acceptance_spread(rows: list[tuple[int, int]]) -> float:
    """Relative standard deviation of acceptance between rows, from each row's (drafts proposed at
    position 1, of which accepted): the variance of the rows' rates less what their finite counts
    explain (binomial: a(1 - a) / n, estimated without bias by r(1 - r) / (n - 1) from a row's
    rate r), over the mean rate. 0 with fewer than two rows of `MIN_ROW_DRAFTS`+ drafts.

    The variance is the quantity that matters (`SpeculationPolicy.straggler_factor` adds it) and
    its estimate is unbiased but for the truncation at 0; its square root is not: with no true
    spread, 64 rows of 8-24 drafts at acceptance 0.6 still give ~0.1 (the sampling noise of the
    observed variance), 4 rows give anything from 0 to 0.4 from one batch to the next."""
    rated = [(a / n, n) for n, a in rows if n >= MIN_ROW_DRAFTS]
    if len(rated) < 2:
        return 0.0
    mean = sum(r for r, _ in rated) / len(rated)
    if mean <= 0:
        return 0.0
    observed = sum((r - mean) ** 2 for r, _ in rated) / (len(rated) - 1)
    noise = sum(r * (1 - r) / (n - 1) for r, n in rated) / len(rated)
    return math.sqrt(max(observed - noise, 0.0)) / mean


class SpeculationPolicy:
    """The per-step k controller; see the module docstring."""

    def __init__(self, config: SpeculationPolicyConfig) -> None:
        self.config = config
        self.acceptance = AcceptanceEstimate(config)
        self._buckets: dict[int, _Bucket] = {}
        self._observations = 0  # steps observed (cached derived estimates are valid for one count)
        self._near_cache: dict[int, tuple[int, _Bucket | None]] = {}
        self.trips = 0
        self._prefill = _Samples(config.cost_window)
        """Seconds per prompt token of the draft's prefill at admission (`observe_draft_prefill`)."""
        self.last = SpeculationDecision(
            k=0, reason="off" if not config.max_k else "probe", batch_size=0, detail="no decode step yet"
        )
        self._pending_reason = ""

    # ---- predictions ------------------------------------------------------------------------
    def _bucket(self, batch: int) -> _Bucket:
        edge = batch_bucket(batch)
        if edge not in self._buckets:
            self._buckets[edge] = _Bucket(window=self.config.cost_window, min_samples=self.config.min_cost_samples)
        return self._buckets[edge]

    def predicted_seconds(self, batch: int, k: int) -> float | None:
        """Predicted seconds of one decode step with k drafts at this batch (None before plain is measured)."""
        seconds = self.predicted_steps(batch, [k])
        return None if seconds is None else seconds[0]

    def predicted_steps(self, batch: int, ks: list[int]) -> list[float] | None:
        """`predicted_seconds` of each k of `ks`, the bucket's costs looked up once."""
        b = self._bucket(batch)
        verify_costs = b.verify
        plain = verify_costs.get(1)
        if plain is None:
            return None
        near = self._nearest_measured(batch)
        own_draft = b.draft
        if near is None and len(verify_costs) < 2:  # no trusted k > 0 anywhere: own few measurements, not priors
            verify_costs, own_draft = b.untrusted()
        near_verify = near.verify if near is not None else None
        out = []
        for k in ks:
            verify = self._verify_seconds(verify_costs, k + 1, plain, near_verify)
            if k == 0:
                out.append(verify)
                continue
            if own_draft:  # the draft phase of k, from the measured k (a draft of 0 tokens costs nothing)
                draft = _interpolate({0: 0.0, **own_draft}, k)
            elif near is not None and near.draft:  # the same share of a plain step as at the nearest batch
                draft = _interpolate({0: 0.0, **near.draft}, k) / near.verify[1] * plain
            else:
                draft = k * self.config.prior_draft_cost * plain
            out.append((verify + draft) * self.config.cost_bias)
        return out

    def _nearest_measured(self, batch: int) -> _Bucket | None:
        """The nearest other bucket with plain and some k > 0 measured (its relative costs are the
        best guess for a bucket that has not measured them yet)."""
        own = batch_bucket(batch)
        cached = self._near_cache.get(own)
        if cached is not None and cached[0] == self._observations:
            return cached[1]
        near = self._find_nearest(own)
        self._near_cache[own] = (self._observations, near)
        return near

    def _find_nearest(self, own: int) -> _Bucket | None:
        measured = [
            (abs(math.log(edge / own)), edge)
            for edge, other in self._buckets.items()
            if edge != own and len(other.verify) >= 2 and 1 in other.verify
        ]
        return self._buckets[min(measured)[1]] if measured else None

    def _verify_seconds(
        self, costs: dict[int, float], width: int, plain: float, near: dict[int, float] | None = None
    ) -> float:
        """Seconds of a width-`width` verify from a bucket's trusted costs (width -> seconds).

        Beyond the widths the bucket measured, the cheaper of its own extrapolation and the
        nearest measured batch size's cost relative to its plain step (`near`): an estimate too
        cheap is corrected by the steps that choose it, one too dear is never measured again.
        Extrapolating from the bucket's own last two widths alone had one slow reading of k = 2
        at batch 8 price every longer draft out (the engine model of `tools/sim_adaptive.py`
        ran k = 1 there for 784 steps and never tried k = 3, the best; BENCHMARKS.md, "Adaptive
        speculation", seventh session)."""
        if width in costs or len(costs) >= 2:
            own = _interpolate(costs, width)
            if near is not None and width > max(costs) and len(near) >= 2:
                return min(own, plain * _interpolate(near, width) / near[1])
            return own
        if near is not None:  # the nearest measured batch size's cost relative to its plain step
            return plain * self._verify_seconds(near, width, near[1]) / near[1]
        return plain * (1.0 + self.config.prior_verify_slope * (width - 1))

    def straggler_factor(
        self,
        batch: int,
        k: int,
        tokens_left: int | None,
        spread: float | None = None,
        rows: list[RowState] | None = None,
    ) -> float:
        """Expected time to finish the batch with k drafts over (its steps x its step cost).

        Under plain decoding rows with the same tokens left finish at the same step; under
        speculation each row's steps to emit r tokens vary (about normal, mean r / mu, variance
        r sigma^2 / mu^3 for per-step tokens of mean mu and variance sigma^2), and the batch runs
        until its slowest row is done: E[max of B] adds ~z_B sigma / sqrt(r mu) of the steps
        (z_B = `expected_max_of_normals(B)`). Rows also differ in acceptance itself (a prompt the
        draft predicts well, one it does not: greedy batch 4 on the bench model had 33% more steps
        after its first row finished under k = 1 than its random acceptance explains), which does
        not average out over the steps: with `spread` the relative standard deviation of the
        rows' acceptance (module function `acceptance_spread`; None: the finished rows' pooled
        `AcceptanceEstimate.spread`), their tokens per step vary by cv_mu, the relative variance
        of a row's steps is sigma^2 / (r mu) + cv_mu^2, and every row takes 1 + cv_mu^2 times the
        steps of a row at the mean acceptance on average (the steps r / mu are convex in mu:
        without this term the price ran 3.6% short of a simulated batch at spread 0.3, and the
        pooled estimate's own shortfall took it past 10%).

        How many tokens each row still emits is itself random where rows end at a stop token.
        With the `rows`' output lengths and caps, each row's remaining tokens R have a mean and
        variance from where rows end (`StopHazard.remaining`), pooled over the batch (mean m,
        variance s^2, the spread of the rows' means included); the batch's end is ~ m + z_B s
        tokens away under plain decoding and m (1 + cv_mu^2) + z_B sqrt(s^2 + m sigma^2 / mu +
        cv_mu^2 m^2) under speculation (mu, sigma^2 of a running row: no stop truncation), and the
        factor is their ratio. Rows that all reach the cap (s = 0) get the formula above; rows
        whose ends scatter widely (large s) make speculation's noise small beside it. Rows that
        end by stop tokens at one position should be priced like rows at the cap, but are not
        yet: `StopHazard`'s prior keeps a few % of rows going past that position at the overall
        rate up to the cap, a rare long tail whose variance swamps s, and the price comes out
        8-23% short of a simulated batch — about what the overall rate alone gives (without
        `rows`: B (1 - h)^r rows expected to reach the cap, ~1 on the RL workload; an exact
        E[max] under the same hazard was tried and did not change the decisions: BENCHMARKS.md,
        "Adaptive speculation", seventh session). 1 at batch 1, for k = 0, and with
        `tokens_left` None (rows that finish early are replaced from the queue: throughput, not
        the batch's end, is what counts)."""
        return self.straggler_factors(batch, [k], tokens_left, spread, rows)[0]

    def straggler_factors(
        self,
        batch: int,
        ks: list[int],
        tokens_left: int | None,
        spread: float | None = None,
        rows: list[RowState] | None = None,
    ) -> list[float]:
        """`straggler_factor` for each k of `ks`, the per-k moments and the rows' remaining
        tokens computed once for all of them (this runs every decode step)."""
        if batch < 2 or tokens_left is None or not any(ks):
            return [1.0] * len(ks)
        acceptance = self.acceptance
        if spread is None:
            spread = acceptance.spread()
        upto = max(ks)
        running = [1.0] * upto if rows else None  # with rows, R counts up to the stop token
        mus = acceptance.tokens_by_k(upto, survival=running)
        variances = acceptance.variances_by_k(upto)
        if spread > 0:  # cv_mu^2: the rows' tokens per step vary by cv_mu between rows
            his = acceptance.tokens_by_k(upto, scale=1.0 + spread, survival=running)
            los = acceptance.tokens_by_k(upto, scale=max(1.0 - spread, 0.0), survival=running)
            betweens = [((hi - lo) / (2 * mu)) ** 2 for hi, lo, mu in zip(his, los, mus, strict=True)]
        else:
            betweens = [0.0] * (upto + 1)
        out = []
        if not rows:
            r = max(tokens_left, 1)
            z = expected_max_of_normals(max(1, round(batch * (1.0 - acceptance.end_rate()) ** r)))
            for k in ks:
                # a row's steps r / mu_row average r / mu x (1 + cv_mu^2) (1/x is convex), and the
                # slowest of the rows expected to reach the cap adds z_B standard deviations
                mu, between = mus[k], betweens[k]
                out.append(1.0 if k == 0 else 1.0 + between + z * math.sqrt(variances[k] / (r * mu) + between))
            return out
        m, s2 = self._remaining_tokens(rows, tokens_left)
        z = expected_max_of_normals(len(rows))
        plain = m + z * math.sqrt(s2)
        for k in ks:
            mu, between = mus[k], betweens[k]
            spec = m * (1.0 + between) + z * math.sqrt(s2 + m * variances[k] / mu + between * m * m)
            out.append(1.0 if k == 0 else spec / plain)
        return out

    def _remaining_tokens(self, rows: list[RowState], tokens_left: int) -> tuple[float, float]:
        """(mean, variance) of the tokens a row of the batch still emits, pooled over `rows`
        (`StopHazard.remaining`; a row without its own cap has `tokens_left`)."""
        moments = [
            self.acceptance.stops.remaining(row.length, tokens_left if row.left is None else row.left) for row in rows
        ]
        mean = sum(m for m, _ in moments) / len(moments)
        variance = sum(v + (m - mean) ** 2 for m, v in moments) / len(moments)
        return max(mean, 1.0), variance

    def expected_rates(
        self, batch: int, tokens_left: int | None = None, rows: list[RowState] | None = None
    ) -> list[float] | None:
        """Predicted tokens per second per row for k = 0..max_k (None before plain is measured).
        `tokens_left`: the most tokens a row of the batch may still emit when nothing waits to
        take a finished row's place (then no row drafts more than it may emit, and k > 0 pays
        for the batch's stragglers: `straggler_factor`); None while requests wait. `rows`: the
        batch's rows (each one's acceptance so far and output length:
        `AcceptanceEstimate.batch_tokens`); None: every row at the sidecar's average."""
        priced = self._price(batch, tokens_left, rows)
        return None if priced is None else _rates(priced)

    def _price(
        self, batch: int, tokens_left: int | None, rows: list[RowState] | None
    ) -> list[tuple[float, float, float]] | None:
        """(tokens per row, step seconds, straggler factor) per k = 0..max_k, every k in one pass
        (this runs every decode step); None before plain is measured."""
        tokens = self.acceptance.batch_tokens(rows, self.config.max_k)
        drafts = [k if tokens_left is None else min(k, max(tokens_left - 1, 0)) for k in range(self.config.max_k + 1)]
        seconds = self.predicted_steps(batch, drafts)
        if seconds is None:
            return None
        factors = self.straggler_factors(batch, drafts, tokens_left, rows=rows)
        return [(tokens[d], t, f) for d, t, f in zip(drafts, seconds, factors, strict=True)]

    # ---- decisions --------------------------------------------------------------------------
    def decide(
        self, batch: int, tokens_left: int | None = None, rows: list[RowState] | None = None
    ) -> SpeculationDecision:
        """k for the next decode step of a batch of `batch` rows (`tokens_left`, `rows`: see
        `expected_rates`)."""
        cfg = self.config
        if cfg.max_k == 0:
            self.last = SpeculationDecision(k=0, reason="off", batch_size=batch, detail="max k is 0")
            return self.last
        b = self._bucket(batch)
        b.steps += 1
        if b.steps <= b.backoff_until:
            self.last = SpeculationDecision(
                k=0,
                reason="guard",
                batch_size=batch,
                detail=f"{self._pending_reason or 'realised throughput below plain'}; plain for "
                f"{b.backoff_until - b.steps + 1} more steps at batch {batch}",
            )
            return self.last
        priced = self._price(batch, tokens_left, rows)
        if priced is None:
            self.last = SpeculationDecision(
                k=0, reason="probe", batch_size=batch, detail=f"measuring plain decoding at batch {batch}"
            )
            return self.last
        rates = _rates(priced)
        burst_k, burst_left = b.burst
        if burst_left > 0:
            b.burst = (burst_k, burst_left - 1)
            self.last = SpeculationDecision(
                k=burst_k,
                reason="probe",
                batch_size=batch,
                expected_speedup=rates[burst_k] / rates[0],
                detail=f"measuring k={burst_k} at batch {batch} ({cfg.min_cost_samples} steps in a row)",
            )
            return self.last
        best = self._best(rates)
        speedup = rates[best] / rates[0]
        started = self._start_probe(b, rates, best)
        if started is not None:
            probe, learning = started
            self.last = SpeculationDecision(
                k=probe,
                reason="probe",
                batch_size=batch,
                expected_speedup=rates[probe] / rates[0],
                detail=f"{'measuring' if learning else 're-measuring'} k={probe} against the best "
                f"k={best} at batch {batch} (predicted {rates[probe] / rates[best]:.2f}x of it)",
            )
            return self.last
        tau, step, stragglers = priced[best]
        self.last = SpeculationDecision(
            k=best,
            reason="model",
            batch_size=batch,
            expected_speedup=speedup,
            detail=(
                f"k={best} predicts {speedup:.2f}x plain at batch {batch} (tau {tau:.2f}; "
                f"step {1e3 * step:.2f} ms vs plain {1e3 * priced[0][1]:.2f} ms"
                + (f"; stragglers x{stragglers:.2f}" if stragglers > 1 else "")
                + ")"
            ),
        )
        return self.last

    def plain_probe_interval(self, rates: list[float], k: int) -> float:
        """Steps between probes of `k` > 0 from a bucket at plain decoding (`rates`: predicted
        tokens/s per k): `probe_every` while k is predicted within `min_gain` of plain, longer in
        proportion to its predicted loss beyond that, at most `max_probe_every` (see the module
        docstring, "Exploration")."""
        cfg = self.config
        loss = max(1.0 - rates[k] / rates[0], 0.0)
        if loss <= cfg.min_gain:
            return float(cfg.probe_every)
        if cfg.min_gain == 0:
            return float(cfg.max_probe_every)
        return min(cfg.probe_every * loss / cfg.min_gain, float(cfg.max_probe_every))

    def _start_probe(self, b: _Bucket, rates: list[float], best: int) -> tuple[int, bool] | None:
        """Start a probe in bucket `b` if one is due: (its k, still learning its cost), else None.

        The options are the best's neighbours, plain decoding and the best k > 0, and, from a
        bucket at plain, every k > 0 predicted within `min_gain` of plain; least recently measured
        first. One not yet measured `min_cost_samples` times goes first, every
        `learn_every` steps (its cost is borrowed or interpolated, not its own). Otherwise a probe
        starts when the bucket's probe interval has passed since the last one: `probe_every`,
        doubling up to `max_probe_every` unless a probe made its k the best by `min_gain`; from a
        bucket at plain, no later than `plain_probe_interval` of the k probed. Intervals count
        from a probe's last step (bursts of 3 starting every 4 steps had left a bucket that
        learns — a batch size seen a few steps per generation — one step in four its own)."""
        cfg = self.config
        challenger = max(range(1, cfg.max_k + 1), key=lambda k: (rates[k], -k))
        candidates = {best - 1, best + 1, 0, challenger}
        if best == 0:  # every k > 0 near break-even takes its turn: a fresh reading can make k = 1
            # the best k > 0 and lock out a k = 3 measured in a slow stretch (never best + 1)
            candidates |= {k for k in range(1, cfg.max_k + 1) if rates[k] >= (1.0 - cfg.min_gain) * rates[0]}
        options = sorted({k for k in candidates if 0 <= k <= cfg.max_k and k != best})
        if not options:
            return None
        probe = min(options, key=lambda k: (b.measured(k) >= cfg.min_cost_samples, b.last_measured.get(k, -1), k))
        learning = b.measured(probe) < cfg.min_cost_samples
        if learning:
            interval = float(cfg.learn_every)
        else:
            interval = float(b.probe_interval or cfg.probe_every)
            if best == 0:
                interval = min(interval, self.plain_probe_interval(rates, probe))
        if b.steps - b.last_probe_step < interval:
            return None
        if not learning:  # the interval doubles unless the last probe made its k the best by the margin
            runner_up = max(r for k, r in enumerate(rates) if k != best)
            moved = best == b.last_probe_k and rates[best] >= (1.0 + cfg.min_gain) * runner_up
            stable = not moved and b.probe_interval > 0
            b.probe_interval = min(2 * b.probe_interval, cfg.max_probe_every) if stable else cfg.probe_every
            b.last_probe_k = probe
        b.last_probe_step = b.steps + cfg.min_cost_samples - 1  # intervals count from the burst's last step
        b.burst = (probe, cfg.min_cost_samples - 1)  # this step and the next ones
        return probe, learning

    def may_draft(
        self,
        batch: int,
        tokens_left: int | None = None,
        rows: list[RowState] | None = None,
        joining: int | None = None,
        prompt_tokens: int | None = None,
    ) -> bool:
        """False when the `joining` rows (the last of `rows`; None: all of the batch) should be
        admitted to a batch of this size without a draft. A row admitted without one never
        drafts for its whole generation, so a refusal is worth its cost only where speculation
        surely loses: what it saves is the draft's upkeep (`_upkeep`), the MTP prefill of the
        rows' `prompt_tokens` (timed by the engine: `observe_draft_prefill`) and the probes of a
        bucket at plain (the pending inputs kept through plain rounds are bounded by the engine
        and not counted); what it gives up is the option to draft, which each step takes only
        where it pays.

        The best k > 0 is predicted at a relative gain g over plain decoding, known to within
        the standard error se of two measured costs (`_Bucket.ratio_error`: the bucket's own
        step noise, robust to a slow outlier, pooled over its widths). Keeping the draft is
        worth E[max(G, 0)] of the joining rows' generation at plain speed, G ~ N(g, se^2)
        (`option_value`). The rows are refused when that is less than the upkeep, and k > 0 is
        predicted to lose by more than `min_gain` (within the margin each step decides). Before
        the engine has timed a prefill, the prefill counts as `min_gain` of the generation.
        With exact costs (se = 0) any loss beyond the margin refuses, as before; at temperature
        1, batch 4 on the bench model, where k = 1 gains ~5% and one step's cost scatters by
        5-14%, a refusal on a noisy estimate had turned drafting off for the rows' whole
        generation and, `refuse_every` admissions in a row, a whole grid cell (auto at 0.89x
        plain, 0.84x of static k = 1; BENCHMARKS.md, "Adaptive speculation", seventh session),
        while the prefill it saved is ~0.6% of a generation there (60 prompt tokens at ~120 us
        against 48 steps of ~25 ms).

        A guard back-off does not count: it is temporary. Only the bucket's own trusted
        measurements of k > 0 (at least `min_cost_samples`) can refuse a draft (another batch
        size's relative costs may be far off, and a refused bucket would never measure again),
        and every `refuse_every`-th refusal in a row is turned into an admission with a draft,
        so a bucket that once measured plain best can learn that this changed (a weight push
        that improved the draft, a machine less loaded)."""
        b = self._bucket(batch)
        rates = self.expected_rates(batch, tokens_left, rows)
        if rates is None or len(b.verify) < 2:
            return True  # k > 0 not measured here (min_cost_samples times) yet
        best = max(range(1, len(rates)), key=lambda k: rates[k])
        gain = rates[best] / rates[0] - 1.0
        if gain >= -self.config.min_gain:
            b.refusals = 0
            return True
        se = b.ratio_error(best)
        worth, upkeep = option_value(gain, se), self._upkeep(batch, tokens_left, rows, joining, prompt_tokens)
        if worth >= upkeep:
            b.refusals = 0
            return True
        b.refusals += 1
        if b.refusals >= self.config.refuse_every:
            b.refusals = 0
            return True
        self.last = SpeculationDecision(  # what GetStats shows while no row drafts (decide is not asked)
            k=0,
            reason="model",
            batch_size=batch,
            detail=f"rows joining batch {batch} admitted without a draft: the best k={best} predicts "
            f"{1.0 + gain:.2f}x plain (se {se:.2f}); drafting is worth {100 * worth:.2f}% of their "
            f"generation, keeping the draft costs {100 * upkeep:.2f}%",
        )
        return False

    def _upkeep(
        self,
        batch: int,
        tokens_left: int | None,
        rows: list[RowState] | None,
        joining: int | None,
        prompt_tokens: int | None,
    ) -> float:
        """What keeping the joining rows' drafts costs, as a share of their generation at plain
        speed: their draft prefill (over their share of the batch's steps until they are done;
        `min_gain` of the generation before a prefill is timed or while neither `tokens_left`
        nor the rows' caps are known), and the probes that a bucket at
        plain runs while rows keep drafts (`min_cost_samples` steps of a k > 0 about every
        `probe_every` x loss / `min_gain` steps, each losing `loss`: `min_cost_samples` x
        `min_gain` / `probe_every` of the throughput, ~0.6%; `plain_probe_interval`)."""
        cfg = self.config
        probing = cfg.min_cost_samples * cfg.min_gain / cfg.probe_every
        plain = self._bucket(batch).verify.get(1)
        joining = batch if joining is None else min(max(joining, 1), batch)
        new = (rows or [])[-joining:]
        caps = [r.left for r in new if r.left is not None]
        cap = tokens_left if tokens_left is not None else max(caps, default=None)
        if not self._prefill or prompt_tokens is None or plain is None or cap is None:
            return cfg.min_gain + probing  # the prefill or the generation it is set against unknown
        remaining = self._remaining_tokens(new, cap)[0] if new else float(max(cap, 1))
        generation = remaining * plain * joining / batch
        return prompt_tokens * self._prefill.median() / generation + probing

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        """The engine ran the draft's prefill of `tokens` prompt tokens in `seconds` (admission)."""
        if tokens > 0 and seconds >= 0:
            self._prefill.add(seconds / tokens)

    def _best(self, rates: list[float]) -> int:
        """The k of the highest predicted rate; a k > 0 must beat plain by `min_gain` (ties: smaller k)."""
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        return best if rates[best] >= (1.0 + self.config.min_gain) * rates[0] else 0

    # ---- observations -----------------------------------------------------------------------
    def observe_step(
        self,
        *,
        batch: int,
        k: int,
        draft_seconds: float,
        step_seconds: float,
        tokens: int,
        chosen: bool = True,
        catch_up: bool = False,
        ended: int = 0,
        rows: list[tuple[int, int, bool]] | None = None,
    ) -> None:
        """A decode step ran: `k` drafts (the widest row), the draft phase took `draft_seconds` of
        its `step_seconds`, and `tokens` were emitted over `batch` rows, `ended` of them a stop
        token. `chosen`: the step's k came from this controller's 'model' decision (only those
        feed the guard). `catch_up`: the draft phase also refreshed positions skipped by plain
        rounds (its cost is not that of steady drafting: only the verify is recorded). `rows`: per
        row (output length before the step, tokens emitted, ended by a stop token), where the
        rows end (`StopHazard`); None: only the overall rate is learnt."""
        self.acceptance.observe_ends(tokens, ended, rows)
        if batch < 1 or step_seconds <= 0 or draft_seconds < 0 or draft_seconds > step_seconds:
            return  # nothing measurable (clock resolution, empty step)
        b = self._bucket(batch)
        self._observations += 1
        b.observe(k + 1, step_seconds - draft_seconds, draft_seconds if k > 0 and not catch_up else None)
        b.last_measured[k] = b.steps
        if not (chosen and k > 0 and self.last.reason == "model"):
            return
        b.guard_window.append((batch, tokens / batch, step_seconds))
        row_rounds = sum(n for n, _, _ in b.guard_window)
        if len(b.guard_window) < self.config.guard_min_steps or row_rounds < self.config.guard_rows:
            return
        plain = b.verify.get(1)
        cap = self.config.guard_outlier * statistics.median(s for _, _, s in b.guard_window)
        realised = sum(t for _, t, _ in b.guard_window) / sum(min(s, cap) for _, _, s in b.guard_window)
        steps = len(b.guard_window)
        b.guard_window.clear()
        if plain is None:
            return
        ratio = realised * plain  # realised tokens/s per row over plain's (1 token per row per plain step)
        if ratio < self.config.guard_ratio:
            b.backoff_len = min(
                2 * b.backoff_len if b.backoff_len else self.config.backoff_steps, self.config.max_backoff_steps
            )
            b.backoff_until = b.steps + b.backoff_len
            self.trips += 1
            self._pending_reason = (
                f"realised {ratio:.2f}x plain over {steps} steps ({row_rounds} row-rounds) at batch {batch} "
                f"(model predicted {self.last.expected_speedup:.2f}x)"
            )
        else:
            b.backoff_len = 0

    def observe_acceptance(self, drafted: list[int], accepted: list[int]) -> None:
        """Per row of a decode step: drafts verified and drafts accepted."""
        self.acceptance.observe(drafted, accepted)

    def observe_finished_row(self, drafted: int, accepted: int) -> None:
        """A row finished: its drafts proposed at position 1 and how many were accepted (how much
        rows differ in acceptance: `AcceptanceEstimate.spread`)."""
        self.acceptance.observe_row(drafted, accepted)

    def on_weight_version(self) -> None:
        """A weight push landed: the old version's acceptance becomes a weak prior."""
        self.acceptance.discount(self.config.version_discount)
