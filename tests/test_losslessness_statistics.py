"""The certificate's goodness-of-fit statistics against closed forms and simulation.

Oracles: the chi-square survival function in closed form for even degrees of freedom; Pearson's
statistic written out by hand; and the null distribution itself, simulated (p-values of a
calibrated test are uniform).
"""

from __future__ import annotations

import math

import torch

from sidecar.losslessness.statistics import chi_square_sf, conditional_fit, pearson_fit, rank_fit


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


def test_rank_fit_with_one_shared_distribution_is_pearson_over_ranks() -> None:
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)  # ranks: token 1, 3, 2, 0
    tokens = torch.multinomial(probs, 1000, replacement=True, generator=gen)
    by_rank = torch.bincount(tokens, minlength=4)[[1, 3, 2, 0]].double()
    ours = rank_fit(probs.expand(1000, -1), tokens)
    oracle = pearson_fit(by_rank, probs[[1, 3, 2, 0]])
    assert abs(ours.statistic - oracle.statistic) < 1e-6 and ours.df == oracle.df == 3


def _null_pvalues(reps: int, n: int, vocab: int, shared_prefixes: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(reps):
        groups = torch.randint(0, 3, (n,), generator=gen) if shared_prefixes else None
        logits = torch.randn(3 if shared_prefixes else n, vocab, generator=gen, dtype=torch.float64) * 2
        probs = torch.softmax(logits, -1)
        probs = probs[groups] if groups is not None else probs
        tokens = torch.multinomial(probs, 1, generator=gen)[:, 0]
        out.append(conditional_fit(probs, tokens, groups, min_group=50).p_value)
    return torch.tensor(out)


def test_conditional_fit_is_calibrated_under_the_null() -> None:
    """Every sample from its own distribution (rank part) or from a few shared ones (Pearson
    part): p-values are uniform, so a correct engine fails at rate alpha and no more."""
    for shared in (False, True):
        p = _null_pvalues(reps=300, n=400, vocab=12, shared_prefixes=shared)
        for q in (0.1, 0.5):
            assert abs(float((p < q).double().mean()) - q) < 0.06, (shared, q, p.sort().values[:10])


def test_conditional_fit_rejects_samples_from_a_sharper_distribution() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2000, 12, generator=gen, dtype=torch.float64)
    probs, sharper = torch.softmax(logits, -1), torch.softmax(1.3 * logits, -1)
    tokens = torch.multinomial(sharper, 1, generator=gen)[:, 0]
    fit = conditional_fit(probs, tokens)
    assert fit.p_value < 1e-6 and fit.tv > 2 * fit.tv_noise
    assert conditional_fit(probs, torch.multinomial(probs, 1, generator=gen)[:, 0]).p_value > 1e-3
