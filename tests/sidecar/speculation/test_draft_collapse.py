"""Drafts cannot silently go stale: the collapse alarm fires on a stale, zeroed or wrong draft
and stays quiet through ordinary pushes.

The engine tests run a real TorchEngine under the real scheduler on a model whose MTP draft
predicts its target well by construction (`aligned_draft_model`, its output head sharpened so
that distributions are peaked as a trained LM's are: on the tiny random model at temperature 1
any two drafts agree half the time, since both distributions are nearly flat). The oracle of
"stale" is the construction itself: a draft that matched its target, then a target it was not
trained for. The rule's error rates are calibrated by simulating the rule itself
(tools/bench/collapse_calibration.py), its simulator checked against the exact binomial tail.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from sidecar.client.fleet import Fleet
from sidecar.engine.torch_engine import TorchEngine
from sidecar.integrations.draft_alignment import DraftAlignConfig, DraftAligner
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.server.scheduler import Scheduler, SchedulerConfig
from sidecar.server.weight_receiver import StagedWeights
from sidecar.speculation.collapse import CollapseRule, CollapseWatch, Verdict, drafting_tau
from sidecar.speculation.config import SpeculationControllerConfig
from sidecar.speculation.controller import SpeculationController
from sidecar.types import (
    DraftCollapse,
    GenerationRequest,
    SamplingParams,
    SpeculationCounters,
    VersionStats,
    WeightSelector,
)
from tests.sidecar.engine_fixtures import aligned_draft_model
from tests.sidecar_fixtures import start_sidecar, wait_until
from tests.trainer.rl.loop_fakes import TOK, FakeFleet, RecordingPolicy, RuleTask
from tools.bench.collapse_calibration import binomial_tail, simulate_alarms
from trainer.rl.config import RLConfig, RolloutConfig, SidecarsConfig
from trainer.rl.loop import rl_step
from trainer.rl.rollouts import rollout_pipeline
from trainer.rl.run import Run

RULE = CollapseRule()
CONFIG = ModelConfig.tiny(vocab_size=256)
PROMPTS = 48
NEW_TOKENS = 32  # 48 x 32 tokens: > 256 drafting rounds per version even at ~4 tokens a round


# ---- the rule and its calibration --------------------------------------------------------------
def test_a_rule_without_a_gap_or_evidence_is_refused() -> None:
    with pytest.raises(ValueError, match="collapsed_tau < healthy_tau"):
        CollapseRule(collapsed_tau=1.2, healthy_tau=1.2)
    with pytest.raises(ValueError, match="collapsed_tau"):
        CollapseRule(collapsed_tau=0.9)
    with pytest.raises(ValueError, match="min_rounds"):
        CollapseRule(min_rounds=0)


def test_the_simulator_matches_the_exact_binomial_tail() -> None:
    """One check of 256 independent rounds at k = 1 (every row finishes each round: enough
    samples): the alarm rate is P(Binomial(256, a) <= 12) (oracle: the closed form)."""
    rate = simulate_alarms(
        RULE, acceptance=0.05, k=1, batch=256, row_rounds=1.0, spread=0.0, max_rounds=256, replicates=4000
    )
    exact = binomial_tail(256, 0.05, 12)
    assert 0.3 < exact < 0.7
    assert abs(rate - exact) < 4 * (exact * (1 - exact) / 4000) ** 0.5


@pytest.mark.parametrize(("batch", "row_rounds"), [(1, 256.0), (8, 64.0)])
def test_working_drafts_do_not_alarm_and_dead_ones_do(batch: int, row_rounds: float) -> None:
    """Calibration of the shipped rule, checked after every engine step over a version's life of
    4,096 drafting rounds, rows ~ Beta(mean, relative sd 0.5) (tools/bench/collapse_calibration.py):
    a working draft (acceptance 0.3 per token, k = 1: its lowest tau) alarms on at most 1 in
    1,000 versions (0 observed here; the module docstring's 20,000-version run bounds it below
    1.5e-4); a dead draft (acceptance 0) and a near-dead one (0.02) alarm on >= 98% of versions
    (a miss: fewer than `min_samples` rows finished within the life at batch 1)."""
    working = simulate_alarms(RULE, acceptance=0.3, batch=batch, row_rounds=row_rounds, replicates=3000, seed=1)
    assert working <= 1e-3
    for dead in (0.0, 0.02):
        assert simulate_alarms(RULE, acceptance=dead, batch=batch, row_rounds=row_rounds, replicates=500) >= 0.98
    # not calibrated by never firing: at the threshold itself the alarm is a coin flip
    assert 0.2 < simulate_alarms(RULE, acceptance=0.05, batch=8, replicates=500) < 0.98


# ---- the watch -----------------------------------------------------------------------------------
def _stats(version: int, rounds: int, accepted: int, samples: int = 16) -> VersionStats:
    counters = SpeculationCounters(
        verify_steps=rounds,
        drafted_tokens=3 * rounds,
        accepted_tokens=accepted,
        generated_tokens=rounds + accepted,
        drafted_per_position=[rounds, rounds, rounds],
    )
    return VersionStats(weight_version=version, counters=counters, samples_finished=samples)


def test_a_collapse_is_one_alarm_from_its_first_version_until_a_version_works_again() -> None:
    watch = CollapseWatch(RULE)
    working, dead = (300, 150), (300, 3)  # tau 1.5 and 1.01 over 300 drafting rounds
    assert watch.observe([_stats(1, *working)]) is None
    raised = watch.observe([_stats(1, *working), _stats(2, *dead)])
    assert raised is not None and watch.collapses == 1
    assert (raised.weight_version, raised.latest_version, raised.reference_version) == (2, 2, 1)
    assert (raised.tau_before, raised.tau_after, raised.verify_steps) == (1.5, 1.01, 300)
    assert watch.collapsed(2) and not watch.collapsed(1)
    # the next version is still dead: the same alarm, moved on
    raised = watch.observe([_stats(1, *working), _stats(2, *dead), _stats(3, 100, 0), _stats(4, *dead)])
    assert raised is not None and watch.collapses == 1 and raised.weight_version == 2 and raised.latest_version == 4
    # a working version clears it; the next collapse is a new alarm
    assert watch.observe([_stats(4, *dead), _stats(5, *working)]) is None and watch.recovered_at == 5
    raised = watch.observe([_stats(5, *working), _stats(6, *dead)])
    assert raised is not None and watch.collapses == 2 and raised.reference_version == 5


def test_no_alarm_without_a_working_version_before_or_enough_evidence() -> None:
    watch = CollapseWatch(RULE)
    assert watch.observe([_stats(1, 300, 0)]) is None  # dead from the start: nothing went stale
    assert watch.observe([_stats(1, 300, 0), _stats(2, 300, 150), _stats(3, 255, 0)]) is None  # < min_rounds
    assert watch.observe([_stats(3, 300, 0, samples=RULE.min_samples - 1)]) is None  # < min_samples
    assert watch.observe([_stats(3, 300, 30)]) is None  # tau 1.1: weak, not collapsed
    assert RULE.verdict(_stats(3, 300, 30)) is Verdict.UNDECIDED
    assert watch.observe([_stats(3, 300, 15)]) is not None  # tau 1.05: collapsed


def test_a_held_controller_drafts_nothing_until_the_next_version() -> None:
    policy = SpeculationController(SpeculationControllerConfig(max_speculation_k=3))
    policy.hold("draft collapsed at weight version 2")
    decision = policy.decide(4)
    assert (decision.k, decision.reason) == (0, "collapsed") and "version 2" in decision.detail
    policy.on_weight_version()
    assert policy.held == "" and policy.decide(4).reason != "collapsed"


# ---- a real engine under the real scheduler -------------------------------------------------------
def peaked_aligned_model(seed: int = 3) -> Qwen3WithMTP:
    """`aligned_draft_model` with its (shared) output head scaled 10x: peaked distributions."""
    model = aligned_draft_model(CONFIG, seed=seed)
    with torch.no_grad():
        model.output_weight().mul_(10.0)
    return model


def _draft(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in state.items() if n.startswith("mtp.")}


def _target(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in state.items() if not n.startswith("mtp.")}


def _nudged(state: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A trainer-sized update of every tensor, target and draft alike, as the RL loop pushes them
    (selector ALL): 1.5% of each tensor's scale per push (an Adam step at the demo's trunk lr 3e-4
    moves a weight of RMS 0.02 by about that much; tools/bench/weight_change.py)."""
    return {n: t + 1.5e-2 * t.std().clamp_min(1e-6) * torch.randn(t.shape, generator=gen) for n, t in state.items()}


class Served:
    """A TorchEngine under the scheduler, with pushes and generations as the RL loop makes them."""

    def __init__(self, model: Qwen3WithMTP, k: int = 3) -> None:
        self.engine = TorchEngine(model, speculation_k=k, max_batch_size=PROMPTS)
        self.scheduler = Scheduler(self.engine, SchedulerConfig())
        self.scheduler.start()
        self.version = 0

    def push(self, tensors: dict[str, torch.Tensor], selector: WeightSelector) -> None:
        self.version += 1
        staged = StagedWeights(
            version=self.version, selector=selector, tensors=tensors, bytes_received=0, receive_seconds=0.0
        )
        self.scheduler.apply_weights(staged)

    def generate(self) -> list[list[int]]:
        """One rollout of the current version; its sequences (prompt + completion)."""
        request = GenerationRequest(
            prompts=[[1 + i, (7 * i) % 256, (3 * i + 5) % 256] for i in range(PROMPTS)],
            sampling=SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=self.version),
        )
        handle = self.scheduler.submit(request)
        sequences = []
        while (sample := handle.get(timeout=60.0)) is not None:
            sequences.append(request.prompts[sample.prompt_index] + sample.token_ids)
        # the last sample is delivered before the step's snapshot refresh: a command runs after it
        self.scheduler.abort("no such request")
        return sequences

    def tau(self, version: int) -> float:
        (stats,) = [v for v in self.scheduler.snapshot().versions if v.weight_version == version]
        return drafting_tau(stats.counters)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served(peaked_aligned_model())
    yield s
    s.scheduler.stop()


def test_ordinary_pushes_stay_quiet(served: Served) -> None:
    gen = torch.Generator().manual_seed(0)
    state = model_state_dict(served.engine.model)
    state = {n: t.clone() for n, t in state.items()}
    served.generate()
    for _ in range(12):
        state = _nudged(state, gen)
        served.push(state, WeightSelector.ALL)
        served.generate()
        assert served.scheduler.snapshot().draft_collapsed is None
        assert served.tau(served.version) >= RULE.healthy_tau  # each version had a verdict: the test could fire
    assert served.scheduler.snapshot().draft_collapses == 0


@pytest.mark.parametrize("kind", ["stale target", "zeroed draft", "random draft"])
def test_a_stale_or_wrong_draft_raises_the_alarm_with_its_version(served: Served, kind: str) -> None:
    state = {n: t.clone() for n, t in model_state_dict(served.engine.model).items()}
    served.push(state, WeightSelector.ALL)  # version 1: the draft works
    served.generate()
    if kind == "stale target":  # the target moves away (its residual layers no longer ~identity), the draft stays
        moved = peaked_aligned_model()
        with torch.no_grad():
            for layer in moved.model.layers:
                layer.self_attn.o_proj.weight.mul_(500.0)
                layer.mlp.down_proj.weight.mul_(500.0)
        served.push(_target(model_state_dict(moved)), WeightSelector.TARGET)
    elif kind == "zeroed draft":  # draft weights lost (e.g. a sleep/wake that did not restore them)
        served.push({n: torch.zeros_like(t) for n, t in _draft(state).items()}, WeightSelector.DRAFT)
    else:  # another model's draft
        served.push(_draft(model_state_dict(build_model(CONFIG, seed=12))), WeightSelector.DRAFT)
    served.generate()
    snap = served.scheduler.snapshot()
    raised = snap.draft_collapsed
    assert raised is not None, f"no alarm; tau of version 2: {served.tau(2):.3f}"
    assert (raised.weight_version, raised.reference_version, snap.draft_collapses) == (2, 1, 1)
    assert raised.tau_before == pytest.approx(served.tau(1)) and raised.tau_before >= RULE.healthy_tau
    assert raised.tau_after == pytest.approx(served.tau(2)) and raised.tau_after <= RULE.collapsed_tau
    assert raised.verify_steps >= RULE.min_rounds
    # fixed k keeps drafting (the operator's choice); pushing the matching draft back clears the alarm
    served.push(state, WeightSelector.ALL)
    served.generate()
    assert served.scheduler.snapshot().draft_collapsed is None and served.scheduler.snapshot().draft_collapses == 1


def test_automatic_k_stops_drafting_a_collapsed_version_and_resumes_on_the_next(served: Served) -> None:
    state = {n: t.clone() for n, t in model_state_dict(served.engine.model).items()}
    served.push(state, WeightSelector.ALL)
    served.generate()
    served.push({n: torch.zeros_like(t) for n, t in _draft(state).items()}, WeightSelector.DRAFT)
    served.generate()  # fixed k = 3: the evidence of version 2
    assert served.scheduler.snapshot().draft_collapsed is not None
    served.scheduler.set_speculation_k(3, speculation_auto=True)
    drafted = served.scheduler.snapshot().versions[-1].counters.drafted_tokens
    served.generate()
    snap = served.scheduler.snapshot()
    assert snap.versions[-1].weight_version == 2 and snap.versions[-1].counters.drafted_tokens == drafted
    assert snap.info.speculation_status.reason == "collapsed"
    served.push(_draft(state), WeightSelector.DRAFT)  # version 3: judged afresh, automatic k may draft again
    assert served.engine.speculation.controller is not None and served.engine.speculation.controller.held == ""
    served.scheduler.set_speculation_k(3)  # a fixed k again: new requests have nothing to hold
    assert not served.engine.hold_drafting("collapsed")


# ---- what the user sees: GetStats, Prometheus, the fleet's log ------------------------------------
def test_getstats_prometheus_and_the_fleet_report_the_collapse_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = peaked_aligned_model()
    state = {n: t.clone() for n, t in model_state_dict(model).items()}
    save_checkpoint(tmp_path / "ckpt", CONFIG, state)
    sidecar = start_sidecar(tmp_path / "ckpt", speculation_k=3, max_batch_size=PROMPTS)
    request = GenerationRequest(
        prompts=[[1 + i, (7 * i) % 256] for i in range(PROMPTS)],
        sampling=SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=1),
    )
    caplog.set_level(logging.INFO)
    try:
        with Fleet([sidecar.address]) as fleet:
            fleet.push_weights(state)
            fleet.generate(request)
            fleet.speculation_delta()
            assert fleet.draft_collapses() == {} and fleet.take_draft_alarms() == []
            fleet.push_weights(
                {n: torch.zeros_like(t) for n, t in _draft(state).items()}, selector=WeightSelector.DRAFT
            )
            fleet.generate(request)
            (client,) = fleet.clients
            # the stream ends as its last sample leaves, a moment before the step's snapshot refresh
            wait_until(lambda: client.stats().draft_collapsed is not None, what="the collapse in GetStats")
            for _ in range(3):  # the trainer reads stats several times a step, every step
                fleet.speculation_delta()
            alarms = fleet.take_draft_alarms()
            assert len(alarms) == 1 and sidecar.address in alarms[0] and "weight version 2" in alarms[0]
            assert fleet.draft_collapses()[sidecar.address].weight_version == 2
            stats = client.stats()
            assert stats.draft_collapsed is not None and stats.draft_collapsed.reference_version == 1
            assert stats.draft_collapses == 1
            text = generate_latest(sidecar.metrics.registry).decode()
            assert "specrl_draft_collapsed 1.0" in text and "specrl_draft_collapse_version 2.0" in text
            assert "specrl_draft_collapses_total 1.0" in text
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "draft collapsed" in r.message]
            fleet_lines = [r for r in warnings if r.name == "sidecar.client.draft_alarm"]
            assert len(fleet_lines) == 1
    finally:
        sidecar.stop()


def test_the_trainer_logs_each_collapse_once_and_plots_it_every_step(caplog: pytest.LogCaptureFixture) -> None:
    cfg = RLConfig(
        model=Path("unused"),
        rollout=RolloutConfig(prompts_per_step=3, samples_per_prompt=2, max_new_tokens=4),
        sidecars=SidecarsConfig(addresses=["fake:1"]),
    )
    fleet = FakeFleet()
    run = Run(cfg=cfg, policy=RecordingPolicy(), sidecars=fleet, task=RuleTask(), tokenizer=TOK, run_dir=None)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING)
    raised = DraftCollapse(
        weight_version=3, latest_version=3, reference_version=2, tau_before=2.4, tau_after=1.01, verify_steps=900
    )
    history = []
    with rollout_pipeline(run, 0, 6) as rollouts:
        for step in range(6):
            fleet.collapse, fleet.collapses = (raised, 1) if 2 <= step < 4 else (None, 1 if step >= 2 else 0)
            history.append(rl_step(run, step, rollouts))
    assert [m["spec/draft_collapsed"] for m in history] == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "trainer.rl.rollouts" and "draft collapsed" in r.getMessage()
    ]
    assert len(lines) == 1 and lines[0].startswith("step 2:") and "fake:1" in lines[0] and "version 3" in lines[0]


# ---- the TRL integration's DraftAligner ----------------------------------------------------------
def test_the_draft_aligner_refits_a_wrong_mtp_draft_and_the_alarm_clears(served: Served, tmp_path: Path) -> None:
    """DraftAligner as the TRL integration runs it (bound to a Hugging Face policy, fitted on the
    latest rollouts, pushed as DRAFT), on the MTP draft as it is: it starts from another model's
    draft (the alarm raised) and one refit brings tau back above the working threshold."""
    transformers = pytest.importorskip("transformers")
    state = {n: t.clone() for n, t in model_state_dict(served.engine.model).items()}
    wrong = _draft(model_state_dict(build_model(CONFIG, seed=12)))
    save_checkpoint(tmp_path / "ckpt", CONFIG, {**state, **wrong})
    served.push(state, WeightSelector.ALL)
    served.generate()
    served.push(wrong, WeightSelector.DRAFT)
    rollouts = served.generate()
    assert served.scheduler.snapshot().draft_collapsed is not None
    aligner = DraftAligner(tmp_path / "ckpt", DraftAlignConfig(every=4))
    aligner.bind(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32))
    assert not aligner.due() and aligner.due(collapsed=True)  # a raised alarm does not wait for `every`
    losses = aligner.fit(rollouts)
    assert losses[-1] < 0.5 * losses[0]
    served.push({n: t.clone() for n, t in aligner.draft_tensors()}, WeightSelector.DRAFT)
    served.generate()
    assert served.scheduler.snapshot().draft_collapsed is None
    assert served.tau(served.version) >= RULE.healthy_tau
