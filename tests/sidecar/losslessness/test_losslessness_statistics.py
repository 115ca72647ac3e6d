"""The certificate's goodness-of-fit statistics against closed forms and simulation.

Oracles: the chi-square survival function in closed form for even degrees of freedom; Pearson's
statistic written out by hand; the exact binomial tail of a two-cell table (the Monte Carlo
p-value must match it); Fisher's combination in closed form for two p-values; and Pearson's
test over ranks when every sample shares one distribution. The null calibration over
policy-like distributions is in test_losslessness_calibration.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from sidecar.losslessness.statistics import (
    RESOLUTION,
    Fit,
    chi_square_sf,
    combine,
    conditional_fit,
    pearson_fit,
    pool_small_cells,
)


def test_chi_square_sf_matches_the_closed_form_for_even_df() -> None:
    for df in (2, 4, 6):
        for x in (0.5, 3.0, 11.0):
            closed = math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(df // 2))
            assert abs(chi_square_sf(x, df) - closed) < 1e-12
    assert chi_square_sf(5.0, 0) == 1.0


def test_pearson_fit_is_pearsons_statistic_and_a_zero_probability_count_is_impossible() -> None:
    counts = torch.tensor([45.0, 30.0, 15.0, 10.0])
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    fit = pearson_fit(counts, probs)
    expected = probs * 100
    assert abs(fit.statistic - float(((counts - expected) ** 2 / expected).sum())) < 1e-9 and fit.df == 3
    bad = pearson_fit(torch.tensor([50.0, 49.0, 1.0]), torch.tensor([0.5, 0.5, 0.0]))
    assert bad.impossible == 1 and bad.p_value == 0.0


def test_small_cells_are_pooled_and_a_pool_expecting_too_little_joins_the_smallest_cell() -> None:
    probs = torch.tensor([0.5, 0.3, 0.19, 0.006, 0.004], dtype=torch.float64)
    assert pool_small_cells(probs, total=1000).tolist() == [0, 1, 2, 3, 4]  # a tail expecting 4 stands alone
    assert pool_small_cells(probs, total=300).tolist() == [0, 1, 2, 3, 3]  # two small cells pooled: 3
    assert pool_small_cells(probs, total=50).tolist() == [0, 1, 2, 2, 2]  # 0.5: joins the 9.5
    assert pool_small_cells(probs, total=2).tolist() == [0, 0, 0, 0, 0]  # nothing left to test
    fit = pearson_fit(torch.tensor([25.0, 15.0, 9.0, 1.0, 0.0]), probs)  # the one rare token is no evidence
    assert fit.df == 2 and fit.p_value > 0.5


def _binomial_two_sided_pearson_tail(n: int, p: float, observed: int) -> float:
    """P(X^2 >= X^2_observed) for a two-cell table: the exact binomial sum."""

    def x2(k: int) -> float:
        return (k - n * p) ** 2 / (n * p * (1 - p))

    log_pmf = [
        math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
        for k in range(n + 1)
    ]
    return sum(math.exp(lp) for k, lp in enumerate(log_pmf) if x2(k) >= x2(observed) - 1e-9)


@pytest.mark.parametrize(("observed", "seed"), [(14, 0), (12, 1), (0, 2)])
def test_the_monte_carlo_p_value_is_the_exact_tail_where_the_chi_square_curve_is_not(observed: int, seed: int) -> None:
    """A cell expecting 5 of 1000 counts: for 14 counts the chi-square curve says p = 5.5e-5,
    the exact binomial tail is 6.7e-4, 12x larger. The Monte Carlo p-value (Besag-Clifford: 20
    exceedances, so ~22% relative error) must find the exact one."""
    n, p = 1000, 0.005
    fit = pearson_fit(torch.tensor([n - observed, observed], dtype=torch.float64), torch.tensor([1 - p, p]), seed=seed)
    exact = _binomial_two_sided_pearson_tail(n, p, observed)
    assert 0.5 * exact < fit.p_value < 2 * exact, (fit.p_value, exact)
    if observed >= 14:
        assert chi_square_sf(fit.statistic, 1) < exact / 5  # what the old p-value said
    assert fit.simulations == pytest.approx(20 / fit.p_value)


def test_a_p_value_below_the_resolution_is_reported_at_the_resolution() -> None:
    counts = torch.tensor([900.0, 100.0])
    fit = pearson_fit(counts, torch.tensor([0.95, 0.05]), resolution=1e-4)
    assert fit.p_value == pytest.approx(1 / (1e4 + 1)) and fit.simulations == 10_000
    assert pearson_fit(counts, torch.tensor([0.95, 0.05])).p_value == pytest.approx(RESOLUTION, rel=1e-4)


def test_fishers_combination_is_the_closed_form_for_two_p_values() -> None:
    a, b = Fit(statistic=0, df=1, p_value=0.03, samples=10), Fit(statistic=0, df=1, p_value=0.2, samples=10)
    x = 0.03 * 0.2
    joint = combine([a, b])
    assert joint.p_value == pytest.approx(x * (1 - math.log(x)), rel=1e-9) and joint.samples == 20


def test_conditional_fit_with_one_shared_distribution_is_pearson_over_ranks() -> None:
    """Samples that share one distribution (but not a prefix group) are counted in their rank
    categories exactly (the coupling never moves them): Pearson's statistic over the ranks."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)  # ranks: token 1, 3, 2, 0
    tokens = torch.multinomial(probs, 1000, replacement=True, generator=gen)
    by_rank = torch.bincount(tokens, minlength=4)[[1, 3, 2, 0]].double()
    ours = conditional_fit(probs.expand(1000, -1), tokens)
    oracle = pearson_fit(by_rank, probs[[1, 3, 2, 0]])
    assert abs(ours.statistic - oracle.statistic) < 1e-6 and ours.df == oracle.df == 3


def test_conditional_fit_rejects_samples_from_a_sharper_distribution() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2000, 12, generator=gen, dtype=torch.float64)
    probs, sharper = torch.softmax(logits, -1), torch.softmax(1.3 * logits, -1)
    tokens = torch.multinomial(sharper, 1, generator=gen)[:, 0]
    fit = conditional_fit(probs, tokens)
    assert fit.p_value < 1e-4 and fit.tv > 2 * fit.tv_noise
    assert conditional_fit(probs, torch.multinomial(probs, 1, generator=gen)[:, 0]).p_value > 1e-3


def test_conditional_fit_sees_a_ten_times_heavier_tail_at_near_deterministic_positions() -> None:
    """Where the old statistics blew up on one ordinary tail token, the exact test still sees a
    real deviation: every sample's top token has 0.999 (each its own distribution), the sampler
    emits the tail ten times too often."""
    gen = torch.Generator().manual_seed(3)
    n, vocab = 4000, 50
    top = torch.randint(0, vocab, (n,), generator=gen)
    tail = torch.rand(n, vocab, generator=gen, dtype=torch.float64)
    probs = tail.scatter(1, top[:, None], 0.0)
    probs = 1e-3 * probs / probs.sum(dim=1, keepdim=True) + 0.999 * torch.nn.functional.one_hot(top, vocab)
    wrong = 1e-2 * probs.scatter(1, top[:, None], 0.0) / 1e-3 + 0.99 * torch.nn.functional.one_hot(top, vocab)
    assert conditional_fit(probs, torch.multinomial(wrong, 1, generator=gen)[:, 0]).p_value < 1e-4
    assert conditional_fit(probs, torch.multinomial(probs, 1, generator=gen)[:, 0]).p_value > 1e-3
