"""Per-position acceptance of the draft, discounted by age and weight version, and how much rows differ."""

from __future__ import annotations

import math
from collections import deque

from sidecar.speculation.config import RowState, SpeculationControllerConfig
from sidecar.speculation.stop_hazard import StopHazard


class AcceptanceEstimate:
    """Discounted per-position acceptance counts of one sidecar (all weight versions, discounted)."""

    def __init__(self, config: SpeculationControllerConfig) -> None:
        self.config = config
        self.reached = [0.0] * config.max_speculation_k  # rounds that drafted position i with all before it accepted
        self.accepted = [0.0] * config.max_speculation_k  # ... of which position i was accepted
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
        BENCHMARKS.md at ca4d93b, "Adaptive speculation", fourth session). Kept across weight pushes: it describes the
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
        (BENCHMARKS.md at ca4d93b, "Adaptive speculation", sixth session). (Scaling each row's acceptance by
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


MIN_ROW_DRAFTS = 4
"""Drafts at position 1 below which a row's acceptance rate says too little to count in a spread."""


def acceptance_spread(rows: list[tuple[int, int]]) -> float:
    """Relative standard deviation of acceptance between rows, from each row's (drafts proposed at
    position 1, of which accepted): the variance of the rows' rates less what their finite counts
    explain (binomial: a(1 - a) / n, estimated without bias by r(1 - r) / (n - 1) from a row's
    rate r), over the mean rate. 0 with fewer than two rows of `MIN_ROW_DRAFTS`+ drafts.

    The variance is the quantity that matters (`SpeculationController.straggler_factor` adds it) and
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
