"""Goodness-of-fit statistics of sampled tokens against exact distributions.

Two situations:

- `pearson_fit` / `pooled_chi_square_pvalue`: counts over a fixed set of cells (e.g. all V^3
  continuations of one prompt, or the next token after one fixed prefix) against their exact
  probabilities; cells with expected count < 5 are pooled into one. The classic test; the
  engine tests use it on a tiny vocabulary.

- `conditional_fit`: token t of sample i was drawn from p_i = P(x_t | prompt, x_<t), which
  depends on the sample's own prefix. Samples that share a prefix (the first positions after a
  prompt, where many do) form a group with one fixed distribution: a Pearson test over its
  token cells, as above. The remaining samples, whose prefixes are rare, go to `rank_fit`: each
  token is mapped to a category by its rank under its own p_i (most likely token, second, ...,
  the tail pooled so that every category expects >= 5), and the vector of observed-minus-
  expected category counts S = sum_i (onehot_i - pi_i) is tested with its exact covariance
  C = sum_i (diag(pi_i) - pi_i pi_i^T): S^T C^+ S is asymptotically chi-square with rank(C)
  degrees of freedom (a martingale central limit theorem: the increments are conditionally
  mean-zero given the prefixes, whatever distribution the prefixes have; with identical p_i it
  is Pearson's statistic). Groups and the rank part are independent given the prefixes, and so
  are different positions, so their statistics and degrees of freedom add up (`combine`): the
  sum over all positions is a joint test of the whole sequence law, asymptotically equivalent
  to a Pearson test over full-sequence cells where those have enough mass.

Total-variation estimates (`total_variation`): lower bounds of the mean per-prefix TV, from the
token and the rank marginals, reported with their noise floor under the null (normal
approximation), so a reader can tell a deviation from sampling noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

MIN_EXPECTED = 5.0
"""Pearson's rule: pool cells until each expects at least this many counts."""
MIN_GROUP = 20
"""Samples sharing a prefix that get their own token-cell Pearson test."""


def chi_square_sf(statistic: float, df: int) -> float:
    """P(chi2_df >= statistic): the p-value of a chi-square statistic (1.0 when df = 0)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(statistic / 2.0)))


@dataclass(kw_only=True, slots=True)
class Fit:
    """A goodness-of-fit result."""

    statistic: float
    df: int
    p_value: float
    samples: int
    """Tokens tested."""
    impossible: int = 0
    """Tokens whose exact probability is 0 (outside top-k/top-p): each alone disproves the null."""
    tv: float = 0.0
    """Total-variation estimate (see the module docstring); 0 for combined fits."""
    tv_noise: float = 0.0
    """Its expected value under the null (normal approximation): TV below this is noise."""


def pearson_fit(
    counts: Tensor,  # (C,) observed counts per cell
    probs: Tensor,  # (C,) exact cell probabilities, summing to 1
    min_expected: float = MIN_EXPECTED,
) -> Fit:
    """Pearson chi-square of counts against one fixed distribution, cells expecting less than
    `min_expected` pooled into one. A count in a cell of probability 0 is impossible under the
    null: the p-value is 0."""
    counts, probs = counts.double(), probs.double()
    impossible = int(counts[probs <= 0].sum())
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    statistic, df = float((((obs - exp) ** 2) / exp)[keep].sum()), int(keep.sum()) - 1
    return Fit(
        statistic=statistic,
        df=df,
        p_value=0.0 if impossible else chi_square_sf(statistic, df),
        samples=int(counts.sum()),
        impossible=impossible,
    )


def pooled_chi_square_pvalue(counts: Tensor, probs: Tensor, min_expected: float = MIN_EXPECTED) -> float:
    """The p-value of `pearson_fit` (the engine tests' exact-joint harness)."""
    return pearson_fit(counts, probs, min_expected).p_value


def rank_fit(
    probs: Tensor,  # (n, V) the exact distribution each token was drawn from
    tokens: Tensor,  # (n,) int64 the drawn tokens
    min_expected: float = MIN_EXPECTED,
) -> Fit:
    """Rank-category chi-square of tokens against per-sample exact distributions (module docstring)."""
    n, vocab = probs.shape
    probs = probs.double()
    if n == 0:
        return Fit(statistic=0.0, df=0, p_value=1.0, samples=0)
    impossible = int((probs[torch.arange(n), tokens] <= 0).sum())
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
    rank = (order == tokens[:, None]).to(torch.int64).argmax(dim=-1)  # (n,)
    expected_by_rank = sorted_p.sum(dim=0)  # (V,) non-increasing
    head = int((expected_by_rank >= min_expected).sum())  # ranks 0..head-1 stand alone
    if head < vocab and float(expected_by_rank[head:].sum()) < min_expected and head > 0:
        head -= 1  # a tail expecting too little joins the last head category
    cats = head + (1 if head < vocab else 0)
    pi = torch.cat([sorted_p[:, :head], sorted_p[:, head:].sum(dim=-1, keepdim=True)], dim=1)[:, :cats]
    observed = torch.nn.functional.one_hot(rank.clamp(max=cats - 1), cats).double()
    s = (observed - pi).sum(dim=0)[:-1]  # the last category is implied by the others
    cov = (torch.diag(pi.sum(dim=0)) - pi.T @ pi)[:-1, :-1]
    statistic, df = 0.0, 0
    if cats > 1:
        evals, evecs = torch.linalg.eigh(cov)
        keep = evals > evals.max().clamp(min=0) * 1e-9
        df = int(keep.sum())
        if df:
            proj = evecs[:, keep].T @ s
            statistic = float((proj**2 / evals[keep]).sum())
    return Fit(
        statistic=statistic,
        df=df,
        p_value=0.0 if impossible else chi_square_sf(statistic, df),
        samples=n,
        impossible=impossible,
    )


def _tv_and_noise(observed: Tensor, probs: Tensor) -> tuple[float, float]:
    """TV between the empirical and the averaged exact distribution over the columns, and its
    expected value under the null (E|N(0, s^2)| = s sqrt(2/pi) per column)."""
    n = len(probs)
    diff = (observed - probs).sum(dim=0) / n
    noise = math.sqrt(2 / math.pi) * (probs * (1 - probs)).sum(dim=0).sqrt().sum() / n
    return 0.5 * float(diff.abs().sum()), 0.5 * float(noise)


def total_variation(
    probs: Tensor,  # (n, V) exact distributions
    tokens: Tensor,  # (n,) drawn tokens
) -> tuple[float, float]:
    """(TV estimate, its expected value under the null).

    The distance between the sampled and the exact distribution after each prefix cannot be
    measured from one sample per prefix; what can be measured is the TV of the token marginal
    (averaged over the observed prefixes) and of the rank marginal. Both are lower bounds of the
    mean per-prefix TV (a mixture and a relabelling never increase TV); the one further above
    its noise floor is returned, with that floor.
    """
    n, vocab = probs.shape
    if n == 0:
        return 0.0, 0.0
    probs = probs.double()
    one_hot = torch.zeros(n, vocab, dtype=torch.float64).scatter_(1, tokens[:, None], 1.0)
    by_token = _tv_and_noise(one_hot, probs)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    by_rank = _tv_and_noise(one_hot.gather(1, order), sorted_p)
    return max(by_token, by_rank, key=lambda tv_noise: tv_noise[0] - tv_noise[1])


def conditional_fit(
    probs: Tensor,  # (n, V) the exact distribution each token was drawn from
    tokens: Tensor,  # (n,) int64 the drawn tokens
    groups: Tensor | None = None,  # (n,) int64 samples with equal ids share their prefix
    *,
    min_group: int = MIN_GROUP,
    min_expected: float = MIN_EXPECTED,
) -> Fit:
    """Tokens against per-sample exact distributions: a Pearson test over token cells within each
    prefix group of at least `min_group` samples, the rank test over the other samples, combined
    (module docstring); with the TV estimate over all samples."""
    n, vocab = probs.shape
    parts = []
    rest = torch.ones(n, dtype=torch.bool)
    if groups is not None and n:
        _, inverse, sizes = torch.unique(groups, return_inverse=True, return_counts=True)
        for g in (sizes >= min_group).nonzero()[:, 0].tolist():
            member = inverse == g
            counts = torch.bincount(tokens[member], minlength=vocab)
            parts.append(pearson_fit(counts, probs[member].double().mean(dim=0), min_expected))
            rest &= ~member
    parts.append(rank_fit(probs[rest], tokens[rest], min_expected))
    joint = combine(parts)
    joint.tv, joint.tv_noise = total_variation(probs, tokens)
    return joint


def combine(fits: list[Fit]) -> Fit:
    """The joint test of asymptotically independent fits: statistics and df add up."""
    statistic = sum(f.statistic for f in fits)
    df = sum(f.df for f in fits)
    impossible = sum(f.impossible for f in fits)
    return Fit(
        statistic=statistic,
        df=df,
        p_value=0.0 if impossible else chi_square_sf(statistic, df),
        samples=sum(f.samples for f in fits),
        impossible=impossible,
    )
