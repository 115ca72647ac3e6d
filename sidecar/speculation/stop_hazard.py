"""How likely a row is to emit its stop token at each output position (the speculation controller's
model of where sequences end).

Why: a draft token after a stop token is never emitted, so how much a long draft can emit depends on
whether the rows are about to end. A single rate of stop tokens per emitted token (memoryless)
spreads the ends of a workload over every step; RL rollouts end where their task's answers end
(the demo's arithmetic answers: ~20 tokens, all rows within a few tokens of each other). There a
memoryless rate of ~0.03 per token priced every step of the batch's first 15 tokens as if one row in
30 were ending and took ~0.15 tokens per row from k = 3's predicted step and more from longer drafts,
while no row ended there at all (BENCHMARKS.md at ca4d93b, "Adaptive speculation", sixth session). The hazard
by output position — P(the token at position n is a stop token | the row reached n) — puts those
ends where they happen: early steps draft long, the steps around the answers' end short.

Pure bookkeeping: discounted counts per position bin (exact up to `EXACT_POSITIONS`, then bins
growing by 1/8), shrunk towards the overall rate where a bin has little evidence.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from itertools import pairwise

REMAINING_REFRESH = 16
"""Observations (decode steps) for which `StopHazard.remaining`'s table is kept."""

REBUILD_POSITIONS = 256
"""Positions of `StopHazard.remaining`'s table rebuilt per observation at most, on average: a
table to a long horizon (32k tokens: ~20 ms of Python) is kept that much longer."""

HORIZON_GROWTH = 1.25
"""A cap past the table's horizon rebuilds it at least this much further (a bounded number of
rebuilds however the caps grow)."""

EXACT_POSITIONS = 64
"""Output positions below this have a bin each; later bins grow by ~1/8 (a 4,096-token cap: ~100 bins)."""


def _bin_starts(upto: int) -> list[int]:
    starts = list(range(min(upto, EXACT_POSITIONS) + 1))
    while starts[-1] < upto:
        starts.append(starts[-1] + max(1, starts[-1] // 8))
    return starts


class StopHazard:
    """Discounted counts of tokens emitted and of stop tokens per output position bin."""

    def __init__(self, *, halflife: float, prior_tokens: float, rate_prior: float) -> None:
        if not halflife > 0 or not prior_tokens > 0 or not rate_prior > 0:
            raise ValueError(
                f"halflife, prior_tokens and rate_prior must be > 0, got {halflife}, {prior_tokens}, {rate_prior}"
            )
        self._decay = 0.5 ** (1.0 / halflife)
        self.prior_tokens = prior_tokens
        """Emitted tokens' worth of the overall rate behind each bin's own rate."""
        self.rate_prior = rate_prior
        """Emitted tokens without a stop token behind the overall rate (0 before any evidence)."""
        self._starts: list[int] = _bin_starts(EXACT_POSITIONS)
        self._emitted: list[float] = [0.0] * (len(self._starts) - 1)  # discounted tokens per bin
        self._ended: list[float] = [0.0] * (len(self._starts) - 1)  # ... of which stop tokens
        self.emitted = 0.0
        """Tokens emitted (discounted; ages by emitted tokens, like the acceptance evidence)."""
        self.ended = 0.0
        """... of which ended their sequence (a stop token, not the length cap)."""
        self._observations = 0
        self._table: _RemainingTable | None = None
        """`remaining`'s moments from every position to one horizon, for every cap below it."""
        self._largest_cap = 0
        """The largest cap asked of `remaining` since the table was built (the next one's horizon)."""
        self._lowest_position = 0
        """The lowest position asked since the table was built: a lower one means rows joined, and
        their whole generation is priced from it (so it is rebuilt on fresh hazards first)."""

    def _bin(self, position: int) -> int:
        if position >= self._starts[-1]:
            self._starts = _bin_starts(2 * position + 1)
            grow = len(self._starts) - 1 - len(self._emitted)
            self._emitted += [0.0] * grow
            self._ended += [0.0] * grow
        return bisect.bisect_right(self._starts, position) - 1

    def observe(self, emitted: int, ended: int) -> None:
        """Tokens emitted, `ended` of them stop tokens, at unknown positions (only the overall rate)."""
        if not 0 <= ended <= emitted:
            raise ValueError(f"ended {ended} must be in [0, emitted {emitted}]")
        age = self._decay**emitted
        self.emitted = self.emitted * age + emitted
        self.ended = self.ended * age + ended
        self._observations += 1

    def observe_rows(self, rows: list[tuple[int, int, bool]]) -> None:
        """One decode step: per row (output length before the step, tokens it emitted, whether the
        last of them was a stop token)."""
        for start, n, stopped in rows:
            if start < 0 or n < 0 or (stopped and n == 0):
                raise ValueError(f"bad row (start {start}, emitted {n}, stopped {stopped})")
        self.observe(sum(n for _, n, _ in rows), sum(1 for _, _, stopped in rows if stopped))
        decay = self._decay
        for start, n, stopped in rows:
            for position in range(start, start + n):  # a bin's evidence ages by the tokens that replace it
                i = self._bin(position)
                self._emitted[i] = self._emitted[i] * decay + 1.0
                self._ended[i] = self._ended[i] * decay + (stopped and position == start + n - 1)

    def rate(self) -> float:
        """P(an emitted token ends its sequence), over all positions."""
        return self.ended / (self.emitted + self.rate_prior)

    def at(self, position: int) -> float:
        """P(the token at output `position` is a stop token | the row got there): the bin's own
        rate, shrunk towards the overall rate by `prior_tokens`."""
        return self._bin_rate(self._bin(position), self.rate())

    def _bin_rate(self, i: int, rate: float) -> float:
        """Bin i's stop rate, shrunk towards the overall `rate` by `prior_tokens`."""
        return (self._ended[i] + self.prior_tokens * rate) / (self._emitted[i] + self.prior_tokens)

    def remaining(self, position: int, left: int) -> tuple[float, float]:
        """(mean, variance) of the tokens a row at output `position` still emits, its stop token
        included, when it may emit at most `left` more (the length cap P = position + left).

        One table serves every cap (a batch's rows may each have their own: a client that sets
        max_new_tokens per prompt). Backwards from a horizon H >= P: M(H) = 0,
        M(p) = 1 + (1 - h(p)) M(p + 1), and the second moment Q(p) = 1 + (1 - h(p)) (2 M(p + 1) +
        Q(p + 1)). The tokens N_H to H are those to P, plus, if the row reaches P (probability
        r = prod over p in [position, P) of 1 - h(p), from prefix sums of log(1 - h)), the
        N' from P to H. Given that, the row emitted all `left` tokens before P, so
        M_P = M(position) - r M(P) and Q_P = Q(position) - r (2 left M(P) + Q(P)).
        The table is rebuilt on the hazards of the moment when rows joined the batch (a position
        below any asked since it was built) and after `REMAINING_REFRESH` observations (the hazard
        moves slowly), but no more than once per horizon / `REBUILD_POSITIONS` observations. A
        table per cap had cost O(rows x cap) per decode step where more than 64 caps evicted each
        other: 0.19 s per step at batch 128 with caps of 2,000-4,000 tokens
        (`specrl bench adaptive controller`)."""
        if left <= 0:
            return 0.0, 0.0
        cap = position + left
        table = self._table
        if table is None or cap > table.horizon:  # grown geometrically: a bounded number of rebuilds
            horizon = cap if table is None else max(cap, math.ceil(HORIZON_GROWTH * table.horizon))
            table = self._table = self._build(horizon)
        else:
            age = self._observations - table.built
            if (
                age > 0
                and age * REBUILD_POSITIONS >= table.horizon
                and (age >= REMAINING_REFRESH or position < self._lowest_position)
            ):  # stale, or rows joined since: to the largest cap asked since
                table = self._table = self._build(max(cap, self._largest_cap))
        if cap > self._largest_cap:  # (comparisons, not max/min: this runs for every row every step)
            self._largest_cap = cap
        if position < self._lowest_position:
            self._lowest_position = position
        means, seconds, log_survival = table.means, table.seconds, table.log_survival
        after = means[cap]
        reach = math.exp(log_survival[cap] - log_survival[position])
        mean = means[position] - reach * after
        second = seconds[position] - reach * (2.0 * left * after + seconds[cap])
        return mean, max(second - mean * mean, 0.0)

    def _build(self, horizon: int) -> _RemainingTable:
        """`remaining`'s table for positions 0..horizon from the hazards now (one pass per bin for
        the hazards, one per position for the moments)."""
        self._bin(horizon)  # bins to the horizon
        rate = self.rate()
        hazards: list[float] = []
        for i, (start, end) in enumerate(pairwise(self._starts)):
            if start >= horizon:
                break
            hazards += [self._bin_rate(i, rate)] * (min(end, horizon) - start)
        means, seconds = [0.0] * (horizon + 1), [0.0] * (horizon + 1)
        for p in range(horizon - 1, -1, -1):
            go = 1.0 - hazards[p]
            means[p] = 1.0 + go * means[p + 1]
            seconds[p] = 1.0 + go * (2.0 * means[p + 1] + seconds[p + 1])
        log_survival = [0.0] * (horizon + 1)  # sum of log(1 - h) before each position (h < 1)
        for p, h in enumerate(hazards):
            log_survival[p + 1] = log_survival[p] + math.log(max(1.0 - h, 1e-300))
        self._largest_cap, self._lowest_position = 0, horizon
        return _RemainingTable(self._observations, horizon, means, seconds, log_survival)


@dataclass(frozen=True)
class _RemainingTable:
    """`StopHazard.remaining`'s moments to `horizon`, as of `built` observations."""

    built: int
    horizon: int
    means: list[float]
    seconds: list[float]
    log_survival: list[float]
