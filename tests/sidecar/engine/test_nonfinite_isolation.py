"""Non-finite values never outlive the request that made them (issue 46).

A push of weights holding one NaN poisons the requests it serves: their keys and values are NaN.
Those slots stay in the KV storage after the rows leave or roll back; the attention reads wide
ranges of slots under an additive mask, and a zero weight times NaN is NaN, so before the fix a
later healthy request that took those slots was poisoned too, even after good weights were
restored. The oracle here is the engine's own output from before the poisoned push (same engine
kind, same rows, same batch), so the comparison is exact, token for token and log-prob for
log-prob; the property test also holds every healthy request against the plain full forward.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, Sample, SamplingParams, WeightSelector
from tests.sidecar.engine.test_static_engine import oracle_greedy
from tests.sidecar.engine_fixtures import aligned_eagle3, eagle3_target

PROMPTS = [list(range(1, 8)), [200, 17, 99]]
NEW = 24
POISON = 5
"""The token whose embedding row the poisoned push makes NaN: a request meeting it is poisoned."""


def issue_model() -> Qwen3WithMTP:
    """The issue's model: 4 layers, vocab 256, width 128, 2 KV heads of 32, context 512, 1 MTP layer."""
    config = ModelConfig.tiny(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        num_nextn_predict_layers=1,
    )
    return build_model(config, seed=0)


def make_engine(draft: str, compile_mode: str) -> TorchEngine:
    if draft == "mtp":
        return TorchEngine(issue_model(), speculation_k=3, compile=compile_mode, max_batch_size=8)
    target = eagle3_target(vocab_size=256, seed=0)
    return TorchEngine(target, draft=aligned_eagle3(target), speculation_k=3, compile=compile_mode, max_batch_size=8)


def served_tensors(engine: TorchEngine) -> dict[str, torch.Tensor]:
    """Copies of everything a push with selector ALL carries (target and draft)."""
    params = dict(engine.model.named_parameters()) | engine.drafter.pushed_parameters()
    return {s.name: params[s.name].detach().clone() for s in engine.weight_specs(WeightSelector.ALL)}


def poisoned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    bad = dict(tensors)
    bad["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    bad["model.embed_tokens.weight"][POISON, 3] = math.nan
    return bad


def generate(engine: TorchEngine, prompts: list[list[int]], k: int, new: int = NEW, rid: str = "") -> list[Sample]:
    request = GenerationRequest(
        prompts=prompts,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=new),
        speculation_k=k,
        request_id=rid,
    )
    return engine.generate(request)


def outputs(samples: list[Sample]) -> list[tuple[list[int], list[float]]]:
    return [(s.token_ids, s.logprobs) for s in samples]


@pytest.mark.parametrize("draft", ["mtp", "eagle3"])
@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("compile_mode", ["on", "off"])  # on: the fixed-shape rounds CUDA captures
def test_a_restoring_push_after_a_nan_push_restores_the_outputs_exactly(draft: str, k: int, compile_mode: str) -> None:
    engine = make_engine(draft, compile_mode)
    good = served_tensors(engine)
    reference = outputs(generate(engine, PROMPTS, k))
    assert all(math.isfinite(x) for _, lp in reference for x in lp)

    engine.update_weights(poisoned(good), WeightSelector.ALL, version=1)
    during = generate(engine, PROMPTS, k)
    assert any(not math.isfinite(x) for s in during for x in s.logprobs)  # the poison reached the outputs

    engine.update_weights(good, WeightSelector.ALL, version=2)
    assert outputs(generate(engine, PROMPTS, k)) == reference  # the first generation after the restore
    assert outputs(generate(engine, PROMPTS, k)) == reference


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    compile_mode=st.sampled_from(["on", "off"]),
    k=st.sampled_from([0, 3]),
)
def test_healthy_requests_after_a_restore_equal_their_oracle_whatever_ran_poisoned_before(
    data: st.DataObject, compile_mode: str, k: int
) -> None:
    """Poisoned and healthy requests interleave in one continuous batch (arrivals between steps,
    rows leaving and joining), then good weights come back: every request after that equals the
    plain full forward's greedy decode, whichever rows and slots the poisoned ones used."""
    engine = make_engine("mtp", compile_mode)
    good = served_tensors(engine)
    engine.update_weights(poisoned(good), WeightSelector.ALL, version=1)
    token = st.integers(0, 255)
    prompt = st.lists(token, min_size=1, max_size=24)
    poisoned_prompt = st.tuples(prompt, st.integers(0, 23)).map(lambda t: [*t[0][: t[1]], POISON, *t[0][t[1] :]])
    before = data.draw(st.lists(st.one_of(prompt, poisoned_prompt), min_size=1, max_size=6), label="poisoned period")
    arrivals = data.draw(st.lists(st.integers(0, 3), min_size=len(before), max_size=len(before)), label="steps apart")
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=len(before), max_size=len(before)), label="new tokens")
    for i, (p, wait, n) in enumerate(zip(before, arrivals, lengths, strict=True)):
        engine.submit(
            GenerationRequest(
                prompts=[p],
                sampling=SamplingParams(temperature=0.0, max_new_tokens=n),
                speculation_k=k,
                request_id=f"before-{i}",
            )
        )
        for _ in range(wait):
            engine.step()
    while engine.has_work():
        engine.step()

    engine.update_weights(good, WeightSelector.ALL, version=2)
    after = data.draw(st.lists(prompt, min_size=1, max_size=6), label="after the restore")
    samples = generate(engine, after, k, new=16)
    reference = issue_model()
    for p, s in zip(after, samples, strict=True):
        assert s.token_ids == oracle_greedy(reference, p, 16)
        assert all(math.isfinite(x) for x in s.logprobs)
