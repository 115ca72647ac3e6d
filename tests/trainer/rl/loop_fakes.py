"""In-memory stand-ins for the RL loop's fleet, policy and task, whose behaviour follows a rule
the tests can apply as an oracle: problem n is informative iff n % 3 == 0."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.client.draft_alarm import DraftAlarms
from sidecar.client.fleet import FleetResult, PushReport
from sidecar.types import DraftCollapse, FinishReason, GenerationRequest, Sample, SidecarStats, SpeculationCounters
from trainer.policy.policy import TrainBatch
from trainer.rl.tasks import Problem
from trainer.tokenizer import CharTokenizer

TOK = CharTokenizer()


class RuleTask:
    """Problem n is informative iff n % 3 == 0: its samples 1.. answer "b" (reward 1), sample 0 "a"."""

    name = "rule"

    def sample(self, rng: random.Random, split: str = "train") -> Problem:
        return Problem(prompt=f"q{rng.randrange(1000)}", answer="b")

    def reward(self, problem: Problem, completion: str) -> float:
        return float(int(problem.prompt[1:]) % 3 == 0 and completion == "b")


@dataclass
class FakeFleet:
    asked: list[str] = field(default_factory=list)
    calls: int = 0
    version: int = 1
    clients: list[str] = field(default_factory=lambda: ["fake:1"])
    fail_on_call: int = 0
    """Raise `failure` on this generate call (1-based; 0: never)."""
    failure: Callable[[], BaseException] = KeyboardInterrupt
    rejoins: int = 0
    stale_calls: set[int] = field(default_factory=set)
    """Generate calls (1-based) whose samples report weights `stale_by` versions older than served."""
    stale_by: int = 5
    delay_s: float = 0.0
    pushes: int = 0
    refuse_push: int = 0
    """Raise `push_failure` on this push (1-based; 0: never); the served version stays."""
    push_failure: Callable[[], BaseException] = KeyboardInterrupt
    """Each generate call takes this long after noting the version its samples start from."""
    collapse: DraftCollapse | None = None
    """What the (one) sidecar's GetStats reports as `draft_collapsed` (a test raises and clears it)."""
    collapses: int = 0
    """... and as `draft_collapses`."""
    alarms: DraftAlarms = field(default_factory=DraftAlarms)
    new_alarms: list[str] = field(default_factory=list)
    latest_stats: dict[str, SidecarStats] = field(default_factory=dict)
    """Each sidecar's GetStats at the latest `speculation_delta` (the trainer's prefix_cache/* read it)."""

    def start_version(self) -> int:
        return self.version + 1

    def generate(self, request: GenerationRequest, *, rejoin: bool = True) -> FleetResult:
        prompts, samples_per_prompt = request.prompts, request.samples_per_prompt
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise self.failure()
        self.asked += [TOK.decode(p) for p in prompts]
        version = self.version - (self.stale_by if self.calls in self.stale_calls else 0)
        if self.delay_s:
            time.sleep(self.delay_s)
        samples = [
            Sample(
                request_id="r",
                prompt_index=i,
                sample_index=j,
                token_ids=TOK.encode("a" if j == 0 else "b"),
                logprobs=[-0.5],
                finish_reason=FinishReason.STOP,
                weight_version=version,
                last_weight_version=self.version,
            )
            for i in range(len(prompts))
            for j in range(samples_per_prompt)
        ]
        return FleetResult(samples=samples, seconds=0.01)

    def speculation_delta(self) -> SpeculationCounters:
        stats = SidecarStats(
            versions=[],
            total=SpeculationCounters(),
            weight_version=self.version,
            draft_collapsed=self.collapse,
            draft_collapses=self.collapses,
        )
        self.latest_stats = {self.clients[0]: stats}
        alarm = self.alarms.observe(self.clients[0], stats)  # the fleet's own rule: Fleet.speculation_delta
        if alarm is not None:
            self.new_alarms.append(alarm)
        return SpeculationCounters()

    def draft_collapses(self) -> dict[str, DraftCollapse]:
        return self.alarms.raised()

    def take_draft_alarms(self) -> list[str]:
        out, self.new_alarms = self.new_alarms, []
        return out

    def rejoin(self, events: list[str], *, force: bool = True) -> None:
        self.rejoins += 1

    def push_weights(self, *args: Any, **kw: Any) -> PushReport:
        self.pushes += 1
        if self.pushes == self.refuse_push:
            raise self.push_failure()
        self.version += 1
        return PushReport(version=self.version, results={}, seconds=0.0)


@dataclass
class RecordingPolicy:
    batches: list[TrainBatch] = field(default_factory=list)
    draft: None = None

    def train_updates(self, batch: TrainBatch, **kw: Any) -> dict[str, float]:
        self.batches.append(batch)
        return {f"mismatch_logprob_abs_{stat}": 0.0 for stat in ("mean", "p99", "max")}

    def export_named_tensors(self) -> list[Any]:
        return []

    def export_names(self) -> list[str]:
        return []

    def save(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def save_hf(self, path: Path) -> None:  # the run's export at its end
        Path(path).mkdir(parents=True, exist_ok=True)


def lag_zero(run: Any, last: int) -> Any:
    """A lag-0 rollout pipeline over `run` whatever its config's lag: each step's batch is
    generated when the step takes it, so a fake fleet's calls come in step order."""
    from trainer.rl.rollout_pipeline import RolloutPipeline
    from trainer.rl.rollouts import Rollout, gather_rollout

    return RolloutPipeline[Rollout](lambda s: gather_rollout(run, s), first=0, last=last, max_lag=0)
