"""Per-version statistics stay bounded however many weight versions a sidecar serves.

An RL run pushes a version every step. The engine keeps the recent versions one by one and folds
older ones into one cumulative entry (`sidecar.engine.version_ledger`), so the scheduler's refresh
after every engine step reads a bounded number of entries, while the totals still count every
token since the start (oracle: the finished samples' own counters, summed independently).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.engine.torch_engine import TorchEngine
from sidecar.engine.version_ledger import RECENT_VERSIONS, VersionLedger
from sidecar.model.checkpoint import model_state_dict
from sidecar.model.model import ModelConfig, build_model
from sidecar.server.scheduler import Scheduler, SchedulerConfig
from sidecar.server.weight_receiver import StagedWeights
from sidecar.types import GenerationRequest, SamplingParams, SpeculationCounters, VersionStats, WeightSelector

PUSHES = 2 * RECENT_VERSIONS + 2


class CountingEngine(TorchEngine):
    """A TorchEngine that records how many version entries each `stats()` call hands out."""

    reads: list[int]

    def stats(self) -> list[VersionStats]:
        out = super().stats()
        self.reads.append(len(out))
        return out


def test_an_engine_step_reads_a_bounded_number_of_versions_and_totals_count_everything() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig.tiny(), seed=3)
    engine = CountingEngine(model, speculation_k=2)
    engine.reads = []
    draft = {n: t.clone() for n, t in model_state_dict(model).items() if n.startswith("mtp.")}
    scheduler = Scheduler(engine, SchedulerConfig())
    scheduler.start()
    samples = []
    try:
        for version in range(1, PUSHES + 1):
            staged = StagedWeights(
                version=version,
                selector=WeightSelector.DRAFT,
                tensors={n: t.clone() for n, t in draft.items()},
                bytes_received=0,
                receive_seconds=0.0,
            )
            scheduler.apply_weights(staged)
            request = GenerationRequest(prompts=[[1, 2, 3]], sampling=SamplingParams(max_new_tokens=4, seed=version))
            handle = scheduler.submit(request)
            samples.append(handle.get(timeout=30.0))
    finally:
        scheduler.stop()
    snap = scheduler.snapshot()
    assert [v.weight_version for v in snap.versions] == list(range(PUSHES - RECENT_VERSIONS + 1, PUSHES + 1))
    assert snap.earlier.weight_version == PUSHES - RECENT_VERSIONS
    assert max(engine.reads, default=0) <= RECENT_VERSIONS
    want = SpeculationCounters()
    for s in samples:
        want.add(s.counters)
    got = scheduler.total_counters()
    assert got.generated_tokens == sum(len(s.token_ids) for s in samples) == want.generated_tokens
    assert (got.verify_steps, got.drafted_tokens, got.accepted_tokens) == (
        want.verify_steps,
        want.drafted_tokens,
        want.accepted_tokens,
    )
    assert snap.earlier.samples_finished + sum(v.samples_finished for v in snap.versions) == len(samples)


@settings(max_examples=60, deadline=None)
@given(
    keep=st.integers(1, 5),
    events=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 9)), max_size=60),
)
def test_the_ledger_equals_an_unbounded_record(keep: int, events: list[tuple[int, int]]) -> None:
    """Oracle: a plain dict of every version's tokens. Each event serves `version` (if newer) and
    counts `tokens` against some version (the newest, or an older one a late sample started on)."""
    ledger, every, newest = VersionLedger(keep), {0: 0}, 0
    for version, tokens in events:
        if version > newest:
            ledger.serve(version)
            every.setdefault(version, 0)
            newest = version
        counted = version if version in every else newest
        ledger[counted].counters.generated_tokens += tokens
        every[counted] += tokens
    recent = ledger.recent()
    assert len(recent) <= keep
    assert [v.weight_version for v in recent] == sorted(every)[-keep:]
    for v in recent:
        assert v.counters.generated_tokens == every[v.weight_version]
    assert ledger.earlier.counters.generated_tokens + sum(v.counters.generated_tokens for v in recent) == sum(
        every.values()
    )


class ObservingScheduler(Scheduler):
    """Records, as each finished sample is handed to its caller, how many samples the published
    statistics (what GetStats and the metrics read) already count."""

    counted_at_delivery: list[int]

    def _deliver(self, sample):  # type: ignore[no-untyped-def]
        snap = self.snapshot()
        self.counted_at_delivery.append(snap.earlier.samples_finished + sum(v.samples_finished for v in snap.versions))
        super()._deliver(sample)


def test_a_sample_reaches_its_caller_only_after_the_statistics_count_it() -> None:
    """Read-your-writes: a client that holds every sample of its request and then calls GetStats
    sees them counted (the trainer and the non-finite alarm read stats right after a generate).
    The published snapshot must be refreshed before the step's samples are delivered."""
    engine = TorchEngine(build_model(ModelConfig.tiny(), seed=3), speculation_k=0)
    scheduler = ObservingScheduler(engine, SchedulerConfig())
    scheduler.counted_at_delivery = []
    scheduler.start()
    try:
        request = GenerationRequest(prompts=[[1, 2, 3], [4, 5], [6]], sampling=SamplingParams(max_new_tokens=3, seed=1))
        handle = scheduler.submit(request)
        for _ in range(3):
            handle.get(timeout=30.0)
    finally:
        scheduler.stop()
    assert len(scheduler.counted_at_delivery) == 3
    for delivered, counted in enumerate(scheduler.counted_at_delivery, start=1):
        assert counted >= delivered, scheduler.counted_at_delivery
