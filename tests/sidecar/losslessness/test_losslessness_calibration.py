"""Null calibration: a correct sampler fails the losslessness tests at rate alpha and no more.

Oracle: the null itself. Tokens are drawn exactly from known per-sample distributions shaped
like a trained policy's — near-deterministic positions whose tails carry 1e-6..3e-2 of the mass,
a few plausible tokens over a thin tail, Zipf long tails, peaked softmaxes, top-p style zeros —
with each sample's distribution chosen by its own prefix (so prompts and prefixes are
heterogeneous, as in `specrl verify`). Each statistic is run many times with deterministic
seeds, and its rejection count at each alpha must stay below a one-sided binomial bound: the
count a calibrated test exceeds with probability < 1e-4. The seeds are fixed, so nothing here
can flake; the bound says how far from alpha a count may be before it is a defect. The
statistics before issue 39 (chi-square p-values over cells expecting ~0.01 counts; a quadratic
form in a near-singular covariance) exceed these bounds many times over.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from sidecar.losslessness.certificate import distribution_fits
from sidecar.losslessness.exact_target import ExactTokens
from sidecar.losslessness.statistics import Fit, conditional_fit, pooled_chi_square_pvalue

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ALPHAS = (0.05, 0.01, 1e-3)


def binomial_bound(runs: int, alpha: float, level: float = 1e-4) -> int:
    """The smallest count k with P(Binomial(runs, alpha) >= k) < level."""
    tail, k = 1.0, 0
    while tail >= level:
        tail -= math.comb(runs, k) * alpha**k * (1 - alpha) ** (runs - k)
        k += 1
    return k


def policy_like_bank(vocab: int, count: int, seed: int) -> torch.Tensor:  # (count, vocab)
    """Distributions a trained policy emits (module docstring), token ids shuffled."""
    gen = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    out = []
    for j in range(count):
        kind = j % 5
        if kind == 0:  # near-deterministic: top 1 - eps, a Zipf tail of eps
            eps = 10.0 ** float(torch.empty(1).uniform_(-6, -1.5, generator=gen))
            tail = zipf[: vocab - 1] ** 1.5
            p = torch.cat([torch.tensor([1 - eps], dtype=torch.float64), eps * tail / tail.sum()])
        elif kind == 1:  # two or three plausible tokens over a thin tail
            eps = 10.0 ** float(torch.empty(1).uniform_(-6, -2, generator=gen))
            head = -torch.rand(2 + j % 2, generator=gen, dtype=torch.float64).log()  # Dirichlet(1, ..., 1)
            tail = zipf[: vocab - len(head)] ** 2
            p = torch.cat([head / head.sum() * (1 - eps), eps * tail / tail.sum()])
        elif kind == 2:  # long tail
            p = zipf ** float(torch.empty(1).uniform_(0.8, 1.6, generator=gen))
        elif kind == 3:  # a peaked softmax
            p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 4, dim=0)
        else:  # top-p style: the tail cut to exactly zero
            p = zipf**1.2
            p[vocab // 4 :] = 0.0
        out.append((p / p.sum())[torch.randperm(vocab, generator=gen)])
    return torch.stack(out)


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:  # (n,) one token per row
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


def test_the_binomial_bound_is_what_it_says() -> None:
    def tail(runs: int, alpha: float, k: int) -> float:  # P(Binomial(runs, alpha) >= k), summed upwards
        log_pmf = [
            math.lgamma(runs + 1)
            - math.lgamma(i + 1)
            - math.lgamma(runs - i + 1)
            + i * math.log(alpha)
            + (runs - i) * math.log1p(-alpha)
            for i in range(k, runs + 1)
        ]
        return sum(math.exp(v) for v in log_pmf)

    for runs, alpha in ((1000, 1e-3), (1000, 0.05), (2000, 0.01)):
        k = binomial_bound(runs, alpha)
        assert tail(runs, alpha, k) < 1e-4 <= tail(runs, alpha, k - 1)
    assert binomial_bound(1000, 1e-3) == 7  # a calibrated test rejects 7+ of 1000 at 1e-3 w.p. 8e-5


def one_position_p_values(fit: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], Fit]) -> list[Fit]:
    """`fit(probs, tokens, prefix groups, seed)` over 1200 runs of one position: 400 samples
    whose prefixes follow a Zipf law over 100 prefixes (a few shared by 20-100 samples: prefix
    groups; most by a handful), each prefix with its own bank distribution; in a quarter of the
    runs every prefix is near-deterministic, in another quarter 90% of them, as after a trained
    policy's confident prefixes."""
    bank = policy_like_bank(vocab=64, count=100, seed=1)
    confident = torch.arange(0, len(bank), 5)  # the near-deterministic entries
    zipf = 1.0 / torch.arange(1, len(bank) + 1, dtype=torch.float64) ** 1.1
    gen = torch.Generator().manual_seed(2)
    fits = []
    for run in range(1200):
        prefix = torch.randperm(len(bank), generator=gen)[torch.multinomial(zipf, 400, True, generator=gen)]
        share = (0.0, 0.5, 0.9, 1.0)[run % 4]
        ids = torch.arange(len(bank))
        which = torch.where(torch.rand(len(bank), generator=gen) < share, confident[ids % len(confident)], ids)
        probs = bank[which[prefix]]
        fits.append(fit(probs, draw(probs, gen), prefix, run))
    return fits


@pytest.mark.slow
def test_conditional_fit_is_calibrated_on_policy_like_distributions() -> None:
    fits = one_position_p_values(lambda probs, tokens, groups, seed: conditional_fit(probs, tokens, groups, seed=seed))
    p = torch.tensor([f.p_value for f in fits])
    for alpha in ALPHAS:
        rejected = int((p < alpha).sum())
        assert rejected < binomial_bound(len(p), alpha), (alpha, rejected, p.sort().values[:8])
    testable = sum(f.df > 0 for f in fits)  # not every sample near-deterministic, its tail expecting < 1
    assert testable > len(p) / 2 and int((p < 0.05).sum()) > 0.02 * testable  # not calibrated by never rejecting


def sequences(
    bank: torch.Tensor, prompts: int, samples: int, positions: int, gen: torch.Generator
) -> list[ExactTokens]:
    """Samples of `positions` tokens after each prompt, every token drawn from the bank entry its
    own prefix hashes to: as `exact_tokens` would report them for a correct sampler."""
    out = []
    for prompt in range(prompts):
        key = torch.full((samples,), 1_000_003 * (prompt + 1), dtype=torch.int64)
        tokens = torch.zeros(samples, positions, dtype=torch.int64)
        probs = torch.zeros(samples, positions, bank.shape[1], dtype=torch.float64)
        for t in range(positions):
            probs[:, t] = bank[key % len(bank)]
            tokens[:, t] = draw(probs[:, t], gen)
            key = (key * 31 + tokens[:, t] + 7) % (1 << 40)
        mask = torch.ones(samples, positions, dtype=torch.bool)
        zeros = torch.zeros(samples, positions)
        out.append(ExactTokens(probs=probs, logprobs=zeros, argmax_margin=zeros, mask=mask, tokens=tokens))
    return out


def certificate_rejections(
    rejects: Callable[[list[ExactTokens], int], Callable[[float], bool]],
) -> tuple[dict[float, int], int]:
    """({alpha: rejections}, runs): `rejects(samples, seed)(alpha)` over 1000 runs of 2 prompts
    x 120 samples x 4 tokens, every token from the bank entry its own prefix hashes to."""
    bank = policy_like_bank(vocab=48, count=64, seed=3)
    gen = torch.Generator().manual_seed(4)
    runs = 1000
    rejected = dict.fromkeys(ALPHAS, 0)
    for run in range(runs):
        decide = rejects(sequences(bank, prompts=2, samples=120, positions=4, gen=gen), run)
        for alpha in ALPHAS:
            rejected[alpha] += decide(alpha)
    return rejected, runs


@pytest.mark.slow
def test_the_certificates_distribution_verdict_is_calibrated() -> None:
    """The certificate's own rule (`DistributionFits.rejects`: every position and the joint)."""
    joint = []

    def rejects(exact: list[ExactTokens], seed: int) -> Callable[[float], bool]:
        fits = distribution_fits(exact, seed=seed, alpha=1e-3)
        joint.append(fits.joint.p_value)
        return fits.rejects

    rejected, runs = certificate_rejections(rejects)
    for alpha in ALPHAS:
        assert rejected[alpha] < binomial_bound(runs, alpha), (alpha, rejected)
    assert rejected[0.05] > 0  # not calibrated by never rejecting
    j = torch.tensor(joint)
    assert abs(float((j < 0.5).double().mean()) - 0.5) < 0.08  # Fisher's joint p is near uniform


def harness_p_values(p_value: Callable[[torch.Tensor, torch.Tensor, int], float]) -> list[float]:
    """`p_value(counts, probs, seed)` over 1000 runs: counts of 4000 samples over the V^3 token
    triples of three confident positions (one or two plausible tokens over a tail of
    1e-8..1e-5): the few cells of plausible triples expect >= 30 counts, the other ~500 together
    1e-4..0.1 — where one token in the old pooled cell made p ~ 1e-6."""
    gen = torch.Generator().manual_seed(6)
    rng = np.random.default_rng(6)
    n, vocab = 4000, 8
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 2
    out = []
    for run in range(1000):
        positions = []
        for _ in range(3):
            share = float(torch.empty(1).uniform_(0.2, 0.8, generator=gen))
            head = torch.tensor([1.0] if run % 2 else [share, 1 - share], dtype=torch.float64)
            eps = 10.0 ** float(torch.empty(1).uniform_(-8, -5, generator=gen))
            tail = zipf[: vocab - len(head)]
            p = torch.cat([head * (1 - eps), eps * tail / tail.sum()])
            positions.append(p[torch.randperm(vocab, generator=gen)])
        a, b, c = positions
        joint = (a[:, None, None] * b[None, :, None] * c[None, None, :]).flatten()
        counts = torch.from_numpy(rng.multinomial(n, (joint / joint.sum()).numpy()))
        out.append(p_value(counts, joint, run))
    return out


def test_the_engine_harness_is_calibrated() -> None:
    p = torch.tensor(harness_p_values(lambda counts, probs, seed: pooled_chi_square_pvalue(counts, probs, seed=seed)))
    for alpha in ALPHAS:
        assert int((p < alpha).sum()) < binomial_bound(len(p), alpha), (alpha, p.sort().values[:8])
    assert int((p < 0.05).sum()) > 0.02 * len(p)  # not calibrated by never rejecting
