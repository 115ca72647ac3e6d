"""Asynchronous RL's schedule: rollout batches generated ahead of training, at most
`max_policy_lag` weight versions ahead.

Step s trains on a batch generated from weights that at least s - L updates produced (L = the
lag bound). So the producer may start step s's batch as soon as s - L steps have trained and
pushed their weights: with L = 0 that is after step s - 1 (today's synchronous loop: generate,
train, push, generate...), with L = 1 while step s - 1 trains, so generation of the next batch
overlaps training. Since a push may land while a batch is generating, a sample's tokens can come
from several versions; the bound is checked on the oldest (`Sample.weight_version`, the version
of its first token) by the loop that takes the batch (`trainer.rl.rollouts.next_batch`), which regenerates a
group that is still too old rather than train on it.

`RolloutPipeline` is the schedule alone, over any `produce(step)`: the RL loop's rollouts in use,
fakes with random durations in the property test. At L = 0 there is no thread: `take(step)` calls
`produce(step)` itself, so the synchronous loop runs exactly as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

R = TypeVar("R")


@dataclass(kw_only=True, slots=True)
class Taken(Generic[R]):
    """A produced batch as the trainer takes it."""

    value: R
    waited_s: float
    """How long `take` blocked: the generation time the trainer saw (all of it at L = 0)."""
    gated_s: float
    """How long the producer waited for weights (the lag bound) before it started this batch."""


class RolloutPipeline(Generic[R]):
    """Produce steps first..last-1 in order, each at most `max_lag` trained steps ahead.

    The trainer calls `take(step)` for each step in order and `trained(step)` once that step's
    weights are pushed. A producer error is raised by the `take` that waits for its step; closing
    the pipeline (leaving the `with` block) stops production after the batch in progress and
    discards batches nobody took (a resumed run regenerates them: each step's prompts and seeds
    depend only on the run seed and the step).
    """

    def __init__(self, produce: Callable[[int], R], *, first: int, last: int, max_lag: int) -> None:
        if max_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0, got {max_lag}")
        if last < first:
            raise ValueError(f"steps run from {first} to {last}: the last must not come before the first")
        self._produce = produce
        self._first, self._last, self._lag = first, last, max_lag
        self._cond = threading.Condition()
        self._trained = first  # steps first..trained-1 have pushed their weights
        self._ready: dict[int, tuple[R, float]] = {}
        self._error: BaseException | None = None
        self._error_step = last
        self._closed = False
        self._next_take = first
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RolloutPipeline[R]:
        if self._lag > 0 and self._first < self._last:
            self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop producing; wait up to `timeout_s` for a batch in progress to end. A generation
        cannot be interrupted from here: after a normal end there is none (the last batch was
        taken); after an error the thread is left to end with the fleet (a daemon, its result
        discarded)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def take(self, step: int) -> Taken[R]:
        """Step `step`'s batch (steps are taken in order, each once)."""
        if step != self._next_take:
            raise ValueError(f"step {step} taken out of order: the pipeline expects step {self._next_take}")
        self._next_take += 1
        start = time.perf_counter()
        if self._thread is None:  # L = 0: the synchronous loop
            value = self._produce(step)
            return Taken(value=value, waited_s=time.perf_counter() - start, gated_s=0.0)
        with self._cond:
            while step not in self._ready and not (self._error is not None and self._error_step <= step):
                self._cond.wait()
            if step not in self._ready:
                assert self._error is not None
                raise self._error
            value, gated = self._ready.pop(step)
        return Taken(value=value, waited_s=time.perf_counter() - start, gated_s=gated)

    def trained(self, step: int) -> None:
        """Step `step`'s weights are pushed: the batch of step `step + 1 + max_lag` may start."""
        with self._cond:
            self._trained = max(self._trained, step + 1)
            self._cond.notify_all()

    def _run(self) -> None:
        for step in range(self._first, self._last):
            gate = time.perf_counter()
            with self._cond:
                while not self._closed and self._trained < step - self._lag:
                    self._cond.wait()
                if self._closed:
                    return
            gated = time.perf_counter() - gate
            try:
                value = self._produce(step)
            except BaseException as e:  # handed to the trainer's take
                with self._cond:
                    self._error, self._error_step = e, step
                    self._cond.notify_all()
                return
            with self._cond:
                if self._closed:
                    return
                self._ready[step] = (value, gated)
                self._cond.notify_all()
