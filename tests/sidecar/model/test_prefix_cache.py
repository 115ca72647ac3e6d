"""The engine's prefix cache (`sidecar.model.prefix_cache`): KV blocks of finished and preempted
rows reused by later requests within one weight version.

Oracles: the same request on an engine without a prefix cache (a full prefill: same greedy
tokens, log-probs within 1e-5 — not bit-identical, since a cached block of generated tokens was
computed by decode rounds and a fresh one by a prefill, which add in another order), and for traffic
with pushes interleaved, a fresh engine serving the weights of the version that generated the
request (a stale block, computed with other weights, would change its log-probs far beyond 1e-5).
Every test also asserts the cache was hit, so none passes by never using it; a negative control
shows the push oracle fails when a push forgets to drop the cache.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict
from sidecar.model.kv_pages import RESERVED_BLOCKS, blocks_for
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.model.prefix_cache import PrefixCache
from sidecar.types import GenerationRequest, Sample, SamplingParams, WeightSelector
from tests.sidecar.engine_fixtures import aligned_draft_model, aligned_eagle3, eagle3_target

MAX_K = 3
CONTEXT = 160
OBSERVATION = [5, 6, 7, 8, 9, 10, 11]  # a tool's output between turns


@functools.cache
def served(kind: str) -> tuple[Qwen3WithMTP, object]:
    if kind == "eagle3":
        target = eagle3_target()
        return target, aligned_eagle3(target)
    return aligned_draft_model(ModelConfig.tiny(max_position_embeddings=CONTEXT), seed=2), None


def engine(kind: str, *, prefix_cache: bool = True, **settings: object) -> TorchEngine:
    target, draft = served(kind)
    return TorchEngine(
        target,
        draft=draft,  # type: ignore[arg-type]
        max_speculation_k=MAX_K,
        kv_block_size=settings.pop("kv_block_size", 4),  # type: ignore[arg-type]
        max_batch_size=settings.pop("max_batch_size", 8),  # type: ignore[arg-type]
        prefix_cache=prefix_cache,
        **settings,  # type: ignore[arg-type]
    )


def ask(
    e: TorchEngine, prompt: list[int], rid: str, k: int, n: int = 12, samples: int = 1, t: float = 0.0
) -> list[Sample]:
    return e.generate(
        GenerationRequest(
            prompts=[prompt],
            sampling=SamplingParams(temperature=t, max_new_tokens=n, seed=7),
            samples_per_prompt=samples,
            speculation_k=k,
            request_id=rid,
        )
    )


def assert_same(got: Sample, want: Sample) -> None:
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
@pytest.mark.parametrize("k", [0, MAX_K])
@pytest.mark.parametrize("block", [1, 4, 16])
def test_a_conversations_turns_served_from_cached_blocks_equal_full_prefills(kind: str, k: int, block: int) -> None:
    """Four turns, each prompt the whole history (prompt, response, tool output): every turn's
    greedy tokens are a full prefill's and its log-probs within 1e-5, and from the second turn
    on the prefill takes the earlier turns' blocks, generated tokens' included."""
    on, off = engine(kind, kv_block_size=block), engine(kind, prefix_cache=False, kv_block_size=block)
    history = list(range(3, 22))
    hits = []
    for turn in range(4):
        before = on.stats()[-1].prefix_cache_hit_tokens
        (got,) = ask(on, history, f"on-{turn}", k)
        (want,) = ask(off, history, f"off-{turn}", k)
        assert_same(got, want)
        hits.append(on.stats()[-1].prefix_cache_hit_tokens - before)
        previous = len(history)
        history = history + got.token_ids + OBSERVATION
        if turn:  # a prior turn's response lies inside this turn's cached prefix
            assert hits[-1] > previous - len(OBSERVATION) - 12 - 2 * block, (turn, hits)
    assert hits[0] == 0 and all(h > 0 for h in hits[1:]), hits
    assert off.stats()[-1].prefix_cache_hit_tokens == 0
    assert on.kv_usage().blocks_used == 0 and on.kv_usage().blocks_cached > 0


def test_a_turn_that_drafts_restores_its_draft_cache_and_keeps_the_full_prefills_acceptance() -> None:
    """Hits restore the draft's KV with the target's: the second turn drafts over its cached
    prefix and accepts as a fully prefilled one does (same counters, per position)."""
    on, off = engine("mtp"), engine("mtp", prefix_cache=False)
    first = list(range(3, 30))
    (a,) = ask(on, first, "a", MAX_K, n=20)
    ask(off, first, "a", MAX_K, n=20)
    second = first + a.token_ids + OBSERVATION
    (got,) = ask(on, second, "b", MAX_K, n=20)
    (want,) = ask(off, second, "b", MAX_K, n=20)
    assert_same(got, want)
    assert got.counters == want.counters
    assert got.counters.accepted_tokens > 0
    assert on.stats()[-1].prefix_cache_hit_tokens >= len(first)


def test_drafting_and_plain_rows_never_share_cached_blocks() -> None:
    """A plain (k = 0) row writes its draft caches' first slots in drafting rounds, so the two
    kinds keep separate entries: a k = 0 turn does not hit a drafting turn's blocks."""
    e = engine("mtp")
    prompt = list(range(3, 40))
    ask(e, prompt, "drafting", MAX_K)
    before = e.stats()[-1].prefix_cache_hit_tokens
    ask(e, [*prompt, 4], "plain", 0)
    assert e.stats()[-1].prefix_cache_hit_tokens == before
    ask(e, [*prompt, 4, 4], "drafting-again", MAX_K)
    assert e.stats()[-1].prefix_cache_hit_tokens > before


def test_a_request_that_may_not_use_the_cache_prefills_everything() -> None:
    """The `use_prefix_cache` hook (a request that needs its whole prompt's forward, e.g. its
    routes): such a sequence takes no cached block."""
    e = engine("mtp")
    prompt = list(range(3, 40))
    ask(e, prompt, "first", 0)
    e.submit(
        GenerationRequest(
            prompts=[[*prompt, 4]],
            sampling=SamplingParams(temperature=0.0, max_new_tokens=4),
            speculation_k=0,
            request_id="whole",
        )
    )
    for s in e.scheduler.queue:
        s.use_prefix_cache = False
    before = e.stats()[-1].prefix_cache_hit_tokens
    while e.has_work():
        e.step()
    assert e.stats()[-1].prefix_cache_hit_tokens == before


def test_idle_cached_blocks_are_free_for_admission_and_evicted_least_recently_used_first() -> None:
    """A pool that holds one row: the cache fills it with idle blocks, admission still takes the
    next request (the idle blocks count as free), evicting the oldest; what a hit finds then is
    still exact."""
    block = 4
    need = blocks_for(80 + MAX_K + 2, block)  # the last turn: 40 + 12 + 7 tokens and its new ones
    token = TorchEngine(served("mtp")[0], max_batch_size=1, max_speculation_k=MAX_K).drafter.token_bytes()
    e = engine(
        "mtp", kv_block_size=block, max_batch_size=1, kv_cache_gib=(need + RESERVED_BLOCKS) * block * token / 2**30
    )
    off = engine("mtp", prefix_cache=False, kv_block_size=block)
    assert e.scheduler.pages.usable == need
    for i in range(4):
        prompt = [3 + i] * 20 + list(range(10, 30))
        (got,) = ask(e, prompt, f"r{i}", 0)
        (want,) = ask(off, prompt, f"r{i}", 0)
        assert_same(got, want)
        usage = e.kv_usage()
        assert usage.blocks_used == 0 and e.scheduler.pages.free == need
    assert e.kv_usage().prefix_cache_evictions > 0
    # the latest request's blocks are the most recent: a turn after it hits them
    (again,) = ask(e, prompt + got.token_ids + OBSERVATION, "again", 0)
    assert e.stats()[-1].prefix_cache_hit_tokens >= len(prompt)
    assert_same(again, ask(off, prompt + got.token_ids + OBSERVATION, "again", 0)[0])


# ---- traffic with pushes -------------------------------------------------------------------------
VOCAB = 64


@functools.cache
def weights(version_parity: int) -> dict[str, torch.Tensor]:
    """Two random models (attention that matters: stale KV would show) served alternately."""
    return model_state_dict(
        build_model(ModelConfig.tiny(vocab_size=VOCAB, max_position_embeddings=CONTEXT), seed=40 + version_parity)
    )


def pushed_engine(prefix_cache: bool = True, **settings: object) -> TorchEngine:
    model = build_model(ModelConfig.tiny(vocab_size=VOCAB, max_position_embeddings=CONTEXT), seed=40)
    return TorchEngine(model, max_speculation_k=MAX_K, prefix_cache=prefix_cache, **settings)  # type: ignore[arg-type]


@functools.cache
def oracle(parity: int, prompt: tuple[int, ...], k: int, n: int) -> Sample:
    e = pushed_engine(prefix_cache=False)
    e.update_weights({name: t.clone() for name, t in weights(parity).items()}, WeightSelector.ALL, version=1)
    (s,) = ask(e, list(prompt), "oracle", k, n=n)
    return s


@st.composite
def conversations(draw: st.DrawFn) -> list[tuple[str, int, int, int]]:
    """Events: ("turn", conversation, k, max_new) submits a conversation's next turn;
    ("push", 0, 0, 0) pushes the other weights; ("step", ...) steps the engine."""
    events = []
    for _ in range(draw(st.integers(4, 14))):
        kind = draw(st.sampled_from(["turn", "turn", "push", "step", "step"]))
        events.append((kind, draw(st.integers(0, 2)), draw(st.sampled_from([0, MAX_K])), draw(st.integers(1, 8))))
    return events


def drive(e: TorchEngine, events: list[tuple[str, int, int, int]], seed: int) -> list[tuple[Sample, list[int]]]:
    """Run the events; the samples with their prompts. A conversation's next turn starts from its
    latest finished turn (history + response + tool output)."""
    gen = torch.Generator().manual_seed(seed)
    history = {
        c: torch.randint(0, VOCAB, (int(torch.randint(1, 24, (1,), generator=gen)),), generator=gen).tolist()
        for c in range(3)
    }
    prompts: dict[str, list[int]] = {}
    busy: set[int] = set()
    done: list[tuple[Sample, list[int]]] = []
    version = 0

    def collect(samples: list[Sample]) -> None:
        for s in samples:
            c = int(s.request_id.split("-")[0])
            busy.discard(c)
            history[c] = prompts[s.request_id] + s.token_ids + OBSERVATION[: 1 + c]
            done.append((s, prompts[s.request_id]))

    for i, (kind, c, k, n) in enumerate(events):
        if kind == "turn" and c not in busy and len(history[c]) + n + MAX_K + 2 < CONTEXT:
            rid = f"{c}-{i}"
            prompts[rid] = list(history[c])
            busy.add(c)
            e.submit(
                GenerationRequest(
                    prompts=[prompts[rid]],
                    sampling=SamplingParams(temperature=0.0, max_new_tokens=n),
                    speculation_k=k,
                    request_id=rid,
                )
            )
        elif kind == "push":
            version += 1
            e.update_weights({name: t.clone() for name, t in weights(version % 2).items()}, WeightSelector.ALL, version)
        else:
            collect(e.step())
    while e.has_work():
        collect(e.step())
    return done


def check_against_versions(done: list[tuple[Sample, list[int]]], k_of: dict[str, int]) -> int:
    """Every sample generated wholly within one version equals that version's fresh engine; the
    number compared."""
    compared = 0
    for s, prompt in done:
        if s.weight_version != s.last_weight_version:
            continue  # a push landed mid-generation: its tokens mix versions (no single oracle)
        want = oracle(s.weight_version % 2, tuple(prompt), k_of[s.request_id], len(s.token_ids))
        assert s.token_ids == want.token_ids[: len(s.token_ids)], s.request_id
        torch.testing.assert_close(
            torch.tensor(s.logprobs), torch.tensor(want.logprobs[: len(s.logprobs)]), atol=1e-5, rtol=0
        )
        compared += 1
    return compared


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=conversations(),
    seed=st.integers(0, 2**16),
    block=st.sampled_from([1, 2, 4]),
    batch=st.integers(1, 4),
    spare=st.integers(0, 12),
)
def test_traffic_with_pushes_never_reads_another_versions_kv_and_blocks_come_back(
    events: list[tuple[str, int, int, int]], seed: int, block: int, batch: int, spare: int
) -> None:
    """Multi-turn traffic, pushes of other weights interleaved, a pool small enough to evict and
    preempt: each sample generated within one version equals a fresh engine of those weights;
    every hit's blocks hold KV of the version serving; idle, the pool's blocks are all free, and
    once the cache is dropped no block is held or cached."""
    token = pushed_engine(max_batch_size=1).drafter.token_bytes()
    blocks = blocks_for(CONTEXT + MAX_K + 2, block) + spare + RESERVED_BLOCKS
    e = pushed_engine(
        max_batch_size=batch, kv_block_size=block, kv_cache_gib=blocks * block * token / 2**30, speculation_k=MAX_K
    )
    cache = e.prefix_cache
    assert isinstance(cache, PrefixCache)
    hit_versions: list[tuple[int, int]] = []
    lookup = e.scheduler.prefix_hits

    def checked(new: list, version: int) -> list[list[int]]:  # every hit's blocks: the serving weights' KV
        hits = lookup(new, version)
        hit_versions.extend((cache.version_of(b), e.weights.version) for h in hits for b in h)
        return hits

    e.scheduler.prefix_hits = checked  # type: ignore[method-assign]
    k_of = {f"{c}-{i}": k for i, (_, c, k, _) in enumerate(events)}
    done = drive(e, events, seed)
    check_against_versions(done, k_of)
    assert all(a == b for a, b in hit_versions)
    pages = e.scheduler.pages
    assert not e.scheduler.running and pages.free == pages.usable
    pages.drop_cache()
    assert cache.cached == 0 and cache.idle == 0 and not any(pages.refs) and len(pages._free) == pages.usable


def test_the_push_oracle_catches_a_push_that_keeps_the_cache() -> None:
    """Negative control: with a push that keeps the cache and lookups that ignore the version, a
    turn after the push reads KV of the old weights, and the oracle of its version sees it; with
    keys that ignore the version, the lookup's own guard refuses the block."""
    turn = [("turn", 0, 0, 8)] + [("step", 0, 0, 0)] * 12  # a turn, run to its end
    events = turn * 2 + [("push", 0, 0, 0), ("turn", 0, 0, 8)]
    k_of = {f"{c}-{i}": k for i, (_, c, k, _) in enumerate(events)}
    good = pushed_engine()
    assert check_against_versions(drive(good, events, seed=3), k_of) == 3  # every turn within one version
    assert good.stats()[-1].weight_version == 1

    broken = pushed_engine()  # a push that keeps the cache, and lookups that ignore the version
    broken.scheduler.pages.drop_cache = lambda: None  # type: ignore[method-assign]
    cache = broken.prefix_cache
    assert cache is not None
    real_lookup = cache.lookup
    cache.lookup = lambda version, drafting, prefix: real_lookup(0, drafting, prefix)  # type: ignore[method-assign]
    with pytest.raises(AssertionError):
        check_against_versions(drive(broken, events, seed=3), k_of)

    guarded = pushed_engine()  # keys without the version: the lookup's guard refuses the stale block
    guarded.scheduler.pages.drop_cache = lambda: None  # type: ignore[method-assign]
    cache = guarded.prefix_cache
    assert cache is not None
    real_keys = cache.keys
    cache.keys = lambda version, drafting, tokens, n: real_keys(0, drafting, tokens, n)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="holds version 0 KV, 1 serves"):
        drive(guarded, events, seed=3)


def test_preempted_rows_resume_from_their_cached_blocks_and_stay_exact() -> None:
    """A pool too small for a conversation turn's G samples: rows are preempted, their blocks
    cached, and they resume from them (and from the earlier turn's); every sample is the one an
    engine with a large pool and no cache gives."""
    block = 2
    token = TorchEngine(served("mtp")[0], max_batch_size=1, max_speculation_k=MAX_K).drafter.token_bytes()
    blocks = blocks_for(70 + MAX_K + 2, block) + 6 + RESERVED_BLOCKS
    tight = engine("mtp", kv_block_size=block, max_batch_size=4, kv_cache_gib=blocks * block * token / 2**30)
    roomy = engine("mtp", prefix_cache=False, kv_block_size=block)
    first = list(range(3, 30))
    (a,) = ask(tight, first, "t1", MAX_K, n=12)
    assert_same(a, ask(roomy, first, "t1", MAX_K, n=12)[0])
    second = first + a.token_ids + OBSERVATION
    got = ask(tight, second, "t2", MAX_K, n=20, samples=4, t=1.0)
    want = ask(roomy, second, "t2", MAX_K, n=20, samples=4, t=1.0)
    for g, w in zip(sorted(got, key=lambda s: s.sample_index), sorted(want, key=lambda s: s.sample_index), strict=True):
        assert_same(g, w)
    assert tight.kv_usage().preemptions > 0
    assert tight.stats()[-1].prefix_cache_hit_tokens > len(first)


@pytest.mark.parametrize("k", [0, MAX_K])
def test_a_turn_that_ends_at_its_first_token_leaves_its_blocks_for_the_next(k: int) -> None:
    """A one-token turn never joins the batch, yet its prefix's blocks are cached (one row per
    prefix joins and leaves at once): the next turn hits them and equals a full prefill."""
    on, off = engine("mtp"), engine("mtp", prefix_cache=False)
    first = list(range(3, 40))
    (a,) = ask(on, first, "a", k, n=1)
    assert on.kv_usage().blocks_cached > 0 and on.kv_usage().blocks_used == 0
    second = first + a.token_ids + OBSERVATION
    (got,) = ask(on, second, "b", k)
    assert on.stats()[-1].prefix_cache_hit_tokens >= len(first) - 4
    assert_same(got, ask(off, second, "b", k)[0])
    pages = on.scheduler.pages
    assert pages.free == pages.usable


def test_a_request_for_its_prompts_routes_prefills_its_whole_prompt() -> None:
    """An MoE turn asking for its prompt's routes (`GenerationRequest.routes = "sequence"`) takes
    no cached block, whose KV carries no routes: its routes cover every prompt position and equal
    those of an engine without a cache; the same turn without routes does hit the cache."""
    from tests.sidecar.model.test_moe_models import moe_target

    model = moe_target(num_nextn_predict_layers=1, eps=0.3)
    on = TorchEngine(model, speculation_k=2, kv_block_size=4)
    off = TorchEngine(model, speculation_k=2, kv_block_size=4, prefix_cache=False)
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    first = list(range(3, 30))
    (a,) = on.generate(GenerationRequest(prompts=[first], sampling=sp, speculation_k=2))
    second = first + a.token_ids + OBSERVATION
    (got,) = on.generate(GenerationRequest(prompts=[second], sampling=sp, speculation_k=2, routes="sequence"))
    assert on.stats()[-1].prefix_cache_hit_tokens == 0
    (want,) = off.generate(GenerationRequest(prompts=[second], sampling=sp, speculation_k=2, routes="sequence"))
    assert got.routes is not None and want.routes is not None
    assert got.routes.first_position == 0 and torch.equal(got.routes.expert_ids, want.routes.expert_ids)
    on.generate(GenerationRequest(prompts=[[*second, 4]], sampling=sp, speculation_k=2))
    assert on.stats()[-1].prefix_cache_hit_tokens > len(first)
