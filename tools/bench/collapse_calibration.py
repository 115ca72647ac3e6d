"""How often the draft-collapse alarm fires: false alarms on working drafts, power on dead ones.

The alarm (`sidecar.speculation.collapse.CollapseRule`) judges one weight version from its
counters: drafting verify steps n, draft tokens accepted A, samples finished s. It fires when
n >= min_rounds, s >= min_samples and 1 + A / n <= collapsed_tau, checked after every engine
step for as long as the version serves. This simulates that sequential check on a model of an
engine's rows, so the rule's error rates come from the rule itself:

- a batch of `batch` rows; each row has its own per-token acceptance alpha_r ~ Beta with mean
  `acceptance` and relative standard deviation `spread` (prompts differ: the controller measures
  a spread of ~0.3 between rows, `AcceptanceEstimate.spread`; 0.5 is used as a harder case);
- each step every row drafts k tokens and accepts the leading run of independent
  Bernoulli(alpha_r) successes (the textbook chain model: E[accepted] = sum_{i<=k} alpha^i);
- a row lives a geometric number of rounds with mean `row_rounds`, then finishes (one sample)
  and a fresh row takes its place;
- the version serves `max_rounds` drafting rounds in all (its life), checked after each step.

Rows, not rounds, are the unit that makes the evidence noisy: a row whose prompt the draft
cannot predict gives many low rounds in a row, so batch 1 with long rows is the hard case.

Usage: specrl bench collapse-calibration [--replicates 20000]   (prints the table of README,
"Drafts cannot silently go stale")
"""

from __future__ import annotations

import argparse
import math

import torch

from sidecar.speculation.collapse import CollapseRule


def simulate_alarms(
    rule: CollapseRule,
    *,
    acceptance: float,
    k: int = 1,
    batch: int = 8,
    row_rounds: float = 64.0,
    spread: float = 0.5,
    max_rounds: int = 4096,
    replicates: int = 4000,
    seed: int = 0,
) -> float:
    """Fraction of `replicates` versions on which `rule` fires at some step of their life."""
    gen = torch.Generator().manual_seed(seed)

    def draw_alpha(shape: tuple[int, ...]) -> torch.Tensor:
        if acceptance <= 0.0 or spread <= 0.0:
            return torch.full(shape, acceptance, dtype=torch.float64)
        # Beta(a, b) with mean m and sd spread * m: a + b = m (1 - m) / sd^2 - 1
        m = acceptance
        total = max(m * (1.0 - m) / (spread * m) ** 2 - 1.0, 1e-3)
        a = torch.full(shape, m * total, dtype=torch.float64)
        b = torch.full(shape, (1.0 - m) * total, dtype=torch.float64)
        ga = torch._standard_gamma(a, generator=gen)
        gb = torch._standard_gamma(b, generator=gen)
        return ga / (ga + gb)

    shape = (replicates, batch)
    alpha = draw_alpha(shape)
    end = 1.0 / row_rounds  # a row finishes after each round with this probability
    rounds = torch.zeros(replicates, dtype=torch.float64)
    accepted = torch.zeros(replicates, dtype=torch.float64)
    samples = torch.zeros(replicates, dtype=torch.float64)
    fired = torch.zeros(replicates, dtype=torch.bool)
    for _ in range(math.ceil(max_rounds / batch)):
        hits = torch.rand((*shape, k), generator=gen, dtype=torch.float64) < alpha.unsqueeze(-1)
        accepted += hits.cumprod(-1).sum((-1, -2))
        rounds += batch
        done = torch.rand(shape, generator=gen, dtype=torch.float64) < end
        samples += done.sum(-1)
        if done.any():
            alpha = torch.where(done, draw_alpha(shape), alpha)
        fired |= rule.fires(rounds, accepted, samples)
    return float(fired.double().mean())


def binomial_tail(n: int, p: float, at_most: int) -> float:
    """P(Binomial(n, p) <= at_most), exactly (independent rounds at k = 1: the floor of the
    false-alarm rate at the first check)."""
    return sum(math.comb(n, i) * p**i * (1.0 - p) ** (n - i) for i in range(at_most + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicates", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rule = CollapseRule()
    n = rule.min_rounds
    limit = math.floor((rule.collapsed_tau - 1.0) * n)
    print(f"rule: {rule}")
    print(f"independent rounds, k = 1, alpha = 0.3, first check: P = {binomial_tail(n, 0.3, limit):.2e}")
    print("| per-token acceptance | k | batch | rows (mean rounds) | spread | alarm rate per version |")
    print("|---|---|---|---|---|---|")
    cases = [
        (0.3, 1, 1, 256.0, 0.5),
        (0.3, 1, 8, 64.0, 0.5),
        (0.3, 3, 8, 64.0, 0.5),
        (0.2, 1, 1, 256.0, 0.5),
        (0.1, 1, 8, 64.0, 0.5),
        (0.1, 1, 1, 256.0, 0.5),
        (0.05, 1, 8, 64.0, 0.5),
        (0.03, 1, 8, 64.0, 0.5),
        (0.02, 1, 1, 256.0, 0.5),
        (0.02, 1, 8, 64.0, 0.5),
        (0.0, 1, 1, 256.0, 0.0),
    ]
    for acceptance, k, batch, row_rounds, spread in cases:
        rate = simulate_alarms(
            rule,
            acceptance=acceptance,
            k=k,
            batch=batch,
            row_rounds=row_rounds,
            spread=spread,
            replicates=args.replicates,
        )
        bound = f" (< {3.0 / args.replicates:.1e}, 95%)" if rate == 0 else ""
        print(f"| {acceptance} | {k} | {batch} | {row_rounds:.0f} | {spread} | {rate:.4f}{bound} |")


if __name__ == "__main__":
    main()
