"""Temperature > 0 with an EAGLE-3 draft: speculative samples follow the exact target distribution.

The harness of `test_speculative_distribution.py` with the other draft kind. Oracle: the exact
joint distribution of the first three generated tokens, enumerated over all V^3 continuations
through the target's plain full forward and Hugging Face's logits warpers (no engine code). Test:
Pearson's goodness of fit of N = 4000 engine samples, exact Monte Carlo p-value
(`sidecar.losslessness.statistics`, calibrated in tests/sidecar/losslessness/test_losslessness_calibration.py), alpha
= 1e-3. The draft is partly aligned (acceptance 0.27-0.51), once with the full vocabulary and once
with a reduced one (6 of the 8 ids: q is 0 on the other two, which the target then reaches only
through the residual and bonus paths).

Power: with the same draft, the wrong acceptance rules of `sidecar.losslessness.wrong_rules`
must be rejected at p < 1e-4. Seeds are fixed, so the outcome is deterministic.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sidecar.engine.sampling import AcceptanceRule
from sidecar.engine.torch_engine import TorchEngine
from sidecar.losslessness.statistics import pooled_chi_square_pvalue
from sidecar.losslessness.wrong_rules import WRONG_RULES, with_acceptance_rule
from sidecar.model.eagle3 import Eagle3Draft
from sidecar.model.model import Qwen3WithMTP
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar.engine_fixtures import aligned_eagle3, eagle3_target, hf_probs

V = 8
PROMPT = [3, 1, 4, 1, 5]
N = 4000
ALPHA = 1e-3
REDUCED = [0, 1, 2, 4, 5, 7]


@pytest.fixture(scope="module")
def target() -> Qwen3WithMTP:
    return eagle3_target(V, eps=0.1)


@pytest.fixture(scope="module")
def drafts(target: Qwen3WithMTP) -> dict[str, Eagle3Draft]:
    return {"full": aligned_eagle3(target), "reduced": aligned_eagle3(target, REDUCED)}


def exact_joint(model: Qwen3WithMTP, sp: SamplingParams) -> torch.Tensor:  # (V**3,) P(t1, t2, t3)
    conts = torch.tensor(list(itertools.product(range(V), repeat=3)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(conts), -1), conts], dim=1)
    with torch.no_grad():
        logits = model(ids)[:, len(PROMPT) - 1 : len(PROMPT) + 2].double()
    probs = torch.stack([hf_probs(logits[:, i], sp) for i in range(3)], dim=1)  # (V^3, 3, V)
    return probs.gather(-1, conts[..., None])[..., 0].prod(dim=1)


def engine_counts(
    model: Qwen3WithMTP, draft: Eagle3Draft, sp: SamplingParams, k: int, rule: AcceptanceRule | None = None
) -> tuple[torch.Tensor, float]:
    engine = TorchEngine(model, speculation_k=k, max_batch_size=1000, draft=draft)
    if rule is not None:
        with_acceptance_rule(engine, rule)
    samples = engine.generate(GenerationRequest(prompts=[PROMPT], sampling=sp, samples_per_prompt=N, speculation_k=k))
    cells = torch.tensor([(s.token_ids[0] * V + s.token_ids[1]) * V + s.token_ids[2] for s in samples])
    return torch.bincount(cells, minlength=V**3).double(), engine.stats()[0].counters.acceptance_rate


SETTINGS = [
    ("full", SamplingParams(temperature=1.0, max_new_tokens=4, seed=1), 2),
    ("reduced", SamplingParams(temperature=1.0, max_new_tokens=4, seed=2), 3),
    ("full", SamplingParams(temperature=0.8, top_k=5, top_p=0.85, max_new_tokens=4, seed=3), 3),
]


@pytest.mark.slow
@pytest.mark.parametrize(("vocab", "sp", "k"), SETTINGS)
def test_eagle3_speculative_samples_follow_the_exact_target_distribution(
    target: Qwen3WithMTP, drafts: dict[str, Eagle3Draft], vocab: str, sp: SamplingParams, k: int
) -> None:
    counts, acceptance = engine_counts(target, drafts[vocab], sp, k)
    assert 0.2 < acceptance < 0.8  # both the accept and the residual paths carry mass
    assert pooled_chi_square_pvalue(counts, exact_joint(target, sp)) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule", sorted(WRONG_RULES))
def test_the_harness_rejects_wrong_acceptance_rules_with_an_eagle3_draft(
    target: Qwen3WithMTP, drafts: dict[str, Eagle3Draft], wrong_rule: str
) -> None:
    _, sp, k = SETTINGS[0]
    counts = engine_counts(target, drafts["full"], sp, k, rule=WRONG_RULES[wrong_rule])[0]
    assert pooled_chi_square_pvalue(counts, exact_joint(target, sp)) < 1e-4
