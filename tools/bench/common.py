"""Paired-repeat statistics for the benchmarks that compare configurations side by side.

A benchmark here runs every configuration once per repeat, next to each other, so the ratio of two
configurations within a repeat cancels the machine's drift between repeats. Two things still
mislead when one figure per run is quoted, and this module answers both:

- **Noise.** On the 2-core CPU box one repeat's ratio scatters by 5-10% (sampled output lengths,
  other tenants), so the median of 5-20 repeats moves by several percent between runs of the same
  code. `median_ratio` gives the median with a percentile-bootstrap interval over the repeats.
- **Winner's curse.** "Auto against the best static k" picks the best k from the same repeats it
  then compares on. Among several static k within noise of each other, the one picked is the one
  whose repeats ran luckiest, so the comparison is biased against the challenger even when it is
  as fast as the best k (`tests/test_bench_stats.py` shows the bias on synthetic repeats).
  `against_best_held_out` picks the best configuration for each repeat from the *other* repeats
  (leave-one-out), which is what a user who tuned k on earlier runs gets.

Stdlib only, so every tool can import it.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Ratio:
    """A median of per-repeat ratios with its bootstrap interval (`level`, two-sided)."""

    median: float
    low: float
    high: float
    level: float
    repeats: int

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.low:.3f}, {self.high:.3f}]"


def bootstrap_median(values: Sequence[float], *, level: float = 0.9, resamples: int = 2000, seed: int = 0) -> Ratio:
    """The median of `values` and a percentile-bootstrap interval for it (resampling the repeats)."""
    if not values:
        raise ValueError("no repeats: run the benchmark with --repeats >= 1")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    low = medians[int(tail * (resamples - 1))]
    high = medians[round((1 - tail) * (resamples - 1))]
    return Ratio(statistics.median(values), low, high, level, n)


def median_ratio(
    reference: Sequence[float],
    challenger: Sequence[float],
    *,
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> Ratio:
    """Median over repeats of reference[i] / challenger[i] (seconds: > 1 means the challenger is
    faster), with its bootstrap interval."""
    _same_length(reference, challenger)
    ratios = [r / c for r, c in zip(reference, challenger, strict=True)]
    return bootstrap_median(ratios, level=level, resamples=resamples, seed=seed)


def best_in_sample(times: Mapping[Hashable, Sequence[float]], candidates: Sequence[Hashable]) -> Hashable:
    """The candidate with the lowest median time over all repeats."""
    return min(candidates, key=lambda c: statistics.median(times[c]))


def held_out_choices(times: Mapping[Hashable, Sequence[float]], candidates: Sequence[Hashable]) -> list[Hashable]:
    """Per repeat i, the candidate with the lowest median time over the repeats other than i."""
    if not candidates:
        raise ValueError("no candidate configurations to choose the best from")
    n = len(times[candidates[0]])
    for c in candidates:
        _same_length(times[candidates[0]], times[c])
    if n < 2:
        raise ValueError("a held-out choice needs at least 2 repeats: run with --repeats >= 2")
    return [
        min(candidates, key=lambda c: statistics.median([t for j, t in enumerate(times[c]) if j != i]))
        for i in range(n)
    ]


def against_best_held_out(
    times: Mapping[Hashable, Sequence[float]],
    candidates: Sequence[Hashable],
    challenger: Hashable,
    *,
    reference: Callable[[Hashable, int], float] | None = None,
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> Ratio:
    """The challenger against the best candidate chosen without the repeat it is compared on.

    Per repeat i: best_i = the candidate fastest over the other repeats; the ratio is
    reference(best_i, i) / times[challenger][i], where reference defaults to times[best_i][i]
    (a caller can take, e.g., the faster of plain and best_i). Median over repeats, bootstrap
    interval over the per-repeat ratios (approximate: a repeat's ratio depends on the others
    through the choice, weakly once the choice is stable).
    """
    choices = held_out_choices(times, candidates)
    _same_length(times[candidates[0]], times[challenger])
    ref = reference or (lambda c, i: times[c][i])
    ratios = [ref(c, i) / times[challenger][i] for i, c in enumerate(choices)]
    return bootstrap_median(ratios, level=level, resamples=resamples, seed=seed)


def _same_length(a: Sequence[float], b: Sequence[float]) -> None:
    if len(a) != len(b):
        raise ValueError(f"paired repeats differ in number: {len(a)} against {len(b)}")
