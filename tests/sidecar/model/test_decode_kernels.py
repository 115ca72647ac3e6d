"""The fused decode kernels (`triton_kernels`, chosen through `decode_kernels`) against their oracles.

On a CPU the kernels run in Triton's interpreter (the root conftest sets `TRITON_INTERPRET=1`
before Triton is imported), in float32; on a GPU (`-m gpu`) compiled, in bfloat16. Oracles:

- each kernel: its torch reference in `decode_kernels` (the operators the model ran before), over
  hypothesis-drawn shapes; attention also against `kv_cache.attend` through a fixed plan, with
  stale (NaN) slots past each row's end that it must never read;
- whole generation on the fixed-shape path with the kernels: the plain full forward decoding one
  token at a time (greedy; MTP k = 0 and 3, EAGLE-3 k = 3), the engine's own reference path
  (`compile: off`) sample for sample at temperature 1, each request of a traffic plan run alone;
- the kernel count: the operators a plain round runs per decoder layer, counted on a model of L
  and of L + 1 layers (the difference is one layer's), every operator that launches device work
  once (views and allocations none, a Triton kernel one) — what `specrl bench gpu profile` counts as
  CUDA kernels on a GPU. It fails above the bound reached (9 a layer, from 28 with torch's
  operators).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from tests.sidecar.engine.test_continuous_batching import MAX_K, check_against_alone, greedy_model, run_plan, traffic
from tests.sidecar.engine.test_fixed_shape_forwards import static_cache
from tests.sidecar.engine.test_static_engine import oracle_greedy
from tests.sidecar.engine_fixtures import aligned_draft_model, aligned_eagle3, eagle3_target
from tests.sidecar.paged_fixtures import fill_slots, row_slots

pytest.importorskip("triton")

from sidecar.engine import counter_rng
from sidecar.engine.round_graphs import FixedRounds
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model import decode_kernels, triton_kernels
from sidecar.model.checkpoint import model_state_dict
from sidecar.model.decode_kernels import DecodeKernels
from sidecar.model.kv_cache import attend
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, Sample, SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
interpreted = pytest.mark.skipif(CUDA, reason="CPU models through the kernels: Triton's interpreter, CPUs only")


@pytest.fixture
def kernels_everywhere(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Engines with fixed-shape rounds run the fused kernels on CPUs too (in the interpreter)."""
    monkeypatch.setattr(DecodeKernels, "for_device", staticmethod(lambda device: DecodeKernels()))
    yield


# ---- 1. each kernel against its reference -------------------------------------------------------


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 1e-5 if got.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 9), cols=st.sampled_from([8, 48, 64, 200]), delta=st.booleans(), seed=st.integers(0, 99))
def test_add_rms_norm_equals_its_reference(rows: int, cols: int, delta: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, d, w = (torch.randn(*shape, generator=g).to(DEVICE) for shape in [(rows, 2, cols), (rows, 2, cols), (cols,)])
    got = DecodeKernels().add_rms_norm(x, d if delta else None, w, 1e-6)
    want = decode_kernels.add_rms_norm(x, d if delta else None, w, 1e-6)
    for a, b in zip(got, want, strict=True):
        close(a, b)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 9), cols=st.sampled_from([4, 128, 700, 1500]), seed=st.integers(0, 99))
def test_silu_mul_equals_its_reference(rows: int, cols: int, seed: int) -> None:
    x = torch.randn(rows, 1, 2 * cols, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    close(DecodeKernels().silu_mul(x), decode_kernels.silu_mul(x))


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seeds=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=20),
    k=st.integers(0, MAX_K + 4),
    data=st.data(),
)
def test_round_uniforms_equal_the_counter_rng_bit_for_bit(seeds: list[int], k: int, data: st.DataObject) -> None:
    positions = data.draw(st.lists(st.integers(0, 2**20), min_size=len(seeds), max_size=len(seeds)))
    keys = counter_rng.row_keys(torch.tensor(seeds)).to(DEVICE)
    pos = torch.tensor(positions, device=DEVICE)
    want = counter_rng.uniforms(keys, counter_rng.round_words(pos, k))
    assert DecodeKernels().round_uniforms(keys, pos, k).equal(want)


FAMILIES = ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"]
"""q/k norm (Qwen3), q/k/v biases (Qwen2), neither (Llama): the kernel's two optional parts."""


@functools.cache
def layer_model(dtype: str, architecture: str = "Qwen3ForCausalLM") -> Qwen3WithMTP:
    config = ModelConfig.tiny(
        num_hidden_layers=1, num_nextn_predict_layers=0, torch_dtype=dtype, architectures=[architecture]
    )
    return build_model(config, seed=41, device=DEVICE)


@pytest.mark.parametrize("architecture", FAMILIES)
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), rows=st.integers(1, 6), s=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_a_fixed_forwards_attention_with_the_kernels_equals_torchs(
    architecture: str, data: st.DataObject, rows: int, s: int, seed: int
) -> None:
    """A layer's cached attention through a fixed plan: output and the cache it leaves. Slots past
    each row's last position hold NaN: the kernel reads up to the row's last position only (torch's
    masked attention would turn them into NaN; the reference gets zeros there instead)."""
    model = layer_model("float32" if not CUDA else data.draw(st.sampled_from(["float32", "bfloat16"])), architecture)
    capacity = 300
    lengths = data.draw(st.lists(st.integers(0, capacity - s - 1), min_size=rows, max_size=rows))
    read = data.draw(st.integers(max(lengths) + s, capacity))
    ref = static_cache(model, rows, capacity, lengths, seed, DEVICE)
    fused = static_cache(model, rows, capacity, lengths, seed, DEVICE)
    for b, n in enumerate(lengths):  # stale slots: zeros for torch (what `scrub` leaves), NaN for the kernel
        fill_slots(ref, b, n, 0.0)
        fill_slots(fused, b, n, float("nan"))
    x = torch.randn(rows, s, model.config.hidden_size, generator=torch.Generator().manual_seed(seed + 1))
    x = x.to(device=DEVICE, dtype=model.config.dtype)
    lens = torch.tensor(lengths, device=DEVICE)
    w = model.decode_weights()[0]
    attn = model.model.layers[0].self_attn  # type: ignore[union-attr]
    with torch.no_grad():
        plan = ref.plan_fixed(lens, s, read)
        rope = model.rope_table(plan.positions, x.dtype)
        want = attn.cached(x, w, rope, ref, 0, plan)
        got = attn.cached(x, w, rope, fused, 0, fused.plan_fixed(lens, s, read, masked=False), DecodeKernels())
    close(got, want)
    for b, n in enumerate(lengths):  # what both wrote: the s new slots of every row
        for mine, theirs in zip(row_slots(fused, b, n, n + s), row_slots(ref, b, n, n + s), strict=True):
            close(mine, theirs)
        assert row_slots(fused, b, 0, n)[0].equal(row_slots(ref, b, 0, n)[0])  # nothing before a row's end touched


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), rows=st.integers(1, 4), s=st.integers(1, 4), splits=st.integers(1, 5), seed=st.integers(0, 99))
def test_decode_attention_over_any_number_of_splits_equals_attend(
    data: st.DataObject, rows: int, s: int, splits: int, seed: int
) -> None:
    """The attention kernel alone against `kv_cache.attend` (SDPA under the plan's mask), its slots
    split among 1-5 programs a row (long contexts: partial results combined by a second kernel; a
    split past a row's end reads nothing). Slots past each row's end: NaN for the kernel, zeros for
    the reference."""
    model = layer_model("float32")
    capacity = 200
    lengths = data.draw(st.lists(st.integers(0, capacity - s), min_size=rows, max_size=rows))
    read = data.draw(st.integers(max(lengths) + s, capacity))
    ref = static_cache(model, rows, capacity, lengths, seed, DEVICE)
    fused = static_cache(model, rows, capacity, lengths, seed, DEVICE)
    for b, n in enumerate(lengths):
        fill_slots(ref, b, n + s, 0.0)
        fill_slots(fused, b, n + s, float("nan"))
    lens = torch.tensor(lengths, device=DEVICE)
    plan, fplan = ref.plan_fixed(lens, s, read), fused.plan_fixed(lens, s, read, masked=False)
    c = model.config
    q = torch.randn(rows, s, c.num_attention_heads, c.head_dim, generator=torch.Generator().manual_seed(seed)).to(
        DEVICE
    )
    want = attend(q, *ref.read_slots(0, plan), plan)
    got = triton_kernels.decode_attention(
        q, fplan.keys_in[0], fplan.values_in[0], fplan.positions, fplan.table, read, splits
    )
    close(got, want)


def test_the_split_count_follows_the_read_width() -> None:
    assert [triton_kernels.attention_splits(r) for r in (256, 512, 1024, 4096, 8192, 65536)] == [1, 1, 2, 8, 16, 16]


# ---- 2. whole generation with the kernels -------------------------------------------------------

PROMPTS = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7], [60, 61], [7], [11, 12, 13, 14], [30, 3, 30, 3, 30]]
NEW = 10


@functools.cache
def aligned(architecture: str = "Qwen3ForCausalLM") -> Qwen3WithMTP:
    return aligned_draft_model(ModelConfig.tiny(architectures=[architecture]), seed=2)


@functools.cache
def oracle(model_key: str, architecture: str = "Qwen3ForCausalLM") -> list[list[int]]:
    model = aligned(architecture) if model_key == "mtp" else eagle3_target()
    return [oracle_greedy(model, p, NEW) for p in PROMPTS]


def greedy(engine: TorchEngine, k: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    return [s.token_ids for s in engine.generate(GenerationRequest(prompts=PROMPTS, sampling=sp, speculation_k=k))]


@interpreted
@pytest.mark.usefixtures("kernels_everywhere")
@pytest.mark.parametrize(
    ("k", "architecture"),
    [(0, FAMILIES[0]), (3, FAMILIES[0]), (3, FAMILIES[1]), (3, FAMILIES[2]), (3, "MiMoForCausalLM")],
)
def test_greedy_with_the_kernels_equals_the_plain_forward(k: int, architecture: str) -> None:
    engine = TorchEngine(aligned(architecture), speculation_k=k, max_batch_size=8, compile="on")
    assert isinstance(engine.kernels, DecodeKernels) and isinstance(engine.runner.rounds, FixedRounds)
    assert greedy(engine, k) == oracle("mtp", architecture)
    if k:
        assert engine.stats()[0].counters.acceptance_rate > 0.6  # accepted runs, rollbacks, bonus tokens


@interpreted
@pytest.mark.usefixtures("kernels_everywhere")
def test_greedy_with_the_kernels_and_an_eagle3_draft_equals_the_plain_forward() -> None:
    target = eagle3_target()
    engine = TorchEngine(target, speculation_k=3, draft=aligned_eagle3(target), max_batch_size=8, compile="on")
    assert isinstance(engine.kernels, DecodeKernels)
    assert greedy(engine, 3) == oracle("eagle3")


@interpreted
@pytest.mark.usefixtures("kernels_everywhere")
def test_greedy_with_the_kernels_over_a_long_context_equals_the_plain_forward() -> None:
    """A 700-token prompt: the rounds read 1024 slots, so the attention splits each row's slots
    between two programs and combines them (`triton_kernels.attention_splits`)."""
    model = aligned_draft_model(ModelConfig.tiny(max_position_embeddings=1100), seed=2)
    prompt = [(7 * i) % 64 for i in range(700)]
    engine = TorchEngine(model, speculation_k=3, max_batch_size=2, compile="on")
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    out = engine.generate(GenerationRequest(prompts=[prompt], sampling=sp, speculation_k=3))
    assert triton_kernels.attention_splits(1024) == 2
    assert out[0].token_ids == oracle_greedy(model, prompt, 6)


def sampled(engine: TorchEngine) -> list[Sample]:
    sp = SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=7)
    return engine.generate(GenerationRequest(prompts=PROMPTS, sampling=sp, speculation_k=3))


@interpreted
def test_sampling_with_the_kernels_equals_the_reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Temperature 1, k = 3: the same counter-based uniforms meet the same distributions (to float
    rounding), so every sample's tokens are the reference path's and its log-probs within 1e-5."""
    want = sampled(TorchEngine(aligned(), max_batch_size=8, compile="off"))
    monkeypatch.setattr(DecodeKernels, "for_device", staticmethod(lambda device: DecodeKernels()))
    got = sampled(TorchEngine(aligned(), max_batch_size=8, compile="on"))
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@interpreted
@pytest.mark.usefixtures("kernels_everywhere")
@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan=traffic(vocab=64, sampled=False), batch=st.integers(1, 8), default_k=st.integers(0, MAX_K))
def test_traffic_with_the_kernels_equals_each_request_alone_on_the_eager_engine(
    plan: list[Any], batch: int, default_k: int
) -> None:
    engine = TorchEngine(
        greedy_model(), speculation_k=default_k, max_speculation_k=MAX_K, max_batch_size=batch, compile="on"
    )
    assert isinstance(engine.kernels, DecodeKernels)
    check_against_alone("greedy", default_k, plan, run_plan(engine, plan))


# ---- 3. the kernel count ------------------------------------------------------------------------

ROUND_BOUND = {0: 67, 3: 196}
"""Kernels of a whole fused round of the two-layer model (plain, k = 3): the counts reached (torch's
operators: 145 and 343). Of the plain round's 67, 18 are the layers'; the rest embed, plan the
forward, sample, accept and pack the result."""

ALLOCATIONS = {"empty", "empty_strided", "empty_like", "lift_fresh"}


class KernelCounter(TorchDispatchMode):
    """Counts the operators that launch device work: every aten operator except views (outputs that
    alias an input without writing it) and allocations; a Triton kernel counts once (the operators
    its launch runs in the interpreter do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused and not is_view_or_allocation(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def is_view_or_allocation(func: Any) -> bool:
    if func.__name__.split(".")[0] in ALLOCATIONS:
        return True
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@pytest.fixture
def counting_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[KernelCounter]]:
    """Each Triton launch counts once in the active counter."""
    active: list[KernelCounter] = []

    def wrap(kernel: Any) -> Any:
        class Launch:
            def __getitem__(self, grid: Any) -> Any:
                def run(*args: Any, **kwargs: Any) -> Any:
                    counter = active[0] if active else None
                    if counter is not None:
                        counter.count += 1
                        counter.paused = True
                    try:
                        return kernel[grid](*args, **kwargs)
                    finally:
                        if counter is not None:
                            counter.paused = False

                return run

        return Launch()

    for name in dir(triton_kernels):
        if name.endswith("_kernel"):
            monkeypatch.setattr(triton_kernels, name, wrap(getattr(triton_kernels, name)))
    yield active


def round_kernels(layers: int, fused: bool, active: list[KernelCounter], k: int = 0) -> int:
    """Operators of one fixed-shape decode round (k = 0: plain) of a one-row batch."""
    model = build_model(ModelConfig.tiny(num_hidden_layers=layers), seed=5)
    engine = TorchEngine(model, speculation_k=k, max_batch_size=4, compile="on")
    engine.kernels = DecodeKernels() if fused else decode_kernels.DecodeOps()
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1)
    engine.submit(GenerationRequest(prompts=[[1, 2, 3]], sampling=sp, request_id="count", speculation_k=k))
    engine.step()  # admission and prefill
    engine.step()  # a first round (one-time work: decode weights, rotary tables)
    counter = KernelCounter()
    active[:] = [counter]
    with counter:
        engine.step()
    active.clear()
    while engine.has_work():
        engine.step()
    return counter.count


def test_a_plain_round_runs_at_most_nine_kernels_a_decoder_layer(counting_triton: list[KernelCounter]) -> None:
    fused = round_kernels(3, True, counting_triton) - round_kernels(2, True, counting_triton)
    torch_ops = round_kernels(3, False, counting_triton) - round_kernels(2, False, counting_triton)
    rounds = {(f, k): round_kernels(2, f, counting_triton, k) for f in (True, False) for k in (0, 3)}
    print(f"kernels a decoder layer in a plain round: fused {fused}, torch operators {torch_ops}; a whole "
          f"round of two layers, fused / torch: plain {rounds[True, 0]} / {rounds[False, 0]}, "
          f"k = 3 {rounds[True, 3]} / {rounds[False, 3]}")  # fmt: skip
    assert fused <= 9
    assert torch_ops >= 20  # the counter counts (torch's operators are many more)
    assert rounds[True, 0] <= ROUND_BOUND[0] and rounds[True, 3] <= ROUND_BOUND[3]  # the bounds reached


# ---- 4. on a GPU: the compiled kernels in a captured engine --------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("k", [0, 3])
def test_captured_rounds_with_the_compiled_kernels_equal_the_plain_forward(k: int) -> None:
    cpu = aligned_draft_model(ModelConfig.tiny(), seed=2)
    cuda = build_model(cpu.config, device="cuda")
    cuda.load_state_dict(model_state_dict(cpu))
    engine = TorchEngine(cuda, speculation_k=k, max_batch_size=8, compile="on")
    assert isinstance(engine.kernels, DecodeKernels)
    assert greedy(engine, k) == [oracle_greedy(cpu, p, NEW) for p in PROMPTS]  # the oracle on the CPU
    assert engine.runner.rounds.captured > 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_captured_rounds_with_the_compiled_kernels_follow_the_exact_target_distribution() -> None:
    """The chi-square harness on the captured, fused path (on a CPU the interpreter takes over ten
    minutes for its 4000 samples; there `test_sampling_with_the_kernels_equals_the_reference_path`
    ties the kernels' samples to the reference path's, which the harness checks)."""
    from tests.sidecar.engine.test_speculative_distribution import (
        ALPHA,
        SETTINGS,
        V,
        chi_square_pvalue,
        engine_counts,
        exact_joint,
    )

    cpu = aligned_draft_model(ModelConfig.tiny(vocab_size=V), seed=11, eps=0.1)
    cuda = build_model(cpu.config, device="cuda")
    cuda.load_state_dict(model_state_dict(cpu))
    sp, k = SETTINGS[2]
    counts, acceptance = engine_counts(cuda, sp, k, compile="on")
    assert 0.3 < acceptance < 0.8
    assert chi_square_pvalue(counts, exact_joint(cpu, sp)) > ALPHA
