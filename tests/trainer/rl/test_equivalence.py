"""The paired TOST of `trainer.rl.equivalence`: Student's t against closed forms, the test's decision
against its definition, and its calibration by simulation (false equivalence <= alpha at the
margin, power at a true difference of 0)."""

from __future__ import annotations

import math

import pytest

from trainer.rl.equivalence import regularized_beta, t_cdf, t_ppf, tost_operating_characteristics, tost_paired


@pytest.mark.parametrize("t", [-7.5, -2.0, -0.3, 0.0, 0.4, 1.0, 3.2, 40.0])
def test_t_cdf_matches_the_closed_forms_for_one_and_two_degrees_of_freedom(t: float) -> None:
    assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)  # Cauchy
    assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


def test_t_cdf_tends_to_the_normal_and_matches_scipy_where_available() -> None:
    normal = 0.5 * (1 + math.erf(1.7 / math.sqrt(2)))
    assert t_cdf(1.7, 1e7) == pytest.approx(normal, abs=1e-6)
    assert regularized_beta(2.0, 3.0, 0.4) == pytest.approx(0.5248, abs=1e-12)  # 1 - sum of binomial(4, 0.4) terms
    stats = pytest.importorskip("scipy.stats")
    for df in (3, 7, 30):
        for t in (-2.5, 0.7, 1.9):
            assert t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-10)


@pytest.mark.parametrize(("q", "df", "expected"), [(0.95, 3, 2.353363), (0.975, 10, 2.228139), (0.95, 1, 6.313752)])
def test_t_ppf_inverts_the_cdf_at_tabulated_quantiles(q: float, df: int, expected: float) -> None:
    assert t_ppf(q, df) == pytest.approx(expected, abs=1e-6)
    assert t_cdf(t_ppf(q, df), df) == pytest.approx(q, abs=1e-10)


def test_tost_by_hand() -> None:
    diffs = [0.01, -0.02, 0.03, 0.0]
    r = tost_paired(diffs, margin=0.05, alpha=0.05)
    mean, se = 0.005, math.sqrt(sum((d - 0.005) ** 2 for d in diffs) / 3) / 2
    assert r.mean == pytest.approx(mean) and r.stderr == pytest.approx(se)
    assert r.p_lower == pytest.approx(1 - t_cdf((mean + 0.05) / se, 3))
    assert r.p_upper == pytest.approx(t_cdf((mean - 0.05) / se, 3))
    assert (r.ci_low, r.ci_high) == pytest.approx((mean - 2.353363 * se, mean + 2.353363 * se), abs=1e-6)
    assert r.equivalent  # CI [-0.019, +0.029] lies inside ±0.05
    assert not tost_paired(diffs, margin=0.02).equivalent  # but not inside ±0.02
    shifted = tost_paired([d + 0.06 for d in diffs], margin=0.05)
    assert not shifted.equivalent and shifted.p_upper > 0.5


@pytest.mark.parametrize("seed", range(5))
def test_the_decision_is_the_confidence_interval_inside_the_margin(seed: int) -> None:
    import random

    rng = random.Random(seed)
    for _ in range(50):
        diffs = [rng.gauss(rng.uniform(-0.08, 0.08), rng.uniform(0.005, 0.06)) for _ in range(rng.randint(2, 8))]
        r = tost_paired(diffs, margin=0.05)
        assert r.equivalent == (r.ci_low > -0.05 and r.ci_high < 0.05)


def test_calibration_false_equivalence_at_most_alpha_and_power_against_named_alternatives() -> None:
    # 4 seeds, an across-seed sd of the difference of 0.02: at a true difference of exactly the
    # margin, TOST declares equivalence with probability <= alpha (= alpha for normal data;
    # 3000 simulations: binomial sd 0.4%, so 5% + 1.2% bounds it at ~3 sd)
    oc = tost_operating_characteristics(n=4, sigma=0.02, margin=0.05, alpha=0.05, simulations=3000, seed=1)
    assert oc.false_equivalence <= 0.05 + 0.012
    assert oc.power >= 0.80  # a true difference of 0 is found equivalent
    # a larger spread at the same seed count: calibration holds, the power is what falls
    noisy = tost_operating_characteristics(n=4, sigma=0.06, margin=0.05, alpha=0.05, simulations=3000, seed=2)
    assert noisy.false_equivalence <= 0.05 + 0.012
    assert noisy.power < 0.3


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        tost_paired([0.1], margin=0.05)
    with pytest.raises(ValueError, match="margin"):
        tost_paired([0.1, 0.2], margin=0.0)
    with pytest.raises(ValueError, match="alpha"):
        tost_paired([0.1, 0.2], margin=0.05, alpha=0.5)
    assert tost_paired([0.01, 0.01, 0.01], margin=0.05).equivalent  # no spread: the difference decides
    assert not tost_paired([0.07, 0.07], margin=0.05).equivalent
