"""Continuous batching under random traffic (issue 14, finding 1).

Hypothesis draws a traffic plan — per request: the engine step it arrives at, 1–2 prompts of
length 1 … the context limit, samples per prompt, its own speculation k (None = the engine's
default, 0 = plain decoding, up to the maximum), an optional abort some steps later — plus
the engine's batch size (small sizes make requests queue) and default k. One engine runs the
whole plan, step by step, so overlapping requests of different lengths join and leave the
running batch while it speculates.

Oracle: the same request run alone on a fresh engine (each sequence owns its random stream, so
batching must change nothing, greedy or sampled). Every request not aborted finishes with all
its samples equal to the alone run; an aborted one returns every sample, finished ones equal
to the alone run and ABORT ones a prefix of it. The sampled variant additionally pools its
probe requests' samples and checks them against the exact target distribution with the
chi-square harness of `test_speculative_distribution`.

Budget: a plan is a few requests of tiny models; the example counts are chosen so that the
crash of issue 14 (a longer prompt admitted next to speculating rows) is hit by the first
examples (checked by reverting the fix), while the file runs in well under a minute on a
2-core CPU. `derandomize=True` keeps CI deterministic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.model import ModelConfig, Qwen3WithMTP
from sidecar.types import FinishReason, GenerationRequest, Sample, SamplingParams
from tests.sidecar.engine.test_speculative_distribution import ALPHA, PROMPT, chi_square_pvalue, exact_joint
from tests.sidecar.engine_fixtures import aligned_draft_model

CONTEXT = 96  # max_position_embeddings of the test models: prompts span 1 … CONTEXT - max_new_tokens
MAX_K = 4  # the engines' max_speculation_k


@functools.cache
def greedy_model() -> Qwen3WithMTP:
    return aligned_draft_model(ModelConfig.tiny(max_position_embeddings=CONTEXT), seed=2)


@functools.cache
def sampled_model() -> Qwen3WithMTP:
    """V = 8 so that the chi-square test can enumerate the exact joint of three tokens."""
    return aligned_draft_model(ModelConfig.tiny(vocab_size=8, max_position_embeddings=CONTEXT), seed=11, eps=0.1)


@dataclass(frozen=True)
class Planned:
    request: GenerationRequest
    arrival: int
    """Engine step before which it is submitted."""
    abort_after: int | None
    """Steps after arrival at which it is aborted (None: never)."""


def request_key(r: GenerationRequest) -> tuple:
    sp = r.sampling
    return (
        tuple(tuple(p) for p in r.prompts),
        r.samples_per_prompt,
        r.speculation_k,
        (sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens, sp.seed),
    )


@functools.cache
def alone(model_name: str, default_k: int, key: tuple) -> list[Sample]:
    """The oracle: the request on a fresh engine with nothing else running."""
    prompts, samples, k, (temperature, top_p, top_k, max_new, seed) = key
    model = greedy_model() if model_name == "greedy" else sampled_model()
    engine = TorchEngine(model, speculation_k=default_k, max_speculation_k=MAX_K)
    sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new, seed=seed)
    req = GenerationRequest(
        prompts=[list(p) for p in prompts], sampling=sp, samples_per_prompt=samples, speculation_k=k
    )
    return engine.generate(req)


@st.composite
def planned_request(draw: st.DrawFn, index: int, vocab: int, sampled: bool) -> Planned:
    max_new = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(1, CONTEXT - max_new), min_size=1, max_size=2))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    if sampled:
        sp = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
            top_p=draw(st.sampled_from([1.0, 0.9])),
            top_k=draw(st.sampled_from([0, 5])),
            max_new_tokens=max_new,
            seed=index,
        )
    else:
        sp = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    return Planned(
        request=GenerationRequest(
            prompts=prompts,
            sampling=sp,
            samples_per_prompt=draw(st.integers(1, 3)),
            request_id=f"r{index}",
            speculation_k=draw(st.none() | st.integers(0, MAX_K)),
        ),
        arrival=draw(st.integers(0, 10)),
        abort_after=draw(st.none() | st.none() | st.integers(0, 8)),
    )


@st.composite
def traffic(draw: st.DrawFn, vocab: int, sampled: bool) -> list[Planned]:
    n = draw(st.integers(2, 6))
    return [draw(planned_request(i, vocab, sampled)) for i in range(n)]


def run_plan(engine: TorchEngine, plan: list[Planned]) -> dict[str, list[Sample]]:
    """Submit and abort on schedule, step until idle; every request's returned samples."""
    out: dict[str, list[Sample]] = {p.request.request_id: [] for p in plan}
    last = max(p.arrival + (p.abort_after or 0) for p in plan)
    for step in range(10_000):
        for p in plan:
            if p.arrival == step:
                engine.submit(p.request)
            if p.abort_after is not None and p.arrival + p.abort_after == step:
                out[p.request.request_id] += engine.abort(p.request.request_id)
        for s in engine.step():
            out[s.request_id].append(s)
        if step >= last and not engine.has_work():
            return out
    raise AssertionError("the engine did not drain within 10000 steps")


def check_against_alone(model_name: str, default_k: int, plan: list[Planned], got: dict[str, list[Sample]]) -> None:
    for p in plan:
        r = p.request
        oracle = {(s.prompt_index, s.sample_index): s for s in alone(model_name, default_k, request_key(r))}
        samples = got[r.request_id]
        assert sorted((s.prompt_index, s.sample_index) for s in samples) == sorted(oracle), r.request_id
        for s in samples:
            want = oracle[(s.prompt_index, s.sample_index)]
            if s.finish_reason is FinishReason.ABORT:
                assert p.abort_after is not None, f"{r.request_id} was aborted but nobody aborted it"
                assert s.token_ids == want.token_ids[: len(s.token_ids)], r.request_id
            else:
                assert (s.token_ids, s.finish_reason) == (want.token_ids, want.finish_reason), r.request_id
            torch.testing.assert_close(
                torch.tensor(s.logprobs), torch.tensor(want.logprobs[: len(s.logprobs)]), atol=1e-4, rtol=0
            )


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=traffic(vocab=64, sampled=False),
    batch=st.integers(1, 8),
    default_k=st.integers(0, MAX_K),
)
def test_greedy_traffic_completes_and_equals_each_request_alone(plan: list[Planned], batch: int, default_k: int):
    engine = TorchEngine(greedy_model(), speculation_k=default_k, max_speculation_k=MAX_K, max_batch_size=batch)
    check_against_alone("greedy", default_k, plan, run_plan(engine, plan))


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=traffic(vocab=8, sampled=True),
    batch=st.integers(1, 8),
    default_k=st.integers(0, MAX_K),
)
def test_sampled_traffic_completes_and_equals_each_request_alone(plan: list[Planned], batch: int, default_k: int):
    engine = TorchEngine(sampled_model(), speculation_k=default_k, max_speculation_k=MAX_K, max_batch_size=batch)
    check_against_alone("sampled", default_k, plan, run_plan(engine, plan))


PROBE = SamplingParams(temperature=1.0, max_new_tokens=3)
PROBE_SAMPLES = 1500


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    background=traffic(vocab=8, sampled=True),
    probes=st.lists(st.tuples(st.integers(0, 10), st.none() | st.integers(0, MAX_K)), min_size=3, max_size=5),
)
def test_sampled_traffic_stays_lossless_by_chi_square(background: list[Planned], probes: list[tuple[int, int | None]]):
    """Probe requests of PROMPT (temperature 1, 3 tokens) with different k, arriving at different
    steps amid background traffic: their pooled samples follow the exact target distribution."""
    per_probe = PROBE_SAMPLES // len(probes)
    plan = background + [
        Planned(
            request=GenerationRequest(
                prompts=[PROMPT],
                sampling=SamplingParams(temperature=1.0, max_new_tokens=3, seed=1000 + i),
                samples_per_prompt=per_probe,
                request_id=f"probe{i}",
                speculation_k=k,
            ),
            arrival=arrival,
            abort_after=None,
        )
        for i, (arrival, k) in enumerate(probes)
    ]
    engine = TorchEngine(sampled_model(), speculation_k=MAX_K, max_speculation_k=MAX_K, max_batch_size=2048)
    got = run_plan(engine, plan)
    v = sampled_model().config.vocab_size
    samples = [s for i in range(len(probes)) for s in got[f"probe{i}"]]
    assert len(samples) == per_probe * len(probes)
    assert all(s.finish_reason is FinishReason.LENGTH for s in samples)
    cells = torch.tensor([(s.token_ids[0] * v + s.token_ids[1]) * v + s.token_ids[2] for s in samples])
    counts = torch.bincount(cells, minlength=v**3).double()
    assert chi_square_pvalue(counts, exact_joint(sampled_model(), PROBE)) > ALPHA
