"""The engine under the adaptive k controller: k switching mid-sequence stays lossless, the guard
trips inside the engine on a wrong cost model, and a weight push discounts the acceptance estimate.

Oracle: a naive greedy loop over the plain full forward (as in test_speculative_greedy.py).
Timings come from an injected clock, so nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

from sidecar.engine.rows import CATCH_UP_POSITIONS
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.speculation.acceptance import MIN_ROW_DRAFTS
from sidecar.speculation.config import RowState, SpeculationControllerConfig
from sidecar.speculation.controller import SpeculationController
from sidecar.types import GenerationRequest, SamplingParams, WeightSelector
from tests.sidecar.engine.test_speculative_distribution import SwitchingPolicy
from tests.sidecar.engine.test_speculative_greedy import NEW, PROMPTS, naive_greedy
from tests.sidecar.engine_fixtures import aligned_draft_model


def run_all(engine: TorchEngine, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    """Every prompt its own auto-mode request, all submitted at once (one ragged batch)."""
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0.0, max_new_tokens=new)
        engine.submit(GenerationRequest(prompts=[p], sampling=sp, request_id=f"r{i}"))
    out: dict[str, list[int]] = {}
    for _ in range(10 * new):
        out.update({s.request_id: s.token_ids for s in engine.step()})
        if not engine.has_work():
            break
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("draft", ["random", "aligned"])
@pytest.mark.parametrize("cycle", [[3, 0, 1, 0, 0, 2, 5], [0, 0, 4, 1], [0] * (CATCH_UP_POSITIONS + 3) + [3, 2]])
def test_greedy_output_is_plain_while_k_switches_every_step(request, draft: str, cycle: list[int]) -> None:
    model: Qwen3WithMTP = request.getfixturevalue(f"{draft}_model")
    engine = TorchEngine(model, speculation_k=3)
    engine.set_speculation_controller(SwitchingPolicy(cycle))
    assert run_all(engine, PROMPTS) == [naive_greedy(model, p, NEW) for p in PROMPTS]
    c = engine.stats()[0].counters
    assert c.drafted_tokens > 0 and c.verify_steps > c.generated_tokens / 6


def test_rows_that_skip_drafting_keep_a_bounded_catch_up(aligned_model) -> None:
    """Plain rounds of an auto row leave at most CATCH_UP_POSITIONS (+ one round's) MTP inputs to
    refresh when drafting resumes, and the resumed draft still proposes the target's tokens."""
    idle = 3 * CATCH_UP_POSITIONS
    engine = TorchEngine(aligned_model, speculation_k=3)
    engine.set_speculation_controller(SwitchingPolicy([0] * idle + [3]))
    engine.submit(
        GenerationRequest(
            prompts=[[5, 6, 7]], sampling=SamplingParams(temperature=0.0, max_new_tokens=64), request_id="r"
        )
    )
    engine.step()  # admission
    widths = []
    for _ in range(idle):
        engine.step()
        widths.append(engine.scheduler.running[0].num_pending)
    assert widths[:3] == [2, 3, 4] and max(widths) == CATCH_UP_POSITIONS
    before = engine.stats()[0].counters.accepted_tokens
    engine.step()  # drafts 3 after the gap
    assert engine.scheduler.running[0].num_pending <= 4
    assert engine.stats()[0].counters.accepted_tokens - before >= 2  # the aligned draft is still right


class RecordingPolicy(SwitchingPolicy):
    """Scripted k, recording what the engine reports of each step."""

    def __init__(self, cycle: list[int]) -> None:
        super().__init__(cycle)
        self.steps: list[dict] = []
        self.evidence: list[tuple[list[int], list[int]]] = []  # observe_acceptance's, per step

    def observe_step(self, **kw) -> None:
        self.steps.append(kw)
        super().observe_step(**kw)

    def observe_acceptance(self, drafted: list[int], accepted: list[int]) -> None:
        self.evidence.append((drafted, accepted))
        super().observe_acceptance(drafted, accepted)


def run_to_stop(model: Qwen3WithMTP, cycle: list[int], stop: int) -> RecordingPolicy:
    """PROMPTS[0] greedily under scripted k, up to 12 tokens or `stop`; the policy's record."""
    policy = RecordingPolicy(cycle)
    engine = TorchEngine(model, speculation_k=3)
    engine.set_speculation_controller(policy)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop])
    engine.submit(GenerationRequest(prompts=[PROMPTS[0]], sampling=sp, request_id="r"))
    while engine.has_work():
        engine.step()
    return policy


def test_the_engine_reports_catch_up_steps_and_stop_tokens(aligned_model) -> None:
    """A drafting step after plain rounds refreshes the skipped positions too: the engine says so
    (its draft phase is not steady drafting's cost); a sequence that emits its stop token counts
    as ended (the length cap does not)."""
    policy = RecordingPolicy([3, 3, 0, 0, 3, 3, 0, 1])
    engine = TorchEngine(aligned_model, speculation_k=3)
    engine.set_speculation_controller(policy)
    expected = naive_greedy(aligned_model, PROMPTS[0], 40)
    sp = SamplingParams(temperature=0.0, max_new_tokens=40)
    engine.submit(GenerationRequest(prompts=[PROMPTS[0]], sampling=sp, request_id="r"))
    while engine.has_work():
        engine.step()
    flags = [(st["k"], st["catch_up"]) for st in policy.steps]
    assert flags[:8] == [(3, False), (3, False), (0, False), (0, False), (3, True), (3, False), (0, False), (1, True)]
    assert sum(st["tokens"] for st in policy.steps) == 40 - 1  # the first token comes from the prefill
    assert all(st["ended"] == 0 for st in policy.steps)  # finished on the length cap
    policy = run_to_stop(aligned_model, [2], stop=expected[4])
    assert [st["ended"] for st in policy.steps][-1] == 1 and sum(st["ended"] for st in policy.steps) == 1


def test_drafts_after_an_accepted_stop_token_are_not_acceptance_evidence(aligned_model) -> None:
    """A row whose accepted draft is its stop token ends there; the drafts verified after it are
    never emitted, and whether the target agrees with them after the end says nothing about the
    draft (on the RL workload they had pulled position 3's estimate from ~0.73 to ~0.66). The
    engine reports each row's emitted tokens and where it ended, and the evidence stops at the
    end."""
    expected = naive_greedy(aligned_model, PROMPTS[0], 12)
    stop = expected[2]  # the first step's second draft: the aligned draft proposes it, and one more
    policy = run_to_stop(aligned_model, [3], stop=stop)
    end = expected.index(stop)
    assert end in (1, 2) and policy.steps[-1]["rows"][-1][2]
    assert sum(n for st in policy.steps for _, n, _ in st["rows"]) == end  # the prefill emitted token 0
    last_start, last_emitted, _ = policy.steps[-1]["rows"][0]
    assert last_start + last_emitted == end + 1 and last_emitted < 3  # ended on an accepted draft
    for (drafted, accepted), st in zip(policy.evidence, policy.steps, strict=True):
        emitted = [n for _, n, _ in st["rows"]]
        assert all(d <= n and a <= d for d, a, n in zip(drafted, accepted, emitted, strict=True))
    assert policy.evidence[-1] == ([last_emitted], [last_emitted])  # every draft up to the stop accepted


def test_every_finished_row_tells_the_controller_how_it_accepted(aligned_model) -> None:
    """Rows finishing in the controller's batch report their position-1 counts (the pooled
    spread of acceptance between rows), the same counts their samples carry."""
    policy = RecordingPolicy([2, 0, 3, 1])
    engine = TorchEngine(aligned_model, speculation_k=3, max_batch_size=2)
    engine.set_speculation_controller(policy)
    samples = []
    for i, p in enumerate(PROMPTS[:3]):
        sp = SamplingParams(temperature=1.0, max_new_tokens=10 + 6 * i, seed=i)
        engine.submit(GenerationRequest(prompts=[p], sampling=sp, request_id=f"r{i}"))
    while engine.has_work():
        samples += engine.step()
    counts = sorted((s.counters.drafted_per_position[0], s.counters.accepted_per_position[0]) for s in samples)
    kept = [c for c in counts if c[0] >= MIN_ROW_DRAFTS]  # fewer drafts say too little to be kept
    assert len(samples) == 3 and kept and sorted(policy.acceptance.finished_rows) == kept


@pytest.mark.parametrize("compile_mode", ["auto", "on"])  # on: the fixed-shape rounds a GPU captures
def test_greedy_output_is_plain_under_the_real_controller_and_rows_joining_late(aligned_model, compile_mode) -> None:
    engine = TorchEngine(aligned_model, speculation_k=4, speculation_auto=True, max_batch_size=2, compile=compile_mode)
    assert engine.speculation_auto and engine.info().speculation_status.speculation_auto
    assert run_all(engine, PROMPTS) == [naive_greedy(aligned_model, p, NEW) for p in PROMPTS]
    status = engine.speculation_status()
    assert (
        status.reason in ("model", "probe", "guard") and 0 <= status.speculation_k <= 4 and len(status.acceptance) == 4
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_speculation_prices_steps_by_wall_clock_and_stays_greedy_exact(
    aligned_model: Qwen3WithMTP, tiny_config: ModelConfig
) -> None:
    """On CUDA the controller measures synchronised wall seconds (CPU time would count only the
    kernel launches) and its k switching keeps greedy output equal to plain decoding on the same
    device, rows of different lengths in one ragged batch."""
    cuda_model = build_model(tiny_config, device="cuda")
    cuda_model.load_state_dict(model_state_dict(aligned_model))
    auto = TorchEngine(cuda_model, speculation_k=4, speculation_auto=True, max_batch_size=4)
    assert auto._clock is time.perf_counter
    plain = TorchEngine(cuda_model, speculation_k=0)
    assert run_all(auto, PROMPTS) == run_all(plain, PROMPTS)
    status = auto.speculation_status()
    assert status.reason in ("model", "probe", "guard") and 0 <= status.speculation_k <= 4
    assert auto.stats()[0].counters.verify_steps > 0


class FakeClock:
    """Seconds that advance by a cost model of 'true' hardware: TorchEngine reads the clock three
    times per decode step (start, after the draft, end); a step with k drafts costs
    `draft * k` + `verify * (1 + slope * k)`. The reads around an admission's draft prefill
    (`Runner.prefill_draft`) see time stand still."""

    def __init__(self, engine_ref: list[TorchEngine], draft: float, verify: float, slope: float) -> None:
        self.engine_ref, self.draft, self.verify, self.slope = engine_ref, draft, verify, slope
        self.now, self.reads = 0.0, 0

    def __call__(self) -> float:
        if sys._getframe(1).f_code.co_name == "prefill_draft":
            return self.now
        phase = self.reads % 3
        self.reads += 1
        k = self.engine_ref[0].speculation_status().speculation_k
        if phase == 1:
            self.now += self.draft * k
        elif phase == 2:
            self.now += self.verify * (1 + self.slope * k)
        return self.now


def test_the_guard_trips_inside_the_engine_on_a_wrong_cost_model_and_output_stays_exact() -> None:
    model = aligned_draft_model(ModelConfig.tiny(), seed=3)
    ref: list[TorchEngine] = []
    clock = FakeClock(ref, draft=0.004, verify=0.010, slope=2.0)  # every k > 0 loses to plain
    wrong = SpeculationControllerConfig(
        max_speculation_k=4, cost_bias=0.01, guard_rows=24, guard_min_steps=4, backoff_steps=8
    )
    engine = TorchEngine(model, speculation_k=4, speculation_auto=True, controller=wrong, clock=clock)
    ref.append(engine)
    reasons = []
    prompts = PROMPTS * 2
    for i, p in enumerate(prompts):
        engine.submit(
            GenerationRequest(
                prompts=[p], sampling=SamplingParams(temperature=0.0, max_new_tokens=64), request_id=str(i)
            )
        )
    out = {}
    while engine.has_work():
        out.update({s.request_id: s.token_ids for s in engine.step()})
        reasons.append(engine.speculation_status().reason)
    assert engine.speculation_status().guard_trips >= 1 and "guard" in reasons
    assert [out[str(i)] for i in range(len(prompts))] == [naive_greedy(model, p, 64) for p in prompts]
    right = TorchEngine(model, speculation_k=4, speculation_auto=True, clock=FakeClock([], 0.004, 0.010, 2.0))
    right._clock.engine_ref.append(right)  # type: ignore[attr-defined]
    run_all(right, PROMPTS, new=64)
    assert right.speculation_status().guard_trips == 0  # measured costs alone keep it at plain


def test_a_weight_push_discounts_the_acceptance_estimate(random_model: Qwen3WithMTP) -> None:
    model = aligned_draft_model(ModelConfig.tiny(), seed=2)
    engine = TorchEngine(model, speculation_k=3)
    policy = SwitchingPolicy([3], version_discount=0.0)  # k = 3 always; the real acceptance estimator
    engine.set_speculation_controller(policy)
    run_all(engine, PROMPTS[:2])
    assert policy.acceptance.rates()[0] > 0.8  # the aligned draft
    draft_names = {t.name for t in engine.weight_specs(WeightSelector.DRAFT)}
    bad = {n: t.clone() for n, t in random_model.state_dict().items() if n in draft_names}
    engine.update_weights(bad, WeightSelector.DRAFT, version=1)
    assert policy.acceptance.reached == [0.0, 0.0, 0.0]  # discount 0: the old version's evidence is gone
    run_all(engine, PROMPTS[2:])
    assert policy.acceptance.rates()[0] < 0.5  # the random draft's acceptance, from its own rounds


def test_switching_the_default_back_to_fixed_keeps_running_auto_rows_on_the_controller(aligned_model) -> None:
    engine = TorchEngine(aligned_model, speculation_k=3)
    engine.set_speculation_controller(SwitchingPolicy([2]))
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    engine.submit(GenerationRequest(prompts=[PROMPTS[0]], sampling=sp, request_id="auto"))
    out = {s.request_id: s.token_ids for s in engine.step() + engine.step()}
    engine.set_speculation_k(0)
    assert not engine.speculation_auto and engine.speculation_status().reason == "fixed"
    engine.submit(GenerationRequest(prompts=[PROMPTS[2]], sampling=sp, request_id="fixed"))
    drafted = engine.stats()[0].counters.drafted_tokens
    while engine.has_work():
        out.update({s.request_id: s.token_ids for s in engine.step()})
    assert out["auto"] == naive_greedy(aligned_model, PROMPTS[0], NEW)
    assert out["fixed"] == naive_greedy(aligned_model, PROMPTS[2], NEW)
    assert engine.stats()[0].counters.drafted_tokens > drafted  # the auto row kept drafting


class AdmissionRecorder(SpeculationController):
    """The real controller, recording what the engine tells it at admission."""

    def __init__(self, refuse: bool) -> None:
        super().__init__(SpeculationControllerConfig(max_speculation_k=3))
        self.refuse = refuse
        self.asked: list[dict] = []
        self.rows: list[list[RowState]] = []
        self.prefills: list[tuple[int, float]] = []

    def may_draft(self, batch, tokens_left=None, rows=None, joining=None, prompt_tokens=None) -> bool:
        self.asked.append({"batch": batch, "joining": joining, "prompt_tokens": prompt_tokens})
        self.rows.append(list(rows or []))
        return not self.refuse

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        self.prefills.append((tokens, seconds))
        super().observe_draft_prefill(tokens, seconds)


@pytest.mark.parametrize("refuse", [False, True])
def test_the_engine_times_the_draft_prefill_that_a_refusal_saves(aligned_model, refuse: bool) -> None:
    """At admission the controller learns how many rows join and how many prompt tokens their
    draft prefill covers (all but each prompt's last), and, when they keep a draft, what that
    prefill cost: what refusing a draft would save (`SpeculationController.may_draft`). Refused
    rows run no prefill and their output stays exact."""
    ticks = iter(range(10**6))
    policy = AdmissionRecorder(refuse)
    engine = TorchEngine(aligned_model, speculation_k=3, clock=lambda: 0.5 * next(ticks))
    engine.set_speculation_controller(policy)
    prompts = [PROMPTS[2][:5], PROMPTS[2]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    samples = engine.generate(GenerationRequest(prompts=prompts, sampling=sp))
    assert policy.asked[0] == {"batch": 2, "joining": 2, "prompt_tokens": 4 + 6}
    assert policy.prefills == ([] if refuse else [(4 + 6, 0.5)])  # one clock tick around the MTP layers
    assert [s.token_ids for s in samples] == [naive_greedy(aligned_model, p, 8) for p in prompts]


def test_only_automatic_rows_are_put_to_the_refusal_rule(aligned_model) -> None:
    """A request that pins k is never refused a draft, so its admission is not the controller's
    to judge: asking would count towards `refuse_every` and make GetStats say rows joined without
    a draft. In a mixed admission the joining rows are the automatic ones (last in `rows`), and
    so is the prompt their prefill covers."""
    policy = AdmissionRecorder(refuse=True)
    engine = TorchEngine(aligned_model, speculation_k=3)
    engine.set_speculation_controller(policy)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    pinned = engine.generate(GenerationRequest(prompts=[PROMPTS[1]], sampling=sp, speculation_k=2))
    assert policy.asked == []
    assert engine.stats()[0].counters.drafted_tokens > 0  # the pinned row drafted
    engine.submit(GenerationRequest(prompts=[PROMPTS[2]], sampling=sp, request_id="auto"))
    engine.submit(GenerationRequest(prompts=[PROMPTS[0]], sampling=sp, speculation_k=2, request_id="pinned"))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        out.update({s.request_id: s.token_ids for s in engine.step()})
    assert policy.asked == [{"batch": 2, "joining": 1, "prompt_tokens": len(PROMPTS[2]) - 1}]
    assert policy.rows[0][-1].length == 0 and len(policy.rows[0]) == 2
    assert pinned[0].token_ids == naive_greedy(aligned_model, PROMPTS[1], 6)
    assert out == {
        "auto": naive_greedy(aligned_model, PROMPTS[2], 6),
        "pinned": naive_greedy(aligned_model, PROMPTS[0], 6),
    }
