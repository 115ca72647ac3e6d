"""The counter-based uniforms (`sidecar.engine.counter_rng`): uniform, pairwise independent, pure.

Statistical tests ship with their calibration: each chi-square test is run on torch.rand's own
uniforms (the reference generator) for many seeds and must reject at most about alpha of them,
and has power against named wrong generators that it must reject (an unmixed xor of the key words, a key without the position). Seeds are fixed, so the outcomes are deterministic.
"""

from __future__ import annotations

import pytest
import torch

from sidecar.engine import counter_rng
from sidecar.losslessness.statistics import chi_square_sf

ALPHA = 0.001
BINS = 64


def chi_square_p(u: torch.Tensor, bins: int = BINS) -> float:
    """p-value of the uniformity chi-square of u (flat, in [0, 1)) over `bins` equal bins."""
    counts = torch.bincount((u * bins).long().clamp(max=bins - 1).flatten(), minlength=bins).double()
    expected = u.numel() / bins
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi_square_sf(stat, bins - 1)


def pairs_p(u1: torch.Tensor, u2: torch.Tensor, side: int = 8) -> float:
    """p-value of the independence chi-square of (u1, u2) over side x side cells."""
    cell = (u1 * side).long().clamp(max=side - 1) * side + (u2 * side).long().clamp(max=side - 1)
    return chi_square_p((cell.double() + 0.5) / (side * side), side * side)


def grid(seeds: torch.Tensor, positions: torch.Tensor, k: int = 3) -> torch.Tensor:
    return counter_rng.uniforms(counter_rng.row_keys(seeds), counter_rng.round_words(positions, k))


def test_values_are_in_unit_interval_and_pure_functions_of_the_key() -> None:
    seeds = torch.tensor([0, 1, 2**62 + 12345, 2**63 - 1])
    positions = torch.tensor([0, 7, 100, 2**24 - 1])
    u = grid(seeds, positions)
    assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # the same key alone, in another batch, at another row: the same value (batch independence)
    for i in range(4):
        alone = grid(seeds[i : i + 1], positions[i : i + 1])
        assert torch.equal(alone[0], u[i])
    # a round's k decides only how many columns there are, not their values
    assert torch.equal(grid(seeds, positions, k=1)[:, :1], u[:, :1])
    assert torch.equal(grid(seeds, positions, k=1)[:, 2], u[:, 6])


def test_uniformity_and_pairwise_independence_pass_calibrated_chi_square_tests() -> None:
    seeds = torch.arange(4096) * 7919 + 11
    positions = torch.arange(4096) % 300
    u = grid(seeds, positions, k=4)  # (4096, 9)
    assert chi_square_p(u) > ALPHA
    # neighbours in a round, the same column at consecutive positions, consecutive seeds
    assert pairs_p(u[:, 0], u[:, 1]) > ALPHA
    assert pairs_p(u[:, 0], u[:, 4]) > ALPHA
    nxt = grid(seeds, positions + 1, k=4)
    assert pairs_p(u[:, 8], nxt[:, 8]) > ALPHA
    assert pairs_p(u[:-1, 0], u[1:, 0]) > ALPHA


def test_calibration_false_rejections_of_the_reference_generator_are_about_alpha() -> None:
    """The same tests on torch.rand: at alpha = 0.05 (so that 200 runs measure it), the rejection
    rate stays within a binomial 99.9% band of 0.05."""
    gen = torch.Generator().manual_seed(0)
    runs = 200
    rejected = sum(chi_square_p(torch.rand(4096 * 9, generator=gen)) < 0.05 for _ in range(runs))
    rejected += sum(
        pairs_p(torch.rand(4096, generator=gen), torch.rand(4096, generator=gen)) < 0.05 for _ in range(runs)
    )
    assert rejected <= 2 * runs * 0.05 + 3.3 * (2 * runs * 0.05 * 0.95) ** 0.5


@pytest.mark.parametrize("wrong", ["unmixed", "ignores_position"])
def test_the_tests_reject_wrong_generators(wrong: str) -> None:
    seeds = torch.arange(4096) * 7919 + 11
    positions = torch.arange(4096) % 300
    if wrong == "unmixed":  # key words xored without the mixer: structured seeds give structured bits
        words = counter_rng.round_words(positions, 1)
        u = ((((seeds & 0xFFFFFFFF)[:, None] ^ words) >> 8).double() / (1 << 24)).float()
        assert chi_square_p(u) < ALPHA
    else:  # a key without the position: the same uniform at consecutive positions
        keys = counter_rng.row_keys(seeds)
        a = counter_rng.uniforms(keys, counter_rng.round_words(torch.zeros_like(positions), 1))
        assert pairs_p(a[:, 2], a[:, 2]) < ALPHA
