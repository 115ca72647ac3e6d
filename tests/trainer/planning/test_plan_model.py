"""`trainer.planning.step_model` against closed forms: a batch of equal rows, k = 0 as plain
decoding, all-or-nothing acceptance, the renewal expectation of one row's rounds, the order
statistic of the fleet's slowest engine, the async pipeline's steady state; and monotonicity in
acceptance (coupled draws: a higher acceptance never costs time on the same seed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.planning.step_model import (
    Acceptance,
    EngineSplit,
    EngineWorkload,
    LengthDistribution,
    StepInputs,
    admission_rounds,
    expected_max,
    pipeline_step_seconds,
    plan_step,
    rounds_needed,
    simulate_engine,
)


class Affine:
    """A round costs c0 + c1 x rows x (k + 1) + cd x k seconds; a prefill p per row; a request r."""

    description = "affine test costs"

    def __init__(self, c0: float = 0.01, c1: float = 0.001, cd: float = 0.002, p: float = 0.0, r: float = 0.0):
        self.c0, self.c1, self.cd, self.p, self.r = c0, c1, cd, p, r

    def round_seconds(self, batch: np.ndarray, k: int, kv_tokens: np.ndarray) -> np.ndarray:
        return self.c0 + self.c1 * np.asarray(batch, dtype=float) * (k + 1) + self.cd * k

    def prefill_seconds(self, rows: int, prompt_tokens: int) -> float:
        return self.p * rows

    def request_seconds(self) -> float:
        return self.r

    def leaves_out(self) -> list[str]:
        return []


def work(rows: int, length: int, max_batch_size: int | None = None) -> EngineWorkload:
    return EngineWorkload(
        rows=rows, lengths=LengthDistribution.fixed(length), prompt_tokens=8, max_batch_size=max_batch_size or rows
    )


@pytest.mark.parametrize("rows,length", [(1, 2), (8, 21), (64, 40)])
def test_a_batch_of_equal_rows_decodes_in_length_minus_one_plain_steps(rows: int, length: int) -> None:
    costs = Affine(p=0.003)
    runs = simulate_engine(work(rows, length), None, 0, costs, replications=3)
    expected = (length - 1) * (costs.c0 + costs.c1 * rows) + costs.p * rows  # the prefill emits token 1
    assert runs.seconds == pytest.approx([expected] * 3, rel=1e-12)
    assert runs.rounds.tolist() == [length - 1] * 3


@pytest.mark.parametrize("k", [1, 3, 7])
def test_full_and_zero_acceptance_give_exact_round_counts(k: int) -> None:
    rows, length, costs = 8, 30, Affine()
    per_round = costs.c0 + costs.c1 * rows * (k + 1) + costs.cd * k
    full = simulate_engine(work(rows, length), Acceptance(alphas=(1.0,)), k, costs, replications=2)
    assert full.rounds.tolist() == [math.ceil((length - 1) / (k + 1))] * 2
    assert full.seconds == pytest.approx([math.ceil((length - 1) / (k + 1)) * per_round] * 2)
    none = simulate_engine(work(rows, length), Acceptance(alphas=(0.0,)), k, costs, replications=2)
    assert none.seconds == pytest.approx([(length - 1) * per_round] * 2)


def test_k_zero_equals_plain_whatever_the_acceptance() -> None:
    lengths = LengthDistribution(values=(3, 10, 40), weights=(0.5, 0.3, 0.2))
    w = EngineWorkload(rows=16, lengths=lengths, prompt_tokens=8, max_batch_size=6)  # a queue, too
    plain = simulate_engine(w, None, 0, Affine(), replications=20, seed=4)
    with_acc = simulate_engine(w, Acceptance(alphas=(0.9, 0.8)), 0, Affine(), replications=20, seed=4)
    assert np.array_equal(plain.seconds, with_acc.seconds)


def test_unequal_rows_at_k_zero_match_the_expected_drain() -> None:
    """E[plain time] = c0 E[max L - 1] + c1 E[sum (L - 1)] for iid lengths, all rows at once."""
    values, weights, rows, costs = (5, 20), (0.75, 0.25), 4, Affine()
    lengths = LengthDistribution(values=values, weights=weights)
    w = EngineWorkload(rows=rows, lengths=lengths, prompt_tokens=8, max_batch_size=rows)
    runs = simulate_engine(w, None, 0, costs, replications=4000, seed=1)
    p_all_short = weights[0] ** rows
    e_max = 4 * p_all_short + 19 * (1 - p_all_short)
    e_sum = rows * (4 * weights[0] + 19 * weights[1])
    expected = costs.c0 * e_max + costs.c1 * e_sum
    se = runs.seconds.std() / math.sqrt(runs.seconds.size)
    assert abs(runs.seconds.mean() - expected) < 4 * se


def expected_rounds(need: int, alphas: list[float], k: int) -> float:
    """Renewal recursion: E[R(n)] = 1 + sum_t P(T = t) E[R(n - t)], T = 1 + A."""
    surv = np.cumprod([alphas[min(j, len(alphas) - 1)] for j in range(k)])
    p_t = [1 - surv[0]] + [surv[j - 1] - surv[j] for j in range(1, k)] + [surv[k - 1]]  # T = 1..k+1
    e = [0.0] * (need + 1)
    for n in range(1, need + 1):
        e[n] = 1 + sum(p * e[max(n - (t + 1), 0)] for t, p in enumerate(p_t))
    return e[need]


@pytest.mark.parametrize("alphas,k", [([0.6], 3), ([0.9, 0.7, 0.4], 3), ([0.8, 0.5], 5)])
def test_one_rows_rounds_match_the_renewal_expectation(alphas: list[float], k: int) -> None:
    need, reps = 37, 4000
    acc = Acceptance(alphas=tuple(alphas))
    rng = np.random.default_rng(3)
    surv = np.tile(acc.survival(k), (reps, 1))
    r = rounds_needed(np.full(reps, need), surv, rng)
    exact = expected_rounds(need, alphas, k)
    assert abs(r.mean() - exact) < 4 * r.std() / math.sqrt(reps)


def test_tau_is_one_plus_the_survival_sum_and_for_tau_inverts_it() -> None:
    acc = Acceptance.from_cumulative([0.9, 0.72, 0.36])  # the counters' P(first j accepted)
    assert acc.alphas == pytest.approx((0.9, 0.8, 0.5))
    assert acc.tau(3) == pytest.approx(1 + 0.9 + 0.72 + 0.36)
    assert acc.tau(4) == pytest.approx(1 + 0.9 + 0.72 + 0.36 + 0.18)  # the last alpha carries on
    a = Acceptance.for_tau(2.47, 3)
    assert a.tau(3) == pytest.approx(2.47, abs=1e-6)
    with pytest.raises(ValueError, match=r"lies in \[1, 4\]"):
        Acceptance.for_tau(4.5, 3)
    with pytest.raises(ValueError, match="must lie in"):
        Acceptance(alphas=(1.2,))


@pytest.mark.parametrize("spread,max_batch_size", [(0.0, 16), (0.3, 16), (0.2, 5)])
def test_higher_acceptance_never_costs_time_on_the_same_seed(spread: float, max_batch_size: int) -> None:
    lengths = LengthDistribution(values=(5, 17, 60), weights=(0.3, 0.5, 0.2))
    w = EngineWorkload(rows=16, lengths=lengths, prompt_tokens=8, max_batch_size=max_batch_size)
    low = Acceptance(alphas=(0.5, 0.4, 0.3), spread=spread)
    high = Acceptance(alphas=(0.7, 0.6, 0.3), spread=spread)
    for k in (1, 3, 5):
        a = simulate_engine(w, low, k, Affine(), replications=30, seed=9)
        b = simulate_engine(w, high, k, Affine(), replications=30, seed=9)
        assert np.all(b.rounds <= a.rounds) and np.all(b.seconds <= a.seconds + 1e-12)
        assert b.seconds.mean() < a.seconds.mean()  # and strictly faster on average


def test_admission_is_first_come_first_served_into_free_slots() -> None:
    assert admission_rounds(np.array([3, 5, 2, 4, 1]), 2).tolist() == [0, 0, 3, 5, 5]
    assert admission_rounds(np.array([3, 5]), 4).tolist() == [0, 0]


def test_a_queue_runs_rows_back_to_back() -> None:
    costs = Affine(c1=0.0, cd=0.0)  # a round costs c0 whatever the batch: the time is the rounds
    runs = simulate_engine(work(rows=6, length=11, max_batch_size=2), None, 0, costs, replications=1)
    assert runs.rounds[0] == 3 * 10
    assert runs.seconds[0] == pytest.approx(30 * costs.c0)


def test_expected_max_is_the_order_statistic() -> None:
    assert expected_max(np.array([2.0, 2.0, 2.0]), 7) == pytest.approx(2.0)
    assert expected_max(np.array([0.0, 1.0]), 2) == pytest.approx(0.75)
    assert expected_max(np.array([0.0, 1.0]), 1) == pytest.approx(0.5)


def test_the_async_pipeline_hides_the_shorter_phase() -> None:
    gens = np.array([5.0])
    assert pipeline_step_seconds(gens, 3.0, 1.0, lag=0) == pytest.approx((9.0, 5.0))
    assert pipeline_step_seconds(gens, 3.0, 1.0, lag=1) == pytest.approx((5.0, 1.0))
    assert pipeline_step_seconds(gens, 6.0, 1.0, lag=2) == pytest.approx((7.0, 0.0))


def test_plan_derives_the_rest_of_the_step_from_the_generation_share() -> None:
    fleet = EngineSplit(prompts=4, samples_per_prompt=4, engines=2, max_batch_size=8, prompt_tokens=8)
    plan = plan_step(
        fleet, LengthDistribution.fixed(21), Acceptance(alphas=(1.0,)), [3], Affine(r=0.05), 0.25, replications=2
    )
    plain = plan.plain
    assert plain.generation == pytest.approx(20 * (0.01 + 0.008) + 0.05)
    assert plain.step == pytest.approx(plain.generation / 0.25)
    spec = plan.ks[1]
    assert spec.generation == pytest.approx(5 * (0.01 + 0.032 + 0.006) + 0.05)
    assert spec.step == pytest.approx(spec.generation + plain.step - plain.generation)
    assert plan.best.k == 3
    with pytest.raises(ValueError, match="share"):
        StepInputs.from_share(1.0, 0.0)


def test_the_trainer_logs_length_percentiles_that_the_plan_reads_back() -> None:
    from trainer.planning.inputs import step_lengths
    from trainer.rl.step_metrics import length_quantiles

    logged = length_quantiles([1, 2, 3, 4, 5])
    assert logged == {
        "rollout/response_len_q00": 1.0,
        "rollout/response_len_q10": 1.4,
        "rollout/response_len_q25": 2.0,
        "rollout/response_len_q50": 3.0,
        "rollout/response_len_q75": 4.0,
        "rollout/response_len_q90": 4.6,
        "rollout/response_len_q100": 5.0,
    }
    dist = step_lengths({"step": 1, **logged})
    assert dist is not None and dist.mean == pytest.approx(3.0, abs=0.05) and dist.max == 5


def test_given_row_lengths_at_k_zero_drain_exactly() -> None:
    """Rows of 3, 6 and 11 tokens: 2 rounds at 3 rows, 3 at 2, 5 at 1 (the prefill emits token 1)."""
    costs = Affine()
    w = EngineWorkload(
        rows=3, lengths=LengthDistribution.fixed(1), prompt_tokens=8, max_batch_size=3, row_lengths=(3, 6, 11)
    )
    runs = simulate_engine(w, None, 0, costs, replications=2)
    expected = sum(n * (costs.c0 + costs.c1 * b) for n, b in ((2, 3), (3, 2), (5, 1)))
    assert runs.seconds == pytest.approx([expected] * 2)
    with pytest.raises(ValueError, match="row_lengths must give 3 lengths"):
        EngineWorkload(
            rows=3, lengths=LengthDistribution.fixed(1), prompt_tokens=8, max_batch_size=3, row_lengths=(3, 6)
        )
