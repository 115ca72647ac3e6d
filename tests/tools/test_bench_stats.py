"""The benchmarks' paired statistics (tools/bench/common.py), checked on synthetic repeats whose
truth is known: the held-out choice of the best configuration is unbiased where the in-sample
choice is not, and the bootstrap interval covers the true median about as often as it says."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from tools.bench.common import (
    against_best_held_out,
    best_in_sample,
    bootstrap_median,
    held_out_choices,
    median_ratio,
)


def _repeats(rng: random.Random, means: dict[str, float], n: int, sd: float) -> dict[str, list[float]]:
    """Per-repeat seconds: each configuration's mean times a log-normal factor of its own (the
    configurations of a repeat do not share their noise, as sampled output lengths do not)."""
    return {c: [m * math.exp(rng.gauss(0, sd)) for _ in range(n)] for c, m in means.items()}


def test_an_equal_challenger_reads_slower_against_the_in_sample_best_but_not_the_held_out_one() -> None:
    # four static configurations and the challenger all take 1 s on average: the truth is 1.0
    rng = random.Random(1)
    static = ["k1", "k2", "k3", "k4"]
    in_sample, held_out = [], []
    for _ in range(300):
        times = _repeats(rng, {**dict.fromkeys(static, 1.0), "auto": 1.0}, 20, 0.08)
        best = best_in_sample(times, static)
        in_sample.append(math.log(median_ratio(times[best], times["auto"], resamples=1).median))
        held_out.append(math.log(against_best_held_out(times, static, "auto", resamples=1).median))
    # one trial's log ratio scatters by ~sqrt(2) x 1.25 x 0.08 / sqrt(20) = 0.032, so the mean
    # of 300 trials by ~0.0018: the in-sample bias (~-1.6%) is ~9 of those, the bounds ~4 and ~3
    assert statistics.mean(in_sample) < -0.008  # the winner's curse against an equal challenger
    assert abs(statistics.mean(held_out)) < 0.006


def test_the_held_out_choice_finds_a_clearly_faster_configuration() -> None:
    times = _repeats(random.Random(2), {"k1": 1.0, "k2": 0.8, "k3": 1.0, "auto": 0.8}, 12, 0.03)
    assert held_out_choices(times, ["k1", "k2", "k3"]) == ["k2"] * 12
    assert against_best_held_out(times, ["k1", "k2", "k3"], "auto").median == pytest.approx(1.0, abs=0.05)


def test_a_reference_function_compares_with_the_faster_of_two() -> None:
    times = {"plain": [1.0, 1.0, 1.0], "k1": [2.0, 2.0, 2.0], "auto": [0.5, 0.5, 0.5]}
    r = against_best_held_out(times, ["k1"], "auto", reference=lambda c, i: min(times["plain"][i], times[c][i]))
    assert r.median == pytest.approx(2.0)


def test_the_bootstrap_interval_covers_the_true_median_about_as_often_as_it_says() -> None:
    rng = random.Random(3)
    covered = 0
    trials = 200
    for _ in range(trials):
        r = median_ratio([1.0] * 20, [math.exp(rng.gauss(0, 0.1)) for _ in range(20)], level=0.9, resamples=500)
        covered += r.low <= 1.0 <= r.high
        assert r.low <= r.median <= r.high
    assert 0.8 <= covered / trials <= 0.98


def test_bad_input_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="--repeats >= 1"):
        bootstrap_median([])
    with pytest.raises(ValueError, match="differ in number"):
        median_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="differ in number"):
        against_best_held_out({"a": [1.0, 2.0], "auto": [1.0]}, ["a"], "auto")
    with pytest.raises(ValueError, match="--repeats >= 2"):
        held_out_choices({"a": [1.0]}, ["a"])
    with pytest.raises(ValueError, match="level"):
        bootstrap_median([1.0], level=1.5)
