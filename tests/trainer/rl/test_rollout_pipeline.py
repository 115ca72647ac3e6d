"""The asynchronous RL schedule (`trainer.rl.rollout_pipeline`) against its contract, over random
generation and training durations: every batch is trained on at most `max_lag` versions after
the weights that started it, each step is produced once and taken once, in order, and at lag 0
generation and training strictly alternate (the synchronous loop)."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.rl.rollout_pipeline import RolloutPipeline

durations = st.lists(st.floats(min_value=0.0, max_value=0.003), min_size=1, max_size=6)


class World:
    """A fleet version bumped by each push, and a log of what happened in which order."""

    def __init__(self) -> None:
        self.version = 0
        self.lock = threading.Lock()
        self.log: list[tuple[str, int]] = []
        self.produced: list[int] = []

    def note(self, what: str, step: int) -> None:
        with self.lock:
            self.log.append((what, step))


@settings(max_examples=40, deadline=None)
@given(lag=st.integers(0, 3), steps=st.integers(0, 7), gen=durations, train=durations, first=st.integers(0, 2))
def test_the_lag_bound_holds_and_no_batch_is_lost_or_used_twice(
    lag: int, steps: int, gen: list[float], train: list[float], first: int
) -> None:
    w = World()

    def produce(step: int) -> tuple[int, int]:
        w.note("start", step)
        started_at = w.version  # the oldest version any of its tokens can come from
        time.sleep(gen[step % len(gen)])
        w.produced.append(step)
        w.note("end", step)
        return step, started_at

    trained_on: list[int] = []
    with RolloutPipeline(produce, first=first, last=first + steps, max_lag=lag) as pipe:
        for step in range(first, first + steps):
            got_step, version = pipe.take(step).value
            assert got_step == step
            assert w.version - version <= lag, f"step {step} trained {w.version - version} versions behind"
            trained_on.append(got_step)
            time.sleep(train[step % len(train)])
            w.version += 1  # the push
            w.note("pushed", step)
            pipe.trained(step)
    assert trained_on == list(range(first, first + steps))
    assert sorted(w.produced) == trained_on  # each produced exactly once
    if lag == 0:  # strictly alternating: start s, end s, pushed s, start s+1, ...
        expected = [(what, s) for s in range(first, first + steps) for what in ("start", "end", "pushed")]
        assert w.log == expected


def test_lag_one_overlaps_generation_with_training() -> None:
    """With L = 1 step s + 1's batch starts before step s's push (the point of the schedule)."""
    w = World()
    started = threading.Event()

    def produce(step: int) -> int:
        w.note("start", step)
        if step == 1:
            started.set()
        return step

    with RolloutPipeline(produce, first=0, last=3, max_lag=1) as pipe:
        for step in range(3):
            pipe.take(step)
            if step == 0:
                assert started.wait(5.0), "step 1's batch did not start while step 0 trained"
            w.note("pushed", step)
            pipe.trained(step)
    assert w.log.index(("start", 1)) < w.log.index(("pushed", 0))
    assert w.log.index(("start", 2)) > w.log.index(("pushed", 0))  # ... but never two ahead


def test_a_producer_error_reaches_the_trainer_at_its_step() -> None:
    def produce(step: int) -> int:
        if step == 2:
            raise RuntimeError("sidecars gone")
        return step

    with RolloutPipeline(produce, first=0, last=4, max_lag=2) as pipe:
        for step in range(2):
            assert pipe.take(step).value == step
            pipe.trained(step)
        with pytest.raises(RuntimeError, match="sidecars gone"):
            pipe.take(2)


def test_closing_discards_untaken_batches_and_stops_production() -> None:
    """An interrupted run leaves batches nobody trained on; a resume regenerates them from its
    first untrained step (the pipeline starts at `first`)."""
    produced: list[int] = []

    def produce(step: int) -> int:
        produced.append(step)
        return step

    pipe = RolloutPipeline(produce, first=5, last=100, max_lag=2)
    with pipe:
        assert pipe.take(5).value == 5
    time.sleep(0.05)
    assert max(produced) <= 5 + 2  # never more than the lag ahead of the trained steps (none)
    with RolloutPipeline(produce, first=6, last=7, max_lag=2) as resumed:
        assert resumed.take(6).value == 6


def test_steps_are_taken_in_order() -> None:
    with RolloutPipeline(lambda s: s, first=0, last=3, max_lag=0) as pipe, pytest.raises(ValueError, match="order"):
        pipe.take(1)


def test_a_negative_lag_is_refused() -> None:
    with pytest.raises(ValueError, match="max_policy_lag must be >= 0"):
        RolloutPipeline(lambda s: s, first=0, last=1, max_lag=-1)
