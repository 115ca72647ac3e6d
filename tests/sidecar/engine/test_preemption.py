"""Preemption in the paged KV cache (issue 48): rows whose blocks run out mid-generation are
preempted, requeued and resumed by recomputing their prefix, and nothing they return changes.

Oracle: each request run alone on a fresh engine with a pool that never runs out (every sequence
owns its random stream keyed by output position, so neither batching nor a preemption may change
a token). Hypothesis draws the traffic of `test_continuous_batching` (arrivals, lengths, samples,
k, aborts) and a pool as small as one longest row allows, in blocks of 1 to 16 tokens; a fixed
plan checks that preemption really happens and that the metrics count it.

Which rows run, wait or are preempted is `sidecar/engine/row_scheduler.py`'s decision.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.kv_pages import RESERVED_BLOCKS, blocks_for
from sidecar.model.model import Qwen3WithMTP
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar.engine.test_continuous_batching import (
    CONTEXT,
    MAX_K,
    Planned,
    check_against_alone,
    greedy_model,
    run_plan,
    sampled_model,
    traffic,
)


@functools.cache
def token_bytes(model_name: str) -> int:
    model = greedy_model() if model_name == "greedy" else sampled_model()
    return TorchEngine(model, max_batch_size=1, max_speculation_k=MAX_K).drafter.token_bytes()


def small_pool(model: Qwen3WithMTP, model_name: str, default_k: int, batch: int, block: int, spare: int) -> TorchEngine:
    """An engine whose pool holds one longest row (context + a round's writes) and `spare` blocks."""
    blocks = blocks_for(CONTEXT + MAX_K + 2, block) + spare + RESERVED_BLOCKS
    return TorchEngine(
        model,
        speculation_k=default_k,
        max_speculation_k=MAX_K,
        max_batch_size=batch,
        kv_block_size=block,
        kv_cache_gib=blocks * block * token_bytes(model_name) / 2**30,
    )


POOLS = {
    "batch": st.integers(1, 8),
    "default_k": st.integers(0, MAX_K),
    "block": st.sampled_from([1, 2, 4, 8, 16]),
    "spare": st.integers(0, 24),
}


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan=traffic(vocab=64, sampled=False), **POOLS)
def test_greedy_traffic_in_a_tiny_pool_equals_each_request_alone(
    plan: list[Planned], batch: int, default_k: int, block: int, spare: int
) -> None:
    engine = small_pool(greedy_model(), "greedy", default_k, batch, block, spare)
    check_against_alone("greedy", default_k, plan, run_plan(engine, plan))
    assert engine.kv_usage().blocks_used == 0  # every block came back


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan=traffic(vocab=8, sampled=True), **POOLS)
def test_sampled_traffic_in_a_tiny_pool_equals_each_request_alone(
    plan: list[Planned], batch: int, default_k: int, block: int, spare: int
) -> None:
    engine = small_pool(sampled_model(), "sampled", default_k, batch, block, spare)
    check_against_alone("sampled", default_k, plan, run_plan(engine, plan))
    assert engine.kv_usage().blocks_used == 0


@pytest.mark.parametrize(("temperature", "k"), [(0.0, 3), (1.0, 3), (1.0, 0)])
def test_rows_preempted_mid_generation_resume_with_the_same_tokens(temperature: float, k: int) -> None:
    """Eight samples of two prompts growing to 80 tokens in a pool of about two such rows: rows are
    preempted (the metrics count them) and every sample equals its uninterrupted self."""
    sp = SamplingParams(temperature=temperature, max_new_tokens=64, seed=7)
    plan = [
        Planned(
            request=GenerationRequest(
                prompts=[[t % 8 for t in range(1, 17)], [t % 7 for t in range(20, 30)]],
                sampling=sp,
                samples_per_prompt=4,
                request_id="r0",
                speculation_k=k,
            ),
            arrival=0,
            abort_after=None,
        )
    ]
    engine = small_pool(sampled_model(), "sampled", MAX_K, 8, 4, 20)
    got = run_plan(engine, plan)
    usage = engine.kv_usage()
    assert usage.preemptions > 0
    assert usage.blocks_used == 0
    check_against_alone("sampled", MAX_K, plan, got)


def test_a_round_preempts_only_the_rows_whose_blocks_it_needs() -> None:
    """Three rows of 10-token prompts in blocks of 1 token, a pool of 37: after two plain rounds one
    block is free and the round needs three. Preempting the latest row frees its 12 blocks, which
    is enough: one row is preempted, not two (the count must include the blocks a preempted row
    gives back), and every sample still equals itself alone."""
    model = greedy_model()
    per_block = TorchEngine(model, speculation_k=0, max_speculation_k=0, max_batch_size=1).drafter.token_bytes()
    engine = TorchEngine(
        model,
        speculation_k=0,
        max_speculation_k=0,
        max_batch_size=3,
        kv_block_size=1,
        kv_cache_gib=(37 + RESERVED_BLOCKS) * per_block / 2**30,
    )
    plan = [
        Planned(
            request=GenerationRequest(
                prompts=[[i + 1] * 10], sampling=SamplingParams(temperature=0.0, max_new_tokens=20), request_id=f"r{i}"
            ),
            arrival=0,
            abort_after=None,
        )
        for i in range(3)
    ]
    for p in plan:
        engine.submit(p.request)
    out = []
    while engine.kv_usage().preemptions == 0:
        out += engine.step()
    assert (engine.kv_usage().preemptions, engine.num_running(), engine.num_queued()) == (1, 2, 1)
    while engine.has_work():
        out += engine.step()
    got = {p.request.request_id: [] for p in plan}
    for s in out:
        got[s.request_id].append(s)
    check_against_alone("greedy", 0, plan, got)
