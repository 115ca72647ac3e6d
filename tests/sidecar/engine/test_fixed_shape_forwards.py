"""The fixed-shape decode rounds (`compile: on`, what a GPU captures as CUDA graphs) against independent
oracles, run eagerly on the CPU (issue 40).

`round_graphs.FixedRounds` runs a decode round as its two phases at fixed shapes (`decode_round`, `attention_lengths.DeviceLengths`): rows
padded to a batch bucket, each row's KV read over a bucketed width under a mask built on the device
from device row lengths, writes by device index. A GPU captures each phase once per shape and
replays it; here the same code runs eagerly, so CI checks what the GPU replays. Oracles:

- the bucket functions: the documented bucket sets written out here (1, 2, 4, 8, multiples of 8;
  powers of two from `MIN_READ`), capped at the cache's size — hypothesis draws the sizes;
- `KVCache.plan_fixed`: the dynamic `KVCache.plan` at the batch's own shapes — a model layer's
  attention through both, the cache contents they leave, and the rows the padding may touch;
- greedy generation: the plain full forward decoding one token at a time (`oracle_greedy`), for
  k = 0, 1, 3, random and aligned MTP drafts and EAGLE-3 drafts, batched and each prompt alone;
- sampling: the exact joint distribution of three tokens by enumeration, through the chi-square
  harness of `test_speculative_distribution`, with each wrong acceptance rule rejected (power);
- continuous batching: each request of a hypothesis traffic plan run alone on the eager engine;
- weight pushes (copying and adopting): the plain greedy decoding of the pushed weights;
- tracing: each phase traced by dynamo with `fullgraph=True` (no graph break) and searched for host
  reads runs in place of the untraced one and generation equals it; one graph per graph key, none
  recompiled when only lengths, tokens or weights change — what CUDA-graph capture needs;
- the `compile` switch: `ServeConfig` validation and `specrl serve --compile` reaching the engine.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import click
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.engine.attention_lengths import FixedShape
from sidecar.engine.decode_round import EagerRounds
from sidecar.engine.round_graphs import MIN_READ, FixedRounds, batch_bucket, read_bucket
from sidecar.engine.torch_engine import TorchEngine
from sidecar.losslessness.wrong_rules import WRONG_RULES
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.eagle3 import Eagle3Config
from sidecar.model.eagle3 import build_eagle3 as build_eagle3_draft
from sidecar.model.kv_cache import AttentionPlan, KVCache
from sidecar.model.kv_pages import SCRATCH_BLOCK
from sidecar.model.model import DecoderLayer, ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, Sample, SamplingParams, WeightSelector
from tests.sidecar.engine.test_continuous_batching import MAX_K, check_against_alone, greedy_model, run_plan, traffic
from tests.sidecar.engine.test_speculative_distribution import (
    ALPHA,
    SETTINGS,
    V,
    chi_square_pvalue,
    engine_counts,
    exact_joint,
)
from tests.sidecar.engine.test_static_engine import oracle_greedy
from tests.sidecar.engine_fixtures import TAPS, aligned_draft_model, aligned_eagle3, eagle3_target
from tests.sidecar.model.test_eagle3 import run as run_alone_in_one_batch
from tests.sidecar.paged_fixtures import paged_cache, row_slots

pytestmark = pytest.mark.usefixtures("single_torch_thread")  # tiny models: intra-op threads only spin

# ---- 1. bucket functions ------------------------------------------------------------------------


def documented_batch_bucket(rows: int, max_batch_size: int) -> int:
    """The smallest of 1, 2, 4, 8, 16, 24, ... that holds `rows`, capped at max_batch_size."""
    buckets = [1, 2, 4, 8, *range(16, rows + 16, 8)]
    return min(min(b for b in buckets if b >= rows), max_batch_size)


def documented_read_bucket(needed: int, capacity: int) -> int:
    """The smallest power of two >= MIN_READ that holds `needed`, capped at the capacity."""
    p = MIN_READ
    while p < needed:
        p *= 2
    return min(p, capacity)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data(), max_batch_size=st.integers(1, 600))
def test_batch_bucket_is_the_documented_bucket(data: st.DataObject, max_batch_size: int) -> None:
    rows = data.draw(st.integers(1, max_batch_size))
    b = batch_bucket(rows, max_batch_size)
    assert b == documented_batch_bucket(rows, max_batch_size)
    assert rows <= b <= max_batch_size  # covers the rows, never more than the cache holds
    assert b == max_batch_size or b in (1, 2, 4, 8) or b % 8 == 0
    if rows < max_batch_size:
        assert batch_bucket(rows + 1, max_batch_size) >= b  # monotone


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data(), capacity=st.integers(1, 10_000))
def test_read_bucket_is_the_documented_bucket(data: st.DataObject, capacity: int) -> None:
    needed = data.draw(st.integers(1, capacity))
    r = read_bucket(needed, capacity)
    assert r == documented_read_bucket(needed, capacity)
    assert needed <= r <= capacity  # covers what the forward reads, never more than the cache has
    assert r == capacity or (r >= MIN_READ and r & (r - 1) == 0)
    if needed < capacity:
        assert read_bucket(needed + 1, capacity) >= r  # monotone


def test_bucket_sets_are_few() -> None:
    """Few distinct shapes → few graphs to capture (what the buckets are for)."""
    assert sorted({batch_bucket(r, 64) for r in range(1, 65)}) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert sorted({read_bucket(n, 4106) for n in range(1, 4107)}) == [256, 512, 1024, 2048, 4096, 4106]


# ---- 2. plan_fixed against plan -----------------------------------------------------------------


@functools.cache
def layer_model() -> Qwen3WithMTP:
    return build_model(ModelConfig.tiny(num_hidden_layers=1, num_nextn_predict_layers=0), seed=41)


def static_cache(
    model: Qwen3WithMTP, max_batch_size: int, capacity: int, lengths: list[int], seed: int, device: str = "cpu"
) -> KVCache:
    """A paged cache of len(lengths) rows (table rows for `max_batch_size`), each holding `capacity`
    slots in scattered blocks, every slot random (stale slots included: masking must hide them)."""
    c = model.config
    return paged_cache(
        num_layers=1,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        dtype=c.dtype,
        lengths=lengths,
        capacity=capacity,
        seed=seed,
        device=device,
        max_batch_size=max_batch_size,
    )


def attend(model: Qwen3WithMTP, x: torch.Tensor, cache: KVCache, plan: AttentionPlan) -> torch.Tensor:
    """Layer 0's cached attention of `x` (B, S, hidden) through `plan`."""
    with torch.no_grad():
        w = model.decode_weights()[0]
        rope = model.rope_table(plan.positions, x.dtype)
        return cast(DecoderLayer, model.model.layers[0]).self_attn.cached(x, w, rope, cache, 0, plan)


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), b=st.integers(1, 6), s=st.integers(1, 4), capacity=st.integers(8, 40))
def test_a_fixed_plan_reads_and_writes_what_the_dynamic_plan_does(
    data: st.DataObject, b: int, s: int, capacity: int
) -> None:
    model = layer_model()
    max_batch_size = data.draw(st.integers(b, 9))
    rows = data.draw(st.integers(b, max_batch_size))  # the padded batch (a bucket, or any wider)
    lengths = data.draw(st.lists(st.integers(0, capacity - s), min_size=b, max_size=b))
    num_new = data.draw(st.lists(st.integers(0, s), min_size=b, max_size=b))
    read = data.draw(st.integers(max(lengths) + s, capacity))  # at least what the rows need
    seed = data.draw(st.integers(0, 2**16))
    dynamic = static_cache(model, max_batch_size, capacity, lengths, seed)
    fixed = static_cache(model, max_batch_size, capacity, lengths, seed)
    before = static_cache(model, max_batch_size, capacity, lengths, seed)
    x = torch.randn(rows, s, model.config.hidden_size, generator=torch.Generator().manual_seed(seed + 1))

    plan = dynamic.plan(num_new, width=s)
    want = attend(model, x[:b], dynamic, plan)
    dynamic.commit(plan)
    padded_lengths = torch.tensor(lengths + [0] * (rows - b))
    got = attend(model, x, fixed, fixed.plan_fixed(padded_lengths, s, read))
    fixed.commit_counts(num_new)

    torch.testing.assert_close(got[:b], want, atol=1e-5, rtol=1e-5)  # the live rows' attention
    assert torch.isfinite(got).all()  # padded rows too (they attend to the scratch block)
    assert fixed.lengths == dynamic.lengths
    others = torch.ones(fixed._k.shape[2], dtype=torch.bool)
    others[SCRATCH_BLOCK] = False  # padded rows write only there
    for mine, theirs in zip((fixed._k, fixed._v), (dynamic._k, dynamic._v), strict=True):
        torch.testing.assert_close(mine[:, :, others], theirs[:, :, others], atol=1e-5, rtol=1e-5)
    for r, n in enumerate(lengths):  # live rows: only the S slots past their length were written
        untouched = torch.ones(capacity, dtype=torch.bool)
        untouched[n : n + s] = False
        for mine, old in zip(row_slots(fixed, r, 0, capacity), row_slots(before, r, 0, capacity), strict=True):
            assert torch.equal(mine[:, :, untouched], old[:, :, untouched])


def test_plan_fixed_refuses_what_does_not_fit() -> None:
    model = layer_model()
    cache = static_cache(model, 4, 32, [3, 5], seed=0)
    with pytest.raises(ValueError, match=r"5 rows reading 32 slots does not fit the paged cache \(4 rows of 32"):
        cache.plan_fixed(torch.zeros(5, dtype=torch.int64), 1, 32)
    with pytest.raises(ValueError, match=r"4 rows reading 33 slots does not fit the paged cache \(4 rows of 32"):
        cache.plan_fixed(torch.zeros(4, dtype=torch.int64), 1, 33)
    with pytest.raises(ValueError, match="does not fit"):
        cache.plan_fixed(torch.zeros(4, dtype=torch.int64), 0, 32)
    growable = KVCache(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu", batch=2)
    with pytest.raises(ValueError, match="needs a paged cache"):
        growable.plan_fixed(torch.zeros(2, dtype=torch.int64), 1, 8)
    with pytest.raises(ValueError, match="num_new has 3 rows, the cache has 2"):
        cache.commit_counts([1, 1, 1])


# ---- 3. greedy against the plain full forward ---------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [3] * 11, [60], [5, 6] * 9, [7, 1, 2] * 83 + [7, 1]]
"""Ragged; the last (251 tokens) reads cross MIN_READ while it decodes (257 slots needed at 256)."""
assert len(PROMPTS[-1]) == MIN_READ - 5
NEW = 12


@functools.cache
def mtp_model(kind: str) -> Qwen3WithMTP:
    return (
        aligned_draft_model(ModelConfig.tiny(), seed=2)
        if kind == "aligned"
        else build_model(ModelConfig.tiny(), seed=1)
    )


@functools.cache
def oracle(kind: str) -> list[list[int]]:
    return [oracle_greedy(mtp_model(kind), p, NEW) for p in PROMPTS]


def greedy_outputs(engine: TorchEngine, prompts: list[list[int]], k: int) -> list[list[int]]:
    req = GenerationRequest(
        prompts=prompts, sampling=SamplingParams(temperature=0.0, max_new_tokens=NEW), speculation_k=k
    )
    return [s.token_ids for s in engine.generate(req)]


@pytest.mark.parametrize("kind", ["aligned", "random"])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_greedy_on_fixed_shapes_equals_the_plain_forward(kind: str, k: int) -> None:
    engine = TorchEngine(mtp_model(kind), speculation_k=k, max_batch_size=8, compile="on")
    assert isinstance(engine.runner.rounds, FixedRounds)
    assert greedy_outputs(engine, PROMPTS, k) == oracle(kind)  # batched: 6 rows in a bucket of 8
    for p, want in zip(PROMPTS, oracle(kind), strict=True):  # alone: a bucket of 1
        assert greedy_outputs(engine, [p], k) == [want]
    c = engine.stats()[0].counters
    if k and kind == "aligned":
        assert c.acceptance_rate > 0.6  # accepted runs and bonus tokens
    if k and kind == "random":
        assert c.acceptance_rate < 0.3  # mostly rejections: rollback of the target and draft caches


def eagle3_run(engine: TorchEngine, prompts: list[list[int]], k: int) -> list[list[int]]:
    """Every prompt its own request, all in one batch (`test_eagle3.run`)."""
    return run_alone_in_one_batch(engine, k, prompts, NEW)[0]


@pytest.mark.parametrize("kind", ["aligned", "random"])
def test_greedy_with_an_eagle3_draft_on_fixed_shapes_equals_the_plain_forward(kind: str) -> None:
    target = eagle3_target()
    if kind == "aligned":
        draft = aligned_eagle3(target)
    else:
        config = Eagle3Config.for_target(target.config, num_key_value_heads=1, head_dim=8, aux_layer_ids=TAPS)
        draft = build_eagle3_draft(config, seed=3)
    want = [oracle_greedy(target, p, NEW) for p in PROMPTS]
    for k in (1, 3):
        engine = TorchEngine(target, speculation_k=k, draft=draft, max_batch_size=8, compile="on")
        assert eagle3_run(engine, PROMPTS, k) == want, k  # batched: 6 rows in a bucket of 8
        for p, w in zip(PROMPTS, want, strict=True):  # alone: a bucket of 1
            assert eagle3_run(engine, [p], k) == [w], k
        rate = engine.stats()[-1].counters.acceptance_rate
        assert rate > 0.6 if kind == "aligned" else rate < 0.3


def sampled_run(engine: TorchEngine, k: int, temperature: float) -> list[Sample]:
    req = GenerationRequest(
        prompts=PROMPTS,
        sampling=SamplingParams(temperature=temperature, max_new_tokens=NEW, seed=9),
        speculation_k=k,
        samples_per_prompt=2,
    )
    return engine.generate(req)


@pytest.mark.parametrize("draft", ["mtp", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fixed_shapes_draft_sample_and_accept_as_the_eager_round_does(draft: str, temperature: float) -> None:
    """Against `decode_round` at the batch's own shapes (compile="off"), with drafts whose attention
    matters (an aligned MTP layer given back a random attention output; the aligned EAGLE-3 draft
    attends by construction): the same tokens and log-probs, and the same drafts (drafted and
    accepted counts), so the fixed-shape draft chain reads and writes its caches as eager does."""
    options: dict[str, Any] = {}
    if draft == "mtp":
        target = aligned_draft_model(ModelConfig.tiny(), seed=2)
        with torch.no_grad():
            o = target.mtp.layers[0].self_attn.o_proj.weight
            o.copy_(torch.randn(o.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    else:
        target = eagle3_target()
        options["draft"] = aligned_eagle3(target)
    on = sampled_run(TorchEngine(target, speculation_k=3, compile="on", **options), 3, temperature)
    off = sampled_run(TorchEngine(target, speculation_k=3, compile="off", **options), 3, temperature)
    assert [s.token_ids for s in on] == [s.token_ids for s in off]
    for x, y in zip(on, off, strict=True):
        assert x.counters.drafted_tokens == y.counters.drafted_tokens
        assert x.counters.accepted_tokens == y.counters.accepted_tokens
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    accepted, drafted = (sum(getattr(s.counters, f) for s in on) for f in ("accepted_tokens", "drafted_tokens"))
    assert 0.2 * drafted < accepted < 0.95 * drafted, (accepted, drafted)  # accepted and rejected drafts


def test_plain_rounds_on_fixed_shapes_equal_the_eager_round_across_read_buckets() -> None:
    """k = 0 on a random model (attention carries weight): a row's length passes every value, so the
    longest prompt's verify needs 257 slots at length 256 — one past the first read bucket."""
    target = build_model(ModelConfig.tiny(), seed=1)
    on = sampled_run(TorchEngine(target, compile="on"), 0, 1.0)
    off = sampled_run(TorchEngine(target, compile="off"), 0, 1.0)
    assert [s.token_ids for s in on] == [s.token_ids for s in off]
    for x, y in zip(on, off, strict=True):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


# ---- 4. the chi-square harness ------------------------------------------------------------------


@pytest.fixture(scope="module")
def v8_model() -> Qwen3WithMTP:
    return aligned_draft_model(ModelConfig.tiny(vocab_size=V), seed=11, eps=0.1)


@pytest.mark.slow
def test_fixed_shape_samples_follow_the_exact_target_distribution(v8_model: Qwen3WithMTP) -> None:
    sp, k = SETTINGS[2]  # temperature 0.8, top-k 5, top-p 0.85, k = 3
    counts, acceptance = engine_counts(v8_model, sp, k, compile="on")
    assert 0.3 < acceptance < 0.8  # both the accept and the reject (residual) paths carry mass
    assert chi_square_pvalue(counts, exact_joint(v8_model, sp)) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule", sorted(WRONG_RULES))
def test_the_harness_on_fixed_shapes_detects_wrong_acceptance_rules(v8_model: Qwen3WithMTP, wrong_rule: str) -> None:
    sp, k = SETTINGS[0]
    counts = engine_counts(v8_model, sp, k, acceptance_rule=WRONG_RULES[wrong_rule], compile="on")[0]
    assert chi_square_pvalue(counts, exact_joint(v8_model, sp)) < 1e-4


# ---- 5. continuous batching ---------------------------------------------------------------------


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan=traffic(vocab=64, sampled=False), batch=st.integers(1, 8), default_k=st.integers(0, MAX_K))
def test_greedy_traffic_on_fixed_shapes_equals_each_request_alone_on_the_eager_engine(
    plan: list[Any], batch: int, default_k: int
) -> None:
    """The oracle (`alone`) runs the eager path: fixed shapes under traffic change nothing."""
    engine = TorchEngine(
        greedy_model(), speculation_k=default_k, max_speculation_k=MAX_K, max_batch_size=batch, compile="on"
    )
    check_against_alone("greedy", default_k, plan, run_plan(engine, plan))


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan=traffic(vocab=8, sampled=True), batch=st.integers(1, 8), default_k=st.integers(0, MAX_K))
def test_sampled_traffic_on_fixed_shapes_equals_each_request_alone_on_the_eager_engine(
    plan: list[Any], batch: int, default_k: int
) -> None:
    from tests.sidecar.engine.test_continuous_batching import sampled_model

    engine = TorchEngine(
        sampled_model(), speculation_k=default_k, max_speculation_k=MAX_K, max_batch_size=batch, compile="on"
    )
    check_against_alone("sampled", default_k, plan, run_plan(engine, plan))


def staggered(i: int) -> GenerationRequest:
    """Request i of a stream arriving one a step: its own seed, length and prompt."""
    return GenerationRequest(
        prompts=[[1 + i % 7, 2, 3]],
        sampling=SamplingParams(temperature=1.0, max_new_tokens=3 + i % 5, seed=i),
        request_id=f"r{i}",
        speculation_k=2,
    )


def test_rows_joining_and_leaving_one_a_step_decode_as_alone() -> None:
    """The running batch changes every step while its bucket often stays: each new batch is padded
    from its own rows (their seeds, budgets, stops). Oracle: each request alone on the eager engine.
    (It caught the id()-keyed padded batch once; whether a freed batch's id comes back depends on
    the allocator, so `test_round_capture_hazards` holds the deterministic check.)"""
    model = greedy_model()
    engine = TorchEngine(model, speculation_k=2, compile="on")
    got: dict[str, tuple[list[int], Any]] = {}
    for i in range(30):
        engine.submit(staggered(i))
        got |= {s.request_id: (s.token_ids, s.finish_reason) for s in engine.step()}
    while engine.has_work():
        got |= {s.request_id: (s.token_ids, s.finish_reason) for s in engine.step()}
    for i in range(30):
        want = TorchEngine(model, speculation_k=2).generate(staggered(i))[0]
        assert got[f"r{i}"] == (want.token_ids, want.finish_reason), i


# ---- 6. weight pushes ---------------------------------------------------------------------------


# push-then-generate on fixed shapes: tests/sidecar/engine/test_static_engine.py (compile "on")


def test_a_moved_weight_drops_the_captured_graphs() -> None:
    """`check_weights` with capture on (no CUDA needed for the bookkeeping): same addresses keep the
    graphs, any moved tensor drops them all; eager forwards keep nothing."""
    fw = FixedRounds(capture=True)
    a, b = torch.zeros(3), torch.zeros(3)
    fw.check_weights([a, b])
    fw._graphs[("target", 0)] = None  # type: ignore[assignment]
    fw.check_weights([a, b])
    assert fw._graphs
    b.data = torch.ones(3)  # an adopting push: new storage behind the same tensor
    fw.check_weights([a, b])
    assert not fw._graphs


# ---- 7. tracing ---------------------------------------------------------------------------------


HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__"}
"""Tensor methods that copy a value to the host. `fullgraph=True` does not refuse them: dynamo
(torch 2.13) traces `int(t)`, `t.item()` and `t.tolist()` into the graph as `item` calls."""


class CountingBackend:
    """A dynamo backend that runs each traced graph as it is and counts graphs and their calls."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            return gm.forward(*args)

        return run


def host_transfers(gm: torch.fx.GraphModule) -> list[str]:
    """The nodes of a traced graph that move data between host and device, which a CUDA graph
    cannot capture: host reads (`HOST_READS`), tensors made from Python data (`torch.tensor`:
    a copy from pageable host memory), and a Python scalar assigned into a tensor (`t[i] = x`
    copies x to the device)."""

    def transfers(node: torch.fx.Node) -> bool:
        if node.op == "call_method":
            return node.target in HOST_READS
        return node.op == "call_function" and (
            node.target in (torch.tensor, torch.as_tensor)
            or "_local_scalar_dense" in str(node.target)
            or (node.target is operator.setitem and not isinstance(node.args[2], torch.fx.Node))
        )

    return [node.format_node() for node in gm.graph.nodes if transfers(node)]


class HostReadCheckingBackend(CountingBackend):
    """`CountingBackend` that also records every host transfer in the graphs it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.host_reads: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.host_reads += host_transfers(gm)
        return super().__call__(gm, example_inputs)


def test_the_host_transfer_check_can_fail() -> None:
    """The check above finds what fullgraph lets through (so the trace test below can fail)."""
    backend = HostReadCheckingBackend()

    def transfers(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        y = x + int(lengths.max()) + lengths.tolist()[0] + torch.tensor([1.0, 2.0], device=x.device)
        y[..., 0] = 0.5
        return y

    torch._dynamo.reset()
    torch.compile(transfers, fullgraph=True, backend=backend, dynamic=False)(torch.zeros(2), torch.tensor([1, 2]))
    assert len(backend.host_reads) == 4, backend.host_reads
    torch._dynamo.reset()


class TracedRounds(FixedRounds):
    """Each phase of a fixed-shape round (`decode_round.draft_phase`, `verify_phase`) traced once per
    graph key — as a CUDA graph is captured once per key and replayed — with `fullgraph=True`, and
    run through the checking backend."""

    def __init__(self, backend: HostReadCheckingBackend) -> None:
        super().__init__(capture=False)
        self.backend = backend
        self.keys: list[tuple[object, ...]] = []
        self.traced: dict[tuple[object, ...], Callable[..., tuple[torch.Tensor, ...]]] = {}

    def _run(
        self,
        key: tuple[object, ...],
        fn: Callable[..., tuple[torch.Tensor, ...]],
        inputs: tuple[torch.Tensor, ...],
        *,
        by_reference: tuple[torch.Tensor, ...],
        keep: tuple[int, ...],
    ) -> tuple[torch.Tensor, ...]:
        self.keys.append(key)
        if key not in self.traced:
            self.traced[key] = torch.compile(fn, fullgraph=True, backend=self.backend, dynamic=False)
        return self.traced[key](*by_reference, *inputs)


def shape_of(key: tuple[object, ...]) -> FixedShape:
    """The round shape in a graph key: ("draft", drafter, shape, flags) or ("verify", draft key, rule)."""
    shape = key[2] if key[0] == "draft" else cast(tuple[object, ...], key[1])[2]
    assert isinstance(shape, FixedShape)
    return shape


TRACE_PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [4] * (MIN_READ - 6)]
"""The long prompt's reads cross MIN_READ mid-generation: a second read bucket."""


def traffic_run(engine: TorchEngine, k: int) -> list[Sample]:
    """Sampled (top-k, top-p) and greedy requests, the second joining while the first runs (rows
    join and leave)."""
    first = GenerationRequest(
        prompts=TRACE_PROMPTS,
        sampling=SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=10, seed=5),
        speculation_k=k,
        request_id="a",
    )
    second = GenerationRequest(
        prompts=TRACE_PROMPTS[:2],
        sampling=SamplingParams(temperature=0.0, max_new_tokens=8),
        speculation_k=k,
        request_id="b",
    )
    engine.submit(first)
    out = engine.step() + engine.step()
    engine.submit(second)
    for _ in range(100):
        if not engine.has_work():
            break
        out += engine.step()
    return sorted(out, key=lambda s: (s.request_id, s.prompt_index, s.sample_index))


@pytest.mark.slow
def test_fixed_shape_rounds_trace_whole_with_one_graph_per_key() -> None:
    """Three generations (then a copying push, then an adopting push): every phase ran as a traced
    graph, generation equals the untraced fixed-shape engine's and, greedy, the plain forward's, and
    the graphs are exactly the distinct keys — no recompile when lengths, tokens or weight values
    and storages change. k = 3, and plain rounds (k = 0) as rows near their end."""
    k = 3
    torch._dynamo.reset()
    model = aligned_draft_model(ModelConfig.tiny(), seed=2)
    reference = TorchEngine(aligned_draft_model(ModelConfig.tiny(), seed=2), compile="on")
    engine = TorchEngine(model, compile="on")
    backend = HostReadCheckingBackend()
    engine.runner.rounds = traced = TracedRounds(backend)
    pushed = {n: t.clone() for n, t in model_state_dict(aligned_draft_model(ModelConfig.tiny(), seed=3)).items()}
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        for push in ("", "copy", "adopt"):
            for e in (engine, reference):
                if push == "copy":
                    e.update_weights({n: t.clone() for n, t in pushed.items()}, WeightSelector.ALL, version=1)
                if push == "adopt":
                    e.adopt_weights({n: t.clone() for n, t in pushed.items()}, WeightSelector.ALL, version=2)
            out, eager = traffic_run(engine, k), traffic_run(reference, k)
            assert [s.token_ids for s in out] == [s.token_ids for s in eager], push
            for x, y in zip(out, eager, strict=True):
                torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-6, rtol=0)
            greedy = [s for s in out if s.request_id == "b"]
            assert [s.token_ids for s in greedy] == [oracle_greedy(engine.model, p, 8) for p in TRACE_PROMPTS[:2]]
    assert backend.calls == len(traced.keys)  # every phase ran as a traced graph, none fell back
    assert backend.host_reads == []  # no host transfer: nothing a capture could not replay
    assert backend.graphs == len(set(traced.keys))  # one graph per key
    shapes = {shape_of(key) for key in traced.keys}
    assert {MIN_READ, 2 * MIN_READ} <= {s.read_target for s in shapes}  # the long row crossed a read bucket
    assert len({s.rows for s in shapes}) >= 2  # several batch buckets (rows joined and left)
    assert {0, k} <= {s.k for s in shapes}  # plain rounds and full drafts (and shorter ones near the end)
    assert sum(s.counters.accepted_tokens for s in out) > 0  # the draft chain was traced and used


# ---- 8. the compile switch ----------------------------------------------------------------------


def test_compile_is_validated_and_reaches_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.engine.config import EngineConfig
    from sidecar.serve_config import ServeConfig
    from sidecar.server import cli
    from trainer.cli.main import main

    with pytest.raises(ValueError, match="compile must be one of auto, on, off, got 'fast'"):
        ServeConfig(engine=EngineConfig(compile="fast"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="SGLang runs its own"):
        ServeConfig(engine=EngineConfig(kind="sglang", compile="on"))
    with pytest.raises(ValueError, match="compile must be one of auto, on, off, got 'yes'"):
        TorchEngine(layer_model(), compile="yes")
    config = ModelConfig.tiny()
    save_checkpoint(tmp_path, config, model_state_dict(build_model(config, seed=38)))
    kinds = {}
    for mode in ("auto", "on", "off"):
        engine = cli.load_engine(
            ServeConfig(
                model=tmp_path,
                engine=EngineConfig(speculation_k=2, max_speculation_k=4, max_batch_size=4, compile=mode),  # type: ignore[arg-type]
            )
        )
        assert isinstance(engine, TorchEngine)
        kinds[mode] = type(engine.runner.rounds)
    assert kinds == {"auto": EagerRounds, "on": FixedRounds, "off": EagerRounds}  # auto: eager on a CPU

    seen: dict[str, object] = {}

    def load_engine(cfg: ServeConfig) -> None:
        seen["compile"] = cfg.engine.compile
        raise click.ClickException("stop before serving")

    monkeypatch.setattr(cli, "load_engine", load_engine)
    out = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--compile", "on", "--port", "0"])
    assert out.exit_code == 1 and "stop before serving" in out.output, out.output
    assert seen["compile"] == "on"
    out = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--compile", "off", "--print-config"])
    assert out.exit_code == 0 and "compile: 'off'" in out.output, out.output
    out = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--compile", "fast", "--print-config"])
    assert out.exit_code == 2 and "--compile" in out.output
