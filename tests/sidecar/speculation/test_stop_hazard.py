"""Where rows emit their stop token (`StopHazard`): learnt by output position, shrunk towards the
overall rate where a position has little evidence, aged by the tokens that replace it."""

from __future__ import annotations

import random
import sys
from types import FrameType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.speculation.stop_hazard import EXACT_POSITIONS, StopHazard


def rows_ending_at(end: int, rows: int, step: int = 3) -> list[list[tuple[int, int, bool]]]:
    """Decode steps of `rows` rows that each emit `step` tokens a step and a stop token at output
    position `end` (the last step emits up to it)."""
    steps, start = [], 0
    while start <= end:
        n = min(step, end + 1 - start)
        steps.append([(start, n, start + n - 1 == end)] * rows)
        start += n
    return steps


def test_the_rate_is_learnt_where_rows_end() -> None:
    hazard = StopHazard(halflife=256.0, prior_tokens=8.0, rate_prior=2.0)
    for _ in range(20):
        for step in rows_ending_at(20, rows=8):
            hazard.observe_rows(step)
    assert hazard.at(20) > 0.9  # every row that got to position 20 stopped there
    assert hazard.at(5) < 0.01 and hazard.at(19) < 0.01  # none stopped before
    assert 1 / 21 < hazard.rate() < 1.25 / 21  # the memoryless rate spreads it out (the stop tokens,
    # emitted last in each generation, are the freshest evidence)
    assert hazard.at(30) == pytest.approx(hazard.rate())  # never seen: the overall rate
    mean, _ = hazard.remaining(10, 30)  # positions 10 .. 20, the stop token included
    assert 11 <= mean < 12  # (at(20) < 1: the prior's ~5% go on past 20, at the overall rate)
    assert hazard.remaining(22, 30)[0] > 10  # past the end nothing was seen: the overall rate
    assert hazard.remaining(7, 0) == (0.0, 0.0)


def test_a_position_seen_little_leans_on_the_overall_rate() -> None:
    hazard = StopHazard(halflife=1e12, prior_tokens=8.0, rate_prior=2.0)  # no ageing: exact counts
    hazard.observe_rows([(0, 40, False)] * 10 + [(0, 10, True)])
    rate = hazard.rate()
    assert rate == pytest.approx(1 / (410 + 2))
    # position 9: 11 tokens seen, one a stop token, against 8 tokens' worth of the overall rate
    assert hazard.at(9) == pytest.approx((1 + 8 * rate) / (11 + 8))
    assert hazard.observe_rows([]) is None and hazard.at(9) == pytest.approx((1 + 8 * hazard.rate()) / (11 + 8))


def test_positions_past_the_exact_bins_share_growing_bins() -> None:
    hazard = StopHazard(halflife=1e9, prior_tokens=1.0, rate_prior=1.0)
    far = 10 * EXACT_POSITIONS
    hazard.observe_rows([(far, 4, True)])  # positions far .. far + 3, a stop at the last
    assert hazard.at(far) == hazard.at(far + 3)  # one bin (~1/8 of the position wide)
    assert hazard.at(far) > hazard.at(EXACT_POSITIONS - 1)  # which holds the stop token
    assert hazard.remaining(far - 2, 6)[0] < 6  # some rows stop before the cap


def test_a_bin_ages_by_the_tokens_that_replace_it() -> None:
    """Evidence at one position is not aged by tokens emitted elsewhere: a length distribution
    seen once is kept until rows come back to those positions (a per-token global decay had left
    the positions where the RL workload's rows end ~1.5 generations of evidence)."""
    hazard = StopHazard(halflife=16.0, prior_tokens=1.0, rate_prior=1.0)
    hazard.observe_rows([(0, 6, True)] * 4)  # 4 rows stop at position 5
    before = hazard.at(5)
    hazard.observe_rows([(0, 5, False)] * 50)  # many tokens, none at position 5
    assert hazard.at(5) > 0.7 * before
    hazard.observe_rows([(5, 1, False)] * 64)  # rows now get past position 5
    assert hazard.at(5) < 0.2 * before


def test_bad_rows_are_refused() -> None:
    hazard = StopHazard(halflife=16.0, prior_tokens=1.0, rate_prior=1.0)
    for row in [(-1, 2, False), (0, -1, False), (3, 0, True)]:
        with pytest.raises(ValueError, match="bad row"):
            hazard.observe_rows([row])
    with pytest.raises(ValueError, match="must be > 0"):
        StopHazard(halflife=0.0, prior_tokens=1.0, rate_prior=1.0)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=3 * EXACT_POSITIONS), min_size=1, max_size=20),
    seed=st.integers(0, 2**16),
)
def test_remaining_tokens_follow_the_hazards(lengths: list[int], seed: int) -> None:
    """Oracle: the distribution of R = the tokens a row at `start` still emits, at most `left`,
    enumerated forwards from the per-position hazards (P(R = j) = P(no stop before the j-th
    token) x h at it, the cap taking what is left), against `remaining`. Several rows of one
    batch, each with its own cap, below and past the caps asked before (one table serves them)."""
    hazard = StopHazard(halflife=64.0, prior_tokens=4.0, rate_prior=2.0)
    rng = random.Random(seed)
    for end in lengths:
        for step in rows_ending_at(end - 1, rows=1, step=rng.randint(1, 4)):
            hazard.observe_rows(step)
    for _ in range(6):
        start, left = rng.randint(0, 2 * EXACT_POSITIONS), rng.randint(1, 40 + 4 * EXACT_POSITIONS)
        alive, mean, second = 1.0, 0.0, 0.0
        for j in range(1, left + 1):
            h = hazard.at(start + j - 1) if j < left else 1.0  # the cap ends the row at its last token
            mean += j * alive * h
            second += j * j * alive * h
            alive *= 1.0 - h
        got_mean, got_variance = hazard.remaining(start, left)
        assert got_mean == pytest.approx(mean, rel=1e-9)
        assert got_variance == pytest.approx(second - mean * mean, rel=1e-6, abs=1e-9)


def test_remaining_is_exact_where_no_row_has_ended() -> None:
    hazard = StopHazard(halflife=64.0, prior_tokens=4.0, rate_prior=2.0)  # no evidence: h = 0
    assert hazard.remaining(3, 4000) == (4000.0, 0.0)
    assert hazard.remaining(3990, 7) == (7.0, 0.0)


def test_the_work_per_step_does_not_grow_with_the_number_of_caps() -> None:
    """A batch whose rows each have their own length cap (a client that sets max_new_tokens per
    prompt) costs one table per refresh, not one per cap: counted in lines of stop_hazard.py run
    (deterministic, unlike a timing). A table per cap, rebuilt as 128 caps evicted each other,
    ran ~10^6 lines per decode step here (~0.2 s of CPU at batch 128 with caps of 2-4k tokens)."""
    hazard = StopHazard(halflife=256.0, prior_tokens=8.0, rate_prior=2.0)
    for step in rows_ending_at(30, rows=8):
        hazard.observe_rows(step)
    rng = random.Random(0)
    rows = [(rng.randint(0, 100), rng.randint(2000, 4000)) for _ in range(128)]
    budget = 16 * 128 * 10 + 2 * 4500 * 10  # per step a few lines per row; a table of ~4k positions twice
    lines = 0
    source = sys.modules[StopHazard.__module__].__file__

    def tracer(frame: FrameType, event: str, arg: object) -> object:
        nonlocal lines
        if frame.f_code.co_filename != source:
            return None
        if event == "line":
            lines += 1
            if lines > budget:
                raise AssertionError(f"over {budget} lines of stop_hazard.py for 16 steps of 128 rows")
        return tracer

    sys.settrace(tracer)
    try:
        for _ in range(16):  # decode steps: every row's remaining tokens, then one step's evidence
            for position, left in rows:
                hazard.remaining(position, left)
            hazard.observe(8, 0)
            rows = [(position + 1, left - 1) for position, left in rows]
    finally:
        sys.settrace(None)
    assert 0 < lines <= budget
