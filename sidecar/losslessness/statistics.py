"""Goodness-of-fit tests of sampled tokens against exact distributions, with exact p-values.

A certificate that fails a correct deployment teaches its users to ignore it, so these tests
are calibrated by construction: under the null their false-rejection rate is at most the
stated alpha for any distributions and any sample size, not only asymptotically.

**Exact p-values (`exact_pearson`, `pearson_fit`).** Counts over cells with exactly known
probabilities are multinomial under the null. Pearson's statistic over those cells is kept (it
weighs a deviation by its cell's expected count, so a rare cell that fills up stands out), but
its p-value is not read off the chi-square curve: that approximation is liberal by 2-20x at
alpha = 1e-4..1e-5 when a cell expects 5-20 counts (a near-deterministic position has exactly
such a cell), and, with a pooled cell expecting 0.01 counts, by orders of magnitude — the root
of `specrl verify` failing correct sidecars. The p-value is a Monte Carlo one from the exact
multinomials, with Besag and Clifford's sequential stopping ("Sequential Monte Carlo
p-values", Biometrika 1991): simulate until `EXCEEDANCES` simulated statistics reach the
observed one (p = h / l after l simulations) or until 1 / `resolution` simulations (p = (g + 1)
/ (R + 1)). Such a p-value satisfies P(p <= a) <= a for every a, whatever the cells; a p-value
far above alpha costs ~20 / p simulations, one below the resolution 1 / resolution. Cells
expecting fewer than `MIN_EXPECTED` counts are pooled — not for calibration (the p-value is
exact either way) but for power: a cell expecting 0.01 adds a 1% chance of a huge statistic to
the null and so masks every real deviation; a pool (the tail) expecting at least `MIN_TAIL`
stands alone, since at a near-deterministic position the tail is where a deviation shows.

**Per-sample distributions (`conditional_fit`).** Token t of sample i was drawn from its own
p_i = P(x_t | prompt, x_<t). Samples that share a prefix (the first positions after a prompt,
and wherever a trained policy is confident) form a group with one fixed distribution: a table
over its tokens, so a deviation towards particular tokens keeps its direction. The other
samples are counted in rank categories (the most likely token under their own p_i, the second,
..., merged until each category expects `MIN_EXPECTED`) — but a sample's category is not
multinomial with a common law, since each sample has its own pi_i over the categories. The
randomised probability integral transform fixes that: u_i = F_i(x_i - 1) + U_i p_i(x_i) is
exactly uniform under the null for every p_i, so any fixed rearrangement of [0, 1) followed by
fixed bins gives counts that are exactly Multinomial(n, bin widths). `rank_table` uses the
rearrangement that is the maximal coupling of pi_i and the mean w = mean_i pi_i: a sample is
counted in its own category c with probability min(1, w_c / pi_ic) and otherwise in a category
drawn in proportion to (w - pi_i)^+. Under the null its bin is exactly w-distributed and
independent of the others; under a deviation, the category counts reach the table as undiluted
as possible (with one shared distribution, exactly Pearson's test over ranks). Equal-width bins
on u would be calibrated too, but they spread a near-deterministic position's top token over
every bin and its tail over a sliver of one, losing most of the power there. The rank-category
test this replaces (a quadratic form in an empirical covariance, chi-square p-value) was not
calibrated: near-deterministic positions left directions of almost no variance, in which one
ordinary token made an enormous statistic. The group tables and the rank table of a position
are independent given the prefixes, so their statistics add up and their joint null is
simulated table by table.

**Positions (`combine`).** Positions are tested one by one; their p-values are combined with
Fisher's method, -2 sum log p_t ~ chi-square(2T). That is exact here too: each position's
p-value is super-uniform given everything before it (its tables depend on the prefixes only),
so the p-values are stochastically no smaller than independent uniforms. (Adding the
positions' statistics, as the old joint test did, is not: a position's tables — its prefix
groups — are made of the previous position's tokens, so its null law and the previous
statistic are dependent.)

Total-variation estimates (`Fit.tv`, from `conditional_fit`): lower bounds of the mean
per-prefix TV, from the token and the rank marginals, reported with their noise floor under the
null (normal approximation), so a reader can tell a deviation from sampling noise. They are
descriptive; the verdicts come from the p-values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

MIN_EXPECTED = 5.0
"""Pool cells (and merge ranks) until each expects at least this many counts."""
MIN_TAIL = 1.0
"""The pool of small cells (the tail of the ranks) stands alone if it expects this many counts:
at a near-deterministic position the tail is where a deviation shows."""
MIN_GROUP = 20
"""Samples sharing a prefix that get their own token-cell table."""
RESOLUTION = 1e-5
"""Smallest Monte Carlo p-value: at most 1 / RESOLUTION simulations per test."""
EXCEEDANCES = 20
"""Besag-Clifford stopping: simulation stops once this many simulated statistics reach the observed."""
_FIRST_BATCH = 128
"""Simulations in the first Monte Carlo batch (each next batch is twice as large)."""


def chi_square_sf(statistic: float, df: int) -> float:
    """P(chi2_df >= statistic): the p-value of a chi-square statistic (1.0 when df = 0)."""
    if df <= 0:
        return 1.0
    half = torch.tensor([df / 2.0, statistic / 2.0], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


@dataclass(kw_only=True, slots=True)
class Fit:
    """A goodness-of-fit result."""

    statistic: float
    df: int
    """Cells tested minus one (0: nothing to test, p = 1)."""
    p_value: float
    samples: int
    """Tokens tested."""
    impossible: int = 0
    """Tokens whose exact probability is 0 (outside top-k/top-p): each alone disproves the null."""
    simulations: int = 0
    """Monte Carlo simulations of the exact null behind `p_value`."""
    tv: float = 0.0
    """Total-variation estimate (see the module docstring); 0 for combined fits."""
    tv_noise: float = 0.0
    """Its expected value under the null (normal approximation): TV below this is noise."""


def pool_small_cells(probs: Tensor, total: int, min_expected: float = MIN_EXPECTED) -> Tensor:
    """(C,) int64: the pooled cell of each cell. Cells expecting fewer than `min_expected` of
    `total` counts share one pool; a pool expecting fewer than `MIN_TAIL` joins the smallest
    other cell. Cells of probability 0 go to the pool too (a count there is flagged as impossible)."""
    probs = probs.double()
    expected = probs * total
    small = expected < min_expected
    big = (~small).nonzero()[:, 0]
    cell = torch.empty(len(probs), dtype=torch.int64)
    cell[big] = torch.arange(len(big))
    pool = len(big)
    if small.any() and float(expected[small].sum()) < min(MIN_TAIL, min_expected) and len(big):
        pool = int(cell[big[expected[big].argmin()]])
    cell[small] = pool
    return cell


@dataclass(frozen=True, slots=True)
class Table:
    """Counts over cells that are exactly Multinomial(total, probs) under the null, after pooling."""

    counts: np.ndarray  # (C,) float64
    probs: np.ndarray  # (C,) float64, summing to 1

    @staticmethod
    def of(counts: Tensor, probs: Tensor, min_expected: float = MIN_EXPECTED) -> Table:
        """`counts` (C,) against `probs` (C,), small cells pooled (`pool_small_cells`)."""
        counts, probs = counts.double(), probs.double()
        cell = pool_small_cells(probs, int(counts.sum()), min_expected)
        cells = int(cell.max()) + 1 if len(cell) else 0
        pooled_p = torch.zeros(cells, dtype=torch.float64).index_add_(0, cell, probs)
        pooled_c = torch.zeros(cells, dtype=torch.float64).index_add_(0, cell, counts)
        return Table(counts=pooled_c.numpy(), probs=(pooled_p / pooled_p.sum()).numpy())

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def pearson(self, counts: np.ndarray) -> np.ndarray:  # (R, C) -> (R,)
        """Pearson's statistic of each row of `counts` against this table's expected counts."""
        expected = self.probs * self.total
        return ((counts - expected) ** 2 / expected).sum(axis=-1)


def exact_pearson(tables: list[Table], seed: int, resolution: float = RESOLUTION) -> tuple[float, int, float, int]:
    """(statistic, df, p-value, simulations) of the sum of Pearson's statistics over independent
    tables; the p-value is the Besag-Clifford Monte Carlo one from the tables' exact multinomials
    (module docstring), so P(p <= a) <= a under the null for every a."""
    tables = [t for t in tables if len(t.counts) > 1 and t.total > 0]
    df = sum(len(t.counts) - 1 for t in tables)
    if not tables:
        return 0.0, 0, 1.0, 0
    observed = float(sum(t.pearson(t.counts[None])[0] for t in tables))
    threshold = observed - 1e-9 * abs(observed)  # float ties count as exceedances: conservative
    rng = np.random.default_rng(seed)
    limit = max(math.ceil(1.0 / resolution), EXCEEDANCES)
    done = hits = 0
    batch = _FIRST_BATCH
    while done < limit:
        size = min(batch, limit - done)
        sims = sum(t.pearson(rng.multinomial(t.total, t.probs, size=size).astype(np.float64)) for t in tables)
        exceed = np.flatnonzero(sims >= threshold)
        if hits + len(exceed) >= EXCEEDANCES:
            stop = done + int(exceed[EXCEEDANCES - hits - 1]) + 1  # the simulation with the h-th exceedance
            return observed, df, EXCEEDANCES / stop, stop
        hits += len(exceed)
        done += size
        batch *= 2
    return observed, df, (hits + 1) / (limit + 1), limit


def pearson_fit(
    counts: Tensor,  # (C,) observed counts per cell
    probs: Tensor,  # (C,) exact cell probabilities, summing to 1
    *,
    min_expected: float = MIN_EXPECTED,
    resolution: float = RESOLUTION,
    seed: int = 0,
) -> Fit:
    """Pearson's statistic of counts against one fixed distribution, small cells pooled
    (`pool_small_cells`), with the exact Monte Carlo p-value (module docstring; `seed` picks the
    simulations). A count in a cell of probability 0 is impossible under the null: p = 0."""
    if counts.shape != probs.shape or counts.dim() != 1:
        raise ValueError(f"counts and probs must be equal-length vectors, got {tuple(counts.shape)}, {probs.shape}")
    impossible = int(counts.double()[probs <= 0].sum())
    statistic, df, p_value, simulations = exact_pearson([Table.of(counts, probs, min_expected)], seed, resolution)
    return Fit(
        statistic=statistic,
        df=df,
        p_value=0.0 if impossible else p_value,
        samples=int(counts.sum()),
        impossible=impossible,
        simulations=simulations,
    )


def pooled_chi_square_pvalue(counts: Tensor, probs: Tensor, *, seed: int = 0) -> float:
    """The exact p-value of `pearson_fit` (the engine tests' exact-joint harness)."""
    return pearson_fit(counts, probs, seed=seed).p_value


def rank_categories(
    mean_ranked: Tensor,  # (V,) the samples' sorted (decreasing) probabilities, averaged
    samples: int,
    min_expected: float = MIN_EXPECTED,
) -> Tensor:  # (V,) int64 the category of each rank
    """Consecutive ranks (the most likely token, the second, ...) merged until each category
    expects at least `min_expected` of the samples; a last one (the tail) expecting fewer than
    `MIN_TAIL` joins the one before."""
    category, current, mass = [], 0, 0.0
    for share in mean_ranked.tolist():
        category.append(current)
        mass += share
        if mass * samples >= min_expected:
            current, mass = current + 1, 0.0
    out = torch.tensor(category, dtype=torch.int64)
    last = int(out.max())
    if last > 0 and float(mean_ranked[out == last].sum()) * samples < min(MIN_TAIL, min_expected):
        out[out == last] = last - 1
    return out


def rank_table(
    sorted_p: Tensor,  # (n, V) each sample's exact distribution, sorted (decreasing; ties: lower id first)
    rank: Tensor,  # (n,) int64 the drawn token's rank in its own distribution
    uniforms: Tensor,  # (n, 2) independent uniforms on [0, 1)
    min_expected: float = MIN_EXPECTED,
) -> Table:
    """Rank categories of tokens from per-sample distributions as counts that are exactly
    Multinomial(n, w) under the null (module docstring).

    Sample i's token falls in rank category c with probability pi_ic (its own distribution);
    w_c = mean_i pi_ic. The sample is counted in bin c itself with probability min(1, w_c / pi_ic)
    and otherwise in a bin drawn in proportion to (w - pi_i)^+ — the maximal coupling of pi_i
    and w, a measure-preserving rearrangement of the randomised PIT: whatever pi_i is, the bin is
    exactly w-distributed under the null, and it is the token's own category as often as
    possible, so a deviation in the categories reaches the counts undiluted.
    """
    n = len(rank)
    category = rank_categories(sorted_p.mean(dim=0), n, min_expected)  # (V,)
    bins = int(category.max()) + 1
    pi = torch.zeros(n, bins, dtype=torch.float64).index_add_(1, category, sorted_p)  # (n, B)
    w = pi.mean(dim=0)  # (B,)
    own = category[rank]  # (n,)
    stay = uniforms[:, 0] * pi[torch.arange(n), own] < w[own]
    spare = (w - pi).clamp(min=0.0).cumsum(dim=1)  # (n, B)
    elsewhere = (spare <= (uniforms[:, 1] * spare[:, -1])[:, None]).sum(dim=1).clamp(max=bins - 1)
    counts = torch.bincount(torch.where(stay, own, elsewhere), minlength=bins).double()
    return Table(counts=counts.numpy(), probs=(w / w.sum()).numpy())


def conditional_fit(
    probs: Tensor,  # (n, V) the exact distribution each token was drawn from
    tokens: Tensor,  # (n,) int64 the drawn tokens
    groups: Tensor | None = None,  # (n,) int64 samples with equal ids share their prefix
    *,
    seed: int = 0,
    min_group: int = MIN_GROUP,
    min_expected: float = MIN_EXPECTED,
    resolution: float = RESOLUTION,
) -> Fit:
    """Tokens against per-sample exact distributions (module docstring): Pearson over token cells
    within each prefix group of at least `min_group` samples (one fixed distribution each: a
    deviation towards particular tokens keeps its direction), rank categories (`rank_table`) over
    the other samples, their statistics summed, with the exact Monte Carlo p-value; and the TV
    estimate over all samples. `seed` draws the PIT's uniforms and the simulations."""
    n = len(tokens)
    if probs.dim() != 2 or probs.shape[0] != n or (groups is not None and groups.shape != tokens.shape):
        raise ValueError(f"probs must be (n, V) and groups (n,) for n = {n} tokens, got {tuple(probs.shape)}")
    if n == 0:
        return Fit(statistic=0.0, df=0, p_value=1.0, samples=0)
    probs = probs.double()
    tables = []
    rest = torch.ones(n, dtype=torch.bool)
    if groups is not None:
        _, inverse, sizes = torch.unique(groups, return_inverse=True, return_counts=True)
        for g in (sizes >= min_group).nonzero()[:, 0].tolist():
            member = inverse == g
            counts = torch.bincount(tokens[member], minlength=probs.shape[1])
            tables.append(Table.of(counts, probs[member].mean(dim=0), min_expected))
            rest &= ~member
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
    if rest.any():
        uniforms = torch.rand(n, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)[rest]
        rank = (order[rest] == tokens[rest, None]).to(torch.int64).argmax(dim=-1)
        tables.append(rank_table(sorted_p[rest], rank, uniforms, min_expected))
    statistic, df, p_value, simulations = exact_pearson(tables, seed, resolution)
    impossible = int((probs[torch.arange(n), tokens] <= 0).sum())
    tv, tv_noise = _total_variation(probs, tokens, sorted_p, order)
    return Fit(
        statistic=statistic,
        df=df,
        p_value=0.0 if impossible else p_value,
        samples=n,
        impossible=impossible,
        simulations=simulations,
        tv=tv,
        tv_noise=tv_noise,
    )


def combine(fits: list[Fit]) -> Fit:
    """The joint test of positions: Fisher's -2 sum log p over every fit (one with nothing to
    test counts with p = 1), exact for sequentially super-uniform p-values (module docstring)."""
    impossible = sum(f.impossible for f in fits)
    statistic = -2.0 * sum(math.log(max(f.p_value, 1e-300)) for f in fits)
    return Fit(
        statistic=statistic,
        df=2 * len(fits),
        p_value=0.0 if impossible else chi_square_sf(statistic, 2 * len(fits)),
        samples=sum(f.samples for f in fits),
        impossible=impossible,
        simulations=sum(f.simulations for f in fits),
    )


def _tv_and_noise(observed: Tensor, probs: Tensor) -> tuple[float, float]:
    """TV between the empirical and the averaged exact distribution over the columns, and its
    expected value under the null (E|N(0, s^2)| = s sqrt(2/pi) per column)."""
    n = len(probs)
    diff = (observed - probs).sum(dim=0) / n
    noise = math.sqrt(2 / math.pi) * (probs * (1 - probs)).sum(dim=0).sqrt().sum() / n
    return 0.5 * float(diff.abs().sum()), 0.5 * float(noise)


def _total_variation(
    probs: Tensor,  # (n, V) exact distributions
    tokens: Tensor,  # (n,) drawn tokens
    sorted_p: Tensor,  # (n, V) probs sorted descending
    order: Tensor,  # (n, V) the token ids in that order
) -> tuple[float, float]:
    """(TV estimate, its expected value under the null).

    The distance between the sampled and the exact distribution after each prefix cannot be
    measured from one sample per prefix; what can be measured is the TV of the token marginal
    (averaged over the observed prefixes) and of the rank marginal. Both are lower bounds of the
    mean per-prefix TV (a mixture and a relabelling never increase TV); the one further above
    its noise floor is returned, with that floor.
    """
    one_hot = torch.zeros_like(probs).scatter_(1, tokens[:, None], 1.0)
    by_token = _tv_and_noise(one_hot, probs)
    by_rank = _tv_and_noise(one_hot.gather(1, order), sorted_p)
    return max(by_token, by_rank, key=lambda tv_noise: tv_noise[0] - tv_noise[1])
