"""Temperature > 0: speculative sampling is distributed exactly as plain sampling.

Oracle: the exact joint distribution of the first three generated tokens, P(t1, t2, t3 |
prompt), computed by enumerating all V^3 continuations through the plain full forward and
Hugging Face's logits warpers (temperature, top-k, top-p) — no engine code involved.

Test: Pearson's goodness of fit of N = 4000 engine samples against that distribution (cells
expecting < 5 counts pooled), with the exact Monte Carlo p-value of
`sidecar.losslessness.statistics` (calibrated whatever the cells; see
tests/sidecar/losslessness/test_losslessness_calibration.py), at alpha = 1e-3. With V = 8 and a partly
aligned MTP draft (acceptance 0.4-0.6, so the residual and the bonus paths both carry a
large share of the mass) the first speculative round covers t2 and t3: draft positions,
rejection → residual, and bonus.

Power: the same test is run on two deliberately wrong acceptance rules, injected through the
`wrong_rules.with_acceptance_rule` (`sidecar.losslessness.wrong_rules.WRONG_RULES`, which
`specrl verify` also simulates for its power statement) — "accept every draft" (emits the draft
distribution q) and "on rejection resample from p instead of norm(max(0, p − q))" (the classic
subtle bug, which biases towards tokens both models like), and greedy verification. Each must
be rejected at p < 1e-4 (the p-value's resolution is 1e-5: none of 10^5 simulated statistics
reaches the observed one), i.e. the test has essentially full power against errors of this
size at N = 4000, while the correct rule passes. Seeds are fixed, so the outcome is
deterministic.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sidecar.engine import commit
from sidecar.engine.sampling import AcceptanceRule
from sidecar.engine.torch_engine import TorchEngine
from sidecar.losslessness.statistics import pooled_chi_square_pvalue as chi_square_pvalue
from sidecar.losslessness.wrong_rules import WRONG_RULES, with_acceptance_rule
from sidecar.model.model import ModelConfig, Qwen3WithMTP
from sidecar.speculation.config import RowState, SpeculationControllerConfig, SpeculationDecision
from sidecar.speculation.controller import SpeculationController
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar.engine_fixtures import aligned_draft_model, hf_probs

V = 8
PROMPT = [3, 1, 4, 1, 5]
N = 4000
ALPHA = 1e-3


@pytest.fixture(scope="module")
def model() -> Qwen3WithMTP:
    return aligned_draft_model(ModelConfig.tiny(vocab_size=V), seed=11, eps=0.1)


def exact_joint(
    model: Qwen3WithMTP, sp: SamplingParams, prompt: list[int] = PROMPT
) -> torch.Tensor:  # (V**3,) P(t1, t2, t3)
    conts = torch.tensor(list(itertools.product(range(V), repeat=3)))  # (V^3, 3), lexicographic
    ids = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], dim=1)
    with torch.no_grad():
        logits = model(ids)[:, len(prompt) - 1 : len(prompt) + 2].double()  # predicts t1, t2, t3
    probs = torch.stack([hf_probs(logits[:, i], sp) for i in range(3)], dim=1)  # (V^3, 3, V)
    return probs.gather(-1, conts[..., None])[..., 0].prod(dim=1)


def engine_counts(
    model: Qwen3WithMTP,
    sp: SamplingParams,
    k: int,
    acceptance_rule: AcceptanceRule | None = None,
    compile: str = "auto",
) -> tuple[torch.Tensor, float]:
    """Counts of (t1, t2, t3) over N samples (V**3 cells), and the acceptance rate; `compile`: the
    engine's forwards (`TorchEngine`)."""
    engine = TorchEngine(model, speculation_k=k, max_batch_size=1000, compile=compile)
    if acceptance_rule is not None:
        with_acceptance_rule(engine, acceptance_rule)
    req = GenerationRequest(prompts=[PROMPT], sampling=sp, samples_per_prompt=N, speculation_k=k)
    samples = engine.generate(req)
    cells = torch.tensor([(s.token_ids[0] * V + s.token_ids[1]) * V + s.token_ids[2] for s in samples])
    return torch.bincount(cells, minlength=V**3).double(), engine.stats()[0].counters.acceptance_rate


SETTINGS = [
    (SamplingParams(temperature=1.0, max_new_tokens=4, seed=1), 2),
    (SamplingParams(temperature=1.0, max_new_tokens=3, seed=2), 1),
    (SamplingParams(temperature=0.8, top_k=5, top_p=0.85, max_new_tokens=4, seed=3), 3),
]


@pytest.mark.slow
@pytest.mark.parametrize(("sp", "k"), SETTINGS)
def test_speculative_samples_follow_the_exact_target_distribution(model: Qwen3WithMTP, sp: SamplingParams, k: int):
    exact = exact_joint(model, sp)
    assert chi_square_pvalue(engine_counts(model, sp, 0)[0], exact) > ALPHA  # plain sampling (sanity)
    counts, acceptance = engine_counts(model, sp, k)
    assert 0.3 < acceptance < 0.8  # both the accept and the reject (residual) paths carry mass
    assert chi_square_pvalue(counts, exact) > ALPHA


@pytest.mark.slow
def test_a_mimo_layout_draft_keeps_the_exact_target_distribution() -> None:
    """MiMo's MTP layer (`model.mtp_layers.*`, hidden state first) drafting for a Qwen2 trunk."""
    mimo = aligned_draft_model(ModelConfig.tiny(vocab_size=V, architectures=["MiMoForCausalLM"]), seed=11, eps=0.1)
    assert mimo.config.mtp_layout == "mimo" and not list(mimo.mtp.parameters())
    sp, k = SETTINGS[0]
    counts, acceptance = engine_counts(mimo, sp, k)
    assert 0.3 < acceptance < 0.8
    assert chi_square_pvalue(counts, exact_joint(mimo, sp)) > ALPHA


@pytest.mark.slow
def test_a_turn_served_from_the_prefix_cache_keeps_the_exact_distribution(model: Qwen3WithMTP) -> None:
    """A conversation's second turn (the first turn's prompt, its response, a tool's output) whose
    prefill takes the first turn's cached blocks, target and draft KV, generated tokens' included,
    then speculates: its samples follow the exact joint of the full forward over the whole turn."""
    sp, k = SETTINGS[0]
    engine = TorchEngine(model, speculation_k=k, max_batch_size=1000, kv_block_size=2)
    first = [3, 1, 4, 1, 5, 7, 2, 6]
    (turn,) = engine.generate(
        GenerationRequest(
            prompts=[first], sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=5), speculation_k=k
        )
    )
    second = first + turn.token_ids + [0, 1, 2]
    samples = engine.generate(GenerationRequest(prompts=[second], sampling=sp, samples_per_prompt=N, speculation_k=k))
    stats = engine.stats()[0]
    assert stats.prefix_cache_hit_tokens >= len(first) + 2  # the first turn's response is cached too
    cells = torch.tensor([(s.token_ids[0] * V + s.token_ids[1]) * V + s.token_ids[2] for s in samples])
    counts = torch.bincount(cells, minlength=V**3).double()
    assert 0.3 < stats.counters.acceptance_rate < 0.8
    assert chi_square_pvalue(counts, exact_joint(model, sp, second)) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule", sorted(WRONG_RULES))
def test_the_test_detects_wrong_acceptance_rules(model: Qwen3WithMTP, wrong_rule: str) -> None:
    sp, k = SETTINGS[0]
    exact = exact_joint(model, sp)
    counts = engine_counts(model, sp, k, acceptance_rule=WRONG_RULES[wrong_rule])[0]
    assert chi_square_pvalue(counts, exact) < 1e-4


class SwitchingPolicy(SpeculationController):
    """Scripted controller: k follows a fixed cycle, one entry per decode step (k changes between
    the rounds of every sequence, 0 included)."""

    def __init__(self, cycle: list[int], **config: float) -> None:
        super().__init__(SpeculationControllerConfig(max_speculation_k=max(cycle), **config))
        self.cycle, self.calls = cycle, 0

    def decide(
        self, batch: int, tokens_left: int | None = None, rows: list[RowState] | None = None
    ) -> SpeculationDecision:
        self.last = SpeculationDecision(k=self.cycle[self.calls % len(self.cycle)], reason="probe", batch_size=batch)
        self.calls += 1
        return self.last


@pytest.mark.slow
@pytest.mark.parametrize(("cycle", "catch_up"), [([2, 0, 1], 8), ([1, 0, 2, 3], 8), ([0, 2], 1)])
def test_k_switching_mid_sequence_keeps_the_exact_distribution(
    model: Qwen3WithMTP, cycle: list[int], catch_up: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """catch_up 1: a plain round drops the older pending MTP input, so the next draft refreshes
    one position past a gap in the MTP cache (what automatic k does after long plain stretches)."""
    monkeypatch.setattr(commit, "CATCH_UP_POSITIONS", catch_up)  # where a round keeps them
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, seed=4)
    exact = exact_joint(model, sp)
    engine = TorchEngine(model, max_batch_size=1000)
    engine.set_speculation_controller(SwitchingPolicy(cycle))
    samples = engine.generate(GenerationRequest(prompts=[PROMPT], sampling=sp, samples_per_prompt=N))
    cells = torch.tensor([(s.token_ids[0] * V + s.token_ids[1]) * V + s.token_ids[2] for s in samples])
    c = engine.stats()[0].counters
    assert c.drafted_tokens >= N / 4 and c.accepted_tokens > 0  # speculative rounds really ran
    assert chi_square_pvalue(torch.bincount(cells, minlength=V**3).double(), exact) > ALPHA
