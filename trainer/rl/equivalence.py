"""Equivalence of two training arms: a paired two one-sided t-test (TOST), with its calibration.

Speculative decoding is lossless per sample, but at temperature > 0 a speculative run and a plain
run with the same seed draw different random numbers, so their samples, updates and final
held-out rewards differ run by run. "Speculation leaves training unchanged" is therefore a
statement about distributions, and the right test asks the question that way round: is the
difference of the final held-out reward *within a stated margin* (Schuirmann 1987)? A plain
t-test that fails to find a difference proves nothing (few seeds always fail to find one).

`tost_paired` takes one difference per seed (spec − plain, same seed and same problems, so the
pair shares its held-out set and its prompts) and rejects non-equivalence when both one-sided
tests reject at level α, i.e. when the (1 − 2α) confidence interval of the mean difference lies
inside (−margin, +margin). Its false-equivalence rate is at most α when the true difference is
at ±margin (exactly α for normal differences, less elsewhere outside the margin);
`tost_operating_characteristics` measures that rate and the power at a true difference of 0 by
simulation, for the seed count and the spread a run observed.

Student's t distribution is computed here (regularised incomplete beta by Lentz's continued
fraction) because scipy is not a dependency; the tests check it against closed forms.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for num in (
            m * (b - m) * x / ((a + m2 - 1) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
        raise ValueError(f"regularized_beta needs a, b > 0 and 0 <= x <= 1, got a={a}, b={b}, x={x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` > 0 degrees of freedom."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


@functools.lru_cache(maxsize=256)
def t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t (bisection on `t_cdf`, to ~1e-12; cached)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {q}")
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > q:
        lo *= 2.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, abs(mid)):
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True, slots=True)
class TostResult:
    """A paired TOST of mean difference within ±margin."""

    n: int
    mean: float
    """Mean of the paired differences."""
    stderr: float
    """Sample standard deviation of the differences / sqrt(n)."""
    margin: float
    alpha: float
    p_lower: float
    """p-value of H0: mean <= -margin (against mean > -margin)."""
    p_upper: float
    """p-value of H0: mean >= +margin (against mean < +margin)."""
    ci_low: float
    ci_high: float
    """The (1 - 2 alpha) confidence interval of the mean difference."""

    @property
    def p_value(self) -> float:
        """TOST p-value: the larger one-sided p."""
        return max(self.p_lower, self.p_upper)

    @property
    def equivalent(self) -> bool:
        """Both one-sided tests reject at alpha (the CI lies inside the margin)."""
        return self.p_value < self.alpha

    def describe(self) -> str:
        verdict = "equivalent" if self.equivalent else "NOT shown equivalent"
        return (
            f"mean difference {self.mean:+.3f} ± {self.stderr:.3f} (n = {self.n}), "
            f"{100 * (1 - 2 * self.alpha):.0f}% CI [{self.ci_low:+.3f}, {self.ci_high:+.3f}], "
            f"margin ±{self.margin:.3f}: TOST p = {self.p_value:.3f} -> {verdict} at alpha = {self.alpha}"
        )


def tost_paired(differences: Sequence[float], margin: float, alpha: float = 0.05) -> TostResult:
    """Two one-sided t-tests of |mean(differences)| < margin (one difference per paired unit)."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"TOST needs at least 2 paired differences, got {n}")
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    mean = statistics.fmean(differences)
    se = statistics.stdev(differences) / math.sqrt(n)
    df = n - 1
    if se == 0.0:  # every pair differs by the same amount: decided by that amount alone
        inside = -margin < mean < margin
        p = 0.0 if inside else 1.0
        return TostResult(
            n=n, mean=mean, stderr=0.0, margin=margin, alpha=alpha, p_lower=p, p_upper=p, ci_low=mean, ci_high=mean
        )
    p_lower = 1.0 - t_cdf((mean + margin) / se, df)
    p_upper = t_cdf((mean - margin) / se, df)
    half = t_ppf(1.0 - alpha, df) * se
    return TostResult(
        n=n,
        mean=mean,
        stderr=se,
        margin=margin,
        alpha=alpha,
        p_lower=p_lower,
        p_upper=p_upper,
        ci_low=mean - half,
        ci_high=mean + half,
    )


@dataclass(frozen=True, slots=True)
class OperatingCharacteristics:
    """Simulated behaviour of `tost_paired` for n normal differences with standard deviation sigma."""

    n: int
    sigma: float
    margin: float
    alpha: float
    simulations: int
    false_equivalence: float
    """Share declared equivalent when the true mean difference is +margin (the worst case; ≤ alpha)."""
    power: float
    """Share declared equivalent when the true mean difference is 0."""

    def describe(self) -> str:
        return (
            f"calibration ({self.simulations} simulations of {self.n} normal differences, sd {self.sigma:.3f}): "
            f"declared equivalent {100 * self.false_equivalence:.1f}% of the time at a true difference of "
            f"{self.margin:+.3f} (the margin; must be <= {100 * self.alpha:.0f}%), "
            f"{100 * self.power:.1f}% at a true difference of 0 (power)"
        )


def tost_operating_characteristics(
    n: int, sigma: float, margin: float, alpha: float = 0.05, simulations: int = 4000, seed: int = 0
) -> OperatingCharacteristics:
    """False-equivalence rate at the margin and power at 0, by simulation (deterministic `seed`)."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    rng = random.Random(seed)

    def rate(true_mean: float) -> float:
        hits = 0
        for _ in range(simulations):
            sample = [rng.gauss(true_mean, sigma) for _ in range(n)]
            hits += tost_paired(sample, margin, alpha).equivalent
        return hits / simulations

    return OperatingCharacteristics(
        n=n,
        sigma=sigma,
        margin=margin,
        alpha=alpha,
        simulations=simulations,
        false_equivalence=rate(margin),
        power=rate(0.0),
    )
