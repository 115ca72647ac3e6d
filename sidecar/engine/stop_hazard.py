"""How likely a row is to emit its stop token at each output position (the speculation controller's
model of where sequences end).

Why: a draft token after a stop token is never emitted, so how much a long draft can emit depends on
whether the rows are about to end. A single rate of stop tokens per emitted token (memoryless)
spreads the ends of a workload over every step; RL rollouts end where their task's answers end
(the demo's arithmetic answers: ~20 tokens, all rows within a few tokens of each other). There a
memoryless rate of ~0.03 per token priced every step of the batch's first 15 tokens as if one row in
30 were ending and took ~0.15 tokens per row from k = 3's predicted step and more from longer drafts,
while no row ended there at all (BENCHMARKS.md, "Adaptive speculation", sixth session). The hazard
by output position — P(the token at position n is a stop token | the row reached n) — puts those
ends where they happen: early steps draft long, the steps around the answers' end short.

Pure bookkeeping: discounted counts per position bin (exact up to `EXACT_POSITIONS`, then bins
growing by 1/8), shrunk towards the overall rate where a bin has little evidence.
"""

from __future__ import annotations

import bisect

REMAINING_REFRESH = 16
"""Observations (decode steps) for which `StopHazard.remaining`'s table per length cap is kept."""

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
        self._remaining: dict[int, tuple[int, int, list[float], list[float]]] = {}
        """cap -> (observations when built, lowest position, means, second moments) (`remaining`)."""

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
        i = self._bin(position)
        return (self._ended[i] + self.prior_tokens * self.rate()) / (self._emitted[i] + self.prior_tokens)

    def remaining(self, position: int, left: int) -> tuple[float, float]:
        """(mean, variance) of the tokens a row at output `position` still emits, its stop token
        included, when it may emit at most `left` more (the length cap).

        Backwards from the cap P = position + left: M(P) = 0, M(p) = 1 + (1 - h(p)) M(p + 1), and
        the second moment Q(p) = 1 + (1 - h(p)) (2 M(p + 1) + Q(p + 1)). The table per cap is kept
        for `REMAINING_REFRESH` observations (it costs a pass over the positions; the hazard moves
        slowly)."""
        if left <= 0:
            return 0.0, 0.0
        cap = position + left
        table = self._remaining.get(cap)
        if table is None or self._observations - table[0] >= REMAINING_REFRESH or position < table[1]:
            low = min(position, table[1]) if table is not None and table[0] == self._observations else position
            means, seconds = [0.0] * (cap - low + 1), [0.0] * (cap - low + 1)
            for p in range(cap - 1, low - 1, -1):
                go = 1.0 - self.at(p)
                i = p - low
                means[i] = 1.0 + go * means[i + 1]
                seconds[i] = 1.0 + go * (2.0 * means[i + 1] + seconds[i + 1])
            if len(self._remaining) > 64:
                self._remaining.clear()
            table = self._remaining[cap] = (self._observations, low, means, seconds)
        _, low, means, seconds = table
        mean, second = means[position - low], seconds[position - low]
        return mean, max(second - mean * mean, 0.0)
