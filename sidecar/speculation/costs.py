"""Step costs per batch-size bucket and draft width, measured online (medians of recent steps),
and the statistics helpers that price the option to draft under cost noise."""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from dataclasses import dataclass, field


class CostSamples:
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


@dataclass(kw_only=True, slots=True)
class BucketCosts:
    """Cost estimates and guard state of one batch-size bucket."""

    window: int
    min_samples: int
    verify_samples: dict[int, CostSamples] = field(default_factory=dict)
    """width k+1 -> seconds of the decode step without its draft phase."""
    draft_samples: dict[int, CostSamples] = field(default_factory=dict)
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
        self.verify_samples.setdefault(width, CostSamples(self.window)).add(verify_seconds)
        if draft_seconds is not None:
            self.draft_samples.setdefault(width - 1, CostSamples(self.window)).add(draft_seconds)


def rates_per_row(priced: list[tuple[float, float, float]]) -> list[float]:
    """Tokens per second per row from (tokens per row, step seconds, straggler factor) per k."""
    return [tokens / (seconds * factor) for tokens, seconds, factor in priced]


def interpolate_cost(costs: dict[int, float], x: int) -> float:
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
