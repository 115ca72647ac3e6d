"""One prefill per distinct prompt: the sequences admitted together that share a prompt (the G
samples of a GRPO prompt, or equal prompts of different requests) share its target prefill, its KV
and its draft prefill (`TorchEngine._admit`, issue 48).

Oracle: every sequence prefilled alone — the same request on a fresh engine of one row
(`max_batch_size=1`), where each admission takes one sequence and runs it to its end. A sequence's
tokens do not depend on its batch on a CPU (`test_engine.test_batched_results_equal_unbatched`;
log-probs to 1e-5, the forwards' float rounding at another batch size), so sharing must change
nothing: tokens and finish reasons identical, log-probs within 1e-5, greedy and sampled, k = 0
and 3, MTP and EAGLE-3, both compile modes. The stats say how much was shared:
`prompt_tokens` counts every sequence's prompt, `prefill_tokens` what the prefill computed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.eagle3 import Eagle3Draft
from sidecar.model.kv_cache import KVCache
from sidecar.model.model import ModelConfig, Qwen3WithMTP
from sidecar.types import GenerationRequest, Sample, SamplingParams
from tests.sidecar.engine_fixtures import aligned_draft_model, aligned_eagle3, eagle3_target

CONTEXT = 64
MAX_K = 3
VOCAB = 64


STATE_WEIGHT = 0.5
"""How much the drafts below read the target's states (the aligned fixtures read none): a sequence
given another prompt's prefill states then drafts other tokens, which changes its acceptance
counters and, at temperature 1, its tokens."""


@functools.cache
def model(kind: str) -> tuple[Qwen3WithMTP, Eagle3Draft | None]:
    """(target, EAGLE-3 draft or None): "mtp" a near-bigram target with an aligned MTP layer,
    "eagle3" a target without MTP layers and an aligned EAGLE-3 draft (acceptance high, not 1),
    each draft also reading the target's states through a random matrix."""
    gen = torch.Generator().manual_seed(9)
    if kind == "mtp":
        target = aligned_draft_model(ModelConfig.tiny(max_position_embeddings=CONTEXT), seed=2, eps=0.05)
        (mtp,) = target.mtp.layers
        h = target.config.hidden_size
        with torch.no_grad():
            mtp.eh_proj.weight[:, h:] = STATE_WEIGHT * torch.randn(h, h, generator=gen) / h**0.5
        return target, None
    target = eagle3_target(eps=0.05)
    draft = aligned_eagle3(target)
    with torch.no_grad():
        fc = draft.fc.weight
        fc.copy_(STATE_WEIGHT * torch.randn(fc.shape, generator=gen) / fc.shape[1] ** 0.5)
    return target, draft


def engine(kind: str, compile: str, default_k: int = MAX_K, max_batch_size: int = 64) -> TorchEngine:
    target, draft = model(kind)
    return TorchEngine(
        target,
        draft=draft,
        speculation_k=default_k,
        max_speculation_k=MAX_K,
        max_batch_size=max_batch_size,
        compile=compile,
    )


def key(s: Sample) -> tuple[str, int, int]:
    return (s.request_id, s.prompt_index, s.sample_index)


@functools.cache
def _alone(kind: str, compile: str, default_k: int, request: tuple) -> dict[tuple[int, int], Sample]:
    prompts, samples, k, (temperature, max_new, seed), rid = request
    req = GenerationRequest(
        prompts=[list(p) for p in prompts],
        sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=seed),
        samples_per_prompt=samples,
        speculation_k=k,
        request_id=rid,
    )
    out = engine(kind, compile, default_k, max_batch_size=1).generate(req)
    return {(s.prompt_index, s.sample_index): s for s in out}


def alone(kind: str, compile: str, default_k: int, r: GenerationRequest) -> dict[tuple[int, int], Sample]:
    """The oracle: every sequence of `r` prefilled (and decoded) alone."""
    sp = r.sampling
    request = (
        tuple(tuple(p) for p in r.prompts),
        r.samples_per_prompt,
        r.speculation_k,
        (sp.temperature, sp.max_new_tokens, sp.seed),
        r.request_id,
    )
    return _alone(kind, compile, default_k, request)


def assert_equal(got: Sample, want: Sample) -> None:
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), key(got)
    assert got.counters == want.counters, key(got)  # the draft read its own prompt's states
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


@settings(max_examples=16, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["mtp", "eagle3"]),
    k=st.sampled_from([0, MAX_K]),
    temperature=st.sampled_from([0.0, 1.0]),
    compile=st.sampled_from(["off", "on"]),
    group=st.integers(1, 8),
    length=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_a_grpo_group_is_prefilled_once_and_equals_its_samples_prefilled_alone(
    kind: str, k: int, temperature: float, compile: str, group: int, length: int, seed: int
) -> None:
    prompt = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    req = GenerationRequest(
        prompts=[prompt],
        sampling=SamplingParams(temperature=temperature, max_new_tokens=12, seed=seed),
        samples_per_prompt=group,
        speculation_k=k,
        request_id="grpo",
    )
    e = engine(kind, compile)
    got = e.generate(req)
    oracle = alone(kind, compile, MAX_K, req)
    assert sorted((s.prompt_index, s.sample_index) for s in got) == sorted(oracle)
    for s in got:
        assert_equal(s, oracle[(s.prompt_index, s.sample_index)])
    (stats,) = e.stats()
    assert (stats.prompt_tokens, stats.prefill_tokens) == (group * length, length)
    if temperature and group > 1:  # the samples are the group's, not copies of one
        assert len({tuple(s.token_ids) for s in got}) > 1


@dataclass(frozen=True)
class Arrival:
    request: GenerationRequest
    step: int
    """Engine step before which it is submitted."""


@st.composite
def traffic(draw: st.DrawFn) -> list[Arrival]:
    """Requests over a small pool of prompts (so equal prompts of different requests meet), each
    with its own G, k (None: the engine's default; 0 next to drafting rows of the same prompt),
    temperature and arrival (rows joining a running batch)."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    pool = [
        torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        for n in draw(st.lists(st.integers(1, 30), min_size=1, max_size=3))
    ]
    out = []
    for i in range(draw(st.integers(2, 5))):
        prompts = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2))
        sp = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 1.0])), max_new_tokens=draw(st.integers(1, 10)), seed=i
        )
        req = GenerationRequest(
            prompts=prompts,
            sampling=sp,
            samples_per_prompt=draw(st.integers(1, 4)),
            speculation_k=draw(st.sampled_from([None, 0, MAX_K])),
            request_id=f"r{i}",
        )
        out.append(Arrival(req, draw(st.integers(0, 3))))
    return out


def run(e: TorchEngine, plan: list[Arrival]) -> tuple[list[Sample], list[int]]:
    """Submit on schedule and step until idle: the samples, and the prefill tokens the rows
    admitted in each step would need if each distinct prompt of the step is prefilled once."""
    samples: list[Sample] = []
    expected: list[int] = []
    for step in range(1000):
        for a in plan:
            if a.step == step:
                e.submit(a.request)
        queued = list(e.scheduler.queue)
        samples += e.step()
        admitted = queued[: len(queued) - e.num_queued()]  # admission takes the queue's head
        expected.append(sum(len(p) for p in {tuple(s.prompt) for s in admitted}))
        if step >= max(a.step for a in plan) and not e.has_work():
            return samples, expected
    raise AssertionError("the engine did not drain within 1000 steps")


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=traffic(),
    kind=st.sampled_from(["mtp", "eagle3"]),
    compile=st.sampled_from(["off", "on"]),
    batch=st.integers(2, 16),
)
def test_mixed_traffic_shares_equal_prompts_and_equals_each_sequence_prefilled_alone(
    plan: list[Arrival], kind: str, compile: str, batch: int
) -> None:
    """Several prompts with different G, equal prompts in different requests, drafting (k = 3)
    and non-drafting (k = 0) sequences of one prompt admitted together, rows joining a running
    batch, and a batch small enough that groups split across admissions."""
    e = engine(kind, compile, max_batch_size=batch)
    got, expected = run(e, plan)
    (stats,) = e.stats()
    # each distinct prompt of a step once: computed, or taken from the prefix cache (`prefix_cache`)
    assert stats.prefill_tokens + stats.prefix_cache_hit_tokens == sum(expected)
    assert stats.prompt_tokens == sum(len(p) * a.request.samples_per_prompt for a in plan for p in a.request.prompts)
    by_request = {a.request.request_id: a.request for a in plan}
    assert len(got) == sum(len(r.prompts) * r.samples_per_prompt for r in by_request.values())
    for s in got:
        assert_equal(s, alone(kind, compile, MAX_K, by_request[s.request_id])[(s.prompt_index, s.sample_index)])


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_a_sequence_that_does_not_draft_gets_no_draft_cache_from_a_shared_prompt(kind: str) -> None:
    """A k = 0 sequence admitted with k = 3 sequences of its prompt: the prompt's draft prefill is
    computed (they draft), but the k = 0 row's draft cache row stays empty, as when it is admitted
    alone; the drafting rows' hold the prompt's P - 1 draft positions."""
    prompt = list(range(3, 20))
    e = engine(kind, "off")
    for rid, k in (("plain", 0), ("spec", MAX_K)):
        e.submit(
            GenerationRequest(
                prompts=[prompt],
                sampling=SamplingParams(temperature=0.0, max_new_tokens=8),
                samples_per_prompt=2,
                speculation_k=k,
                request_id=rid,
            )
        )
    e.step()
    draft_cache: KVCache = e.runner.draft_caches[0]
    assert [s.request_id for s in e.scheduler.running] == ["plain", "plain", "spec", "spec"]
    assert draft_cache.lengths == [0, 0, len(prompt) - 1, len(prompt) - 1]
    assert e.runner.cache.lengths == [len(prompt)] * 4
    assert [s.pending is None for s in e.scheduler.running] == [True, True, False, False]


@pytest.mark.parametrize(("k", "shared"), [(0, 6), (MAX_K, 5)])
def test_a_grpo_groups_rows_share_its_prompts_full_kv_blocks(k: int, shared: int) -> None:
    """Eight samples of a 48-token prompt hold its full blocks once: in blocks of 8, all six
    (plain) or the first five (drafting: the draft cache writes position 47, so the sixth block is
    each row's own) — 6 or 13 blocks where unshared rows would take 48. Every block comes back
    when the group ends."""
    target, _ = model("mtp")
    e = TorchEngine(target, speculation_k=MAX_K, max_speculation_k=MAX_K, kv_block_size=8)
    prompt = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
    e.submit(GenerationRequest(prompts=[prompt], sampling=sp, samples_per_prompt=8, speculation_k=k, request_id="g"))
    e.step()  # the admission: one prefill, eight rows
    usage = e.kv_usage()
    assert (usage.blocks_shared, usage.blocks_used) == (shared, shared + 8 * (6 - shared))
    while e.has_work():
        e.step()
    assert e.kv_usage().blocks_used == 0
