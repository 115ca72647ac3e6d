"""The routes a sample reports (`GenerationRequest.routes`) against transformers' own routers (issue 58).

Oracle: the router modules of transformers' `Qwen3MoeForCausalLM` and `Glm4MoeForCausalLM` on the
checkpoints their `save_pretrained` writes, hooked in one forward over the sample's whole sequence
(prompt + generated tokens but the last, which is never an input): each position's experts in every
sparse layer, as a set, equal the sample's row for that position. The engine generates with
speculation (k = 1..3: an EAGLE-3 draft on Qwen3-MoE, GLM's own MTP layer), greedy and sampled,
eagerly and in the fixed-shape rounds a GPU captures; the targets are near-bigram (residual branches
scaled down, routers decisive) with drafts that follow them by construction, and at transformers'
full strength with drafts that do not; drafts are both accepted and rejected in each (the test
requires both: only accepted tokens' routes may appear). A choice
may differ only where the router's k-th and (k+1)-th scores lie within float32 rounding; such
near-ties are counted, and the test requires every difference to be one (none occurred here).

Also: "generated" is "sequence" from the prompt's length on; a preempted row resumes with the same
routes; a hypothesis property over concurrent traffic (ragged prompts, routes off / generated /
sequence mixed, speculation on) shows each sample's routes equal its request run alone (the
oracle): they never mix between rows. A negative control: routes shifted by one position (the
emitted token's instead of the input's) are caught by the same comparison.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.kv_pages import RESERVED_BLOCKS, blocks_for
from sidecar.types import GenerationRequest, Sample, SamplingParams
from tests.sidecar.engine.test_continuous_batching import Planned, run_plan
from tests.sidecar.engine_fixtures import aligned_eagle3
from tests.sidecar.model.test_glm_moe import SHAPE as GLM_SHAPE
from tests.sidecar.model.test_glm_moe import VARIANTS as GLM_VARIANTS
from tests.sidecar.model.test_glm_moe import add_native_mtp_layer, hf_glm
from tests.sidecar.model.test_moe_models import hf_qwen3_moe, loaded, moe_target

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [40, 41]]
NEW = 10
EPS = 0.01  # the residual branches' scale: a near-bigram target a constructed draft follows


def near_bigram(hf: torch.nn.Module) -> None:
    """Scale every attention output and MLP down projection (experts' included) by EPS."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.mul_(EPS)


def qwen3_moe_checkpoint(path: Path, bigram: bool = True) -> Any:
    hf, _ = hf_qwen3_moe(
        path, norm_topk_prob=True, mlp_only_layers=[1], head_dim=12, num_hidden_layers=4
    )  # EAGLE-3 taps 1..3
    if bigram:
        near_bigram(hf)
        hf.save_pretrained(path)
    return hf


def glm_checkpoint(path: Path, bigram: bool = True) -> Any:
    """GLM-4.5 (groups, bias, shared expert, first layer dense, partial rotary) near-bigram, with its
    native MTP layer (`model.layers.{L}.*`) set to the bigram the target nearly is: the next token's
    normed embedding straight through (eh_proj = [I, 0], attention and experts off), normed as the
    trunk's output. `bigram` False: transformers' weights at full strength, the MTP layer random."""
    hf = hf_glm(path, **GLM_VARIANTS["glm45"])
    if bigram:
        near_bigram(hf)
        hf.save_pretrained(path)
    add_native_mtp_layer(path)
    if not bigram:
        return hf
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    mtp, h = f"model.layers.{GLM_SHAPE['num_hidden_layers']}.", GLM_SHAPE["hidden_size"]
    tensors[mtp + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    tensors[mtp + "enorm.weight"] = torch.ones(h)
    tensors[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    for name in [n for n in tensors if n.startswith(mtp) and ("o_proj" in n or "down_proj" in n)]:
        tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(file), metadata={"format": "pt"})
    return hf


def hf_router(hf: Any, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' choice for every position of `seq` in every sparse layer: expert ids
    (positions, layers, k) sorted, and a (positions, layers) mask of near-ties (the scores the
    choice is made on within 1e-5 at the k-th/(k+1)-th boundary; GLM: anywhere, as the group
    choice reads them too)."""
    ids: list[torch.Tensor] = []
    tie: list[torch.Tensor] = []
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]

    def hook(gate: Any, _args: Any, out: tuple[torch.Tensor, ...]) -> None:
        logits, chosen = out[0].float(), out[2]
        k = chosen.shape[-1]
        bias = getattr(gate, "e_score_correction_bias", None)
        if bias is None:  # softmax top-k: the order of the logits
            top = logits.topk(k + 1, dim=-1).values
            tie.append((top[:, k - 1] - top[:, k]).abs() < 1e-5)
        else:  # sigmoid + bias, within groups
            gaps = (logits.sigmoid() + bias).sort(dim=-1, descending=True).values.diff(dim=-1).abs()
            tie.append((gaps < 1e-5).any(dim=-1))
        ids.append(chosen.sort(dim=-1).values)

    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        with torch.no_grad():
            hf(torch.tensor([seq]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(ids, dim=1), torch.stack(tie, dim=1)


def differences(sample: Sample, prompt: list[int], hf: Any, shift: int = 0) -> tuple[int, int, int]:
    """(routes compared, differing, differing at a near-tie) of a "sequence" sample against
    transformers; `shift` moves the sample's rows (the negative control)."""
    seq = prompt + sample.token_ids
    assert sample.routes is not None and sample.routes.first_position == 0
    ours = sample.routes.expert_ids.long().sort(dim=-1).values
    assert ours.shape[0] == len(seq) - 1  # P + T - 1 rows: every input position, the last token none
    theirs, tie = hf_router(hf, seq[:-1])
    assert ours.shape == theirs.shape
    if shift:
        ours = ours.roll(shift, dims=0)
    differ = (ours != theirs).any(dim=-1)
    return differ.numel(), int(differ.sum()), int((differ & tie).sum())


def check_against_transformers(engine: TorchEngine, hf: Any) -> None:
    compared = differ = at_ties = 0
    for k in (0, 1, 2, 3):
        for temperature in (0.0, 1.0):
            sp = SamplingParams(temperature=temperature, max_new_tokens=NEW, seed=11)
            req = GenerationRequest(prompts=PROMPTS, sampling=sp, speculation_k=k, routes="sequence")
            for s in engine.generate(req):
                n, d, t = differences(s, PROMPTS[s.prompt_index], hf)
                compared, differ, at_ties = compared + n, differ + d, at_ties + t
    counters = engine.stats()[0].counters
    assert 0 < counters.accepted_tokens < counters.drafted_tokens, counters  # accepted and rejected drafts
    print(f"routes compared {compared}, differing {differ}, of which at near-ties {at_ties}")
    assert differ == at_ties  # a choice differs only where float32 rounding may pick either


STRENGTHS = [("off", True), ("on", True), ("off", False)]
"""(compile, near-bigram): full-strength weights too (attention and experts decide the routes; the
drafts then accept less, still both ways)."""


@pytest.mark.parametrize(("compile_mode", "bigram"), STRENGTHS)
def test_qwen3_moe_sample_routes_are_transformers_routes(tmp_path: Path, compile_mode: str, bigram: bool) -> None:
    hf = qwen3_moe_checkpoint(tmp_path, bigram)
    model = loaded(tmp_path)
    engine = TorchEngine(model, draft=aligned_eagle3(model), speculation_k=3, compile=compile_mode, kv_block_size=4)
    check_against_transformers(engine, hf)


@pytest.mark.parametrize(("compile_mode", "bigram"), STRENGTHS)
def test_glm_sample_routes_are_transformers_routes_under_its_own_mtp_layer(
    tmp_path: Path, compile_mode: str, bigram: bool
) -> None:
    hf = glm_checkpoint(tmp_path, bigram)
    engine = TorchEngine.from_checkpoint(tmp_path, compile=compile_mode, kv_block_size=4)
    assert engine.info().speculation_method == "mtp"
    check_against_transformers(engine, hf)


def test_routes_shifted_by_one_position_are_caught(tmp_path: Path) -> None:
    hf = qwen3_moe_checkpoint(tmp_path)
    engine = TorchEngine(loaded(tmp_path), kv_block_size=4)
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    (s,) = engine.generate(GenerationRequest(prompts=PROMPTS[2:3], sampling=sp, routes="sequence"))
    assert differences(s, PROMPTS[2], hf)[1] == 0
    assert differences(s, PROMPTS[2], hf, shift=1)[1] > 0


def generate(engine: TorchEngine, routes: str, k: int | None = 2, temperature: float = 1.0) -> list[Sample]:
    sp = SamplingParams(temperature=temperature, max_new_tokens=NEW, seed=5)
    return engine.generate(GenerationRequest(prompts=PROMPTS, sampling=sp, speculation_k=k, routes=routes))


def test_generated_routes_are_the_sequences_from_the_prompts_length_on() -> None:
    engine = TorchEngine(moe_target(num_nextn_predict_layers=1, eps=0.3), speculation_k=3, kv_block_size=4)
    sequence, generated, off = (generate(engine, mode) for mode in ("sequence", "generated", "off"))
    for s, g, o, prompt in zip(sequence, generated, off, PROMPTS, strict=True):
        assert s.token_ids == g.token_ids == o.token_ids and o.routes is None
        assert g.routes is not None and s.routes is not None
        assert g.routes.first_position == len(prompt) and g.routes.positions == len(g.token_ids) - 1
        assert torch.equal(g.routes.expert_ids, s.routes.expert_ids[len(prompt) :])
        assert g.routes.expert_ids.shape[1:] == (3, 2) and g.routes.expert_ids.dtype == torch.uint8  # 3 sparse layers


def test_a_preempted_row_resumes_with_the_same_routes() -> None:
    model = moe_target(num_nextn_predict_layers=1, eps=0.3, vocab_size=64)
    sp = SamplingParams(temperature=1.0, max_new_tokens=40, seed=7)
    req = dict(prompts=[list(range(1, 17)), list(range(20, 30))], sampling=sp, samples_per_prompt=4, routes="sequence")
    token_bytes = TorchEngine(model, max_batch_size=1).drafter.token_bytes()
    blocks = blocks_for(16 + 40 + 4, 4) + 8 + RESERVED_BLOCKS  # one longest row and a few blocks more
    tight = TorchEngine(
        model, speculation_k=2, max_batch_size=8, kv_block_size=4, kv_cache_gib=blocks * 4 * token_bytes / 2**30
    )
    got = tight.generate(GenerationRequest(**req, speculation_k=2))
    assert tight.kv_usage().preemptions > 0
    want = TorchEngine(model, speculation_k=2, kv_block_size=4).generate(GenerationRequest(**req, speculation_k=2))
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.routes is not None and w.routes is not None and torch.equal(g.routes.expert_ids, w.routes.expert_ids)


@functools.cache
def traffic_model() -> Any:
    return moe_target(num_nextn_predict_layers=1, eps=0.3, vocab_size=64)


@functools.cache
def alone(
    prompts: tuple[tuple[int, ...], ...], routes: str, k: int | None, temperature: float, new: int
) -> list[Sample]:
    """The oracle: the request alone on a fresh engine."""
    engine = TorchEngine(traffic_model(), speculation_k=2, kv_block_size=4)
    sp = SamplingParams(temperature=temperature, max_new_tokens=new, seed=3)
    return engine.generate(
        GenerationRequest(prompts=[list(p) for p in prompts], sampling=sp, speculation_k=k, routes=routes)
    )


@st.composite
def planned(draw: st.DrawFn, i: int) -> tuple[Planned, tuple[Any, ...]]:
    prompts = tuple(
        tuple(draw(st.lists(st.integers(0, 63), min_size=1, max_size=12))) for _ in range(draw(st.integers(1, 2)))
    )
    key = (
        prompts,
        draw(st.sampled_from(["off", "generated", "sequence"])),
        draw(st.sampled_from([None, 0, 1, 2, 3])),
        draw(st.sampled_from([0.0, 1.0])),
        draw(st.integers(1, 8)),
    )
    _, routes, k, temperature, new = key
    sp = SamplingParams(temperature=temperature, max_new_tokens=new, seed=3)
    request = GenerationRequest(
        prompts=[list(p) for p in prompts], sampling=sp, speculation_k=k, routes=routes, request_id=f"r{i}"
    )
    return Planned(request=request, arrival=draw(st.integers(0, 3)), abort_after=None), key


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.integers(2, 4).flatmap(lambda n: st.tuples(*(planned(i) for i in range(n)))), batch=st.integers(1, 6))
def test_routes_under_concurrent_traffic_are_each_requests_alone(
    plan: tuple[tuple[Planned, tuple[Any, ...]], ...], batch: int
) -> None:
    engine = TorchEngine(traffic_model(), speculation_k=2, max_batch_size=batch, kv_block_size=4)
    got = run_plan(engine, [p for p, _ in plan])
    for p, key in plan:
        oracle = {(s.prompt_index, s.sample_index): s for s in alone(*key)}
        for s in got[p.request.request_id]:
            want = oracle[(s.prompt_index, s.sample_index)]
            assert s.token_ids == want.token_ids
            if p.request.routes == "off":
                assert s.routes is None
                continue
            assert s.routes is not None and want.routes is not None
            prompt = p.request.prompts[s.prompt_index]
            first = 0 if p.request.routes == "sequence" else len(prompt)
            assert s.routes.first_position == first and s.routes.positions == len(prompt) + len(s.token_ids) - 1 - first
            assert torch.equal(s.routes.expert_ids.sort(-1).values, want.routes.expert_ids.sort(-1).values)


@pytest.mark.slow
def test_a_round_that_records_routes_traces_whole_without_host_reads() -> None:
    """What a GPU captures when a row asks routes: every phase of the fixed-shape round traces with
    `fullgraph=True`, nothing read back inside, and the routes equal the eager engine's."""
    from tests.sidecar.engine.test_fixed_shape_forwards import HostReadCheckingBackend, TracedRounds

    torch._dynamo.reset()
    model = moe_target(num_nextn_predict_layers=1, eps=0.3)
    engine = TorchEngine(model, speculation_k=2, compile="on", kv_block_size=4)
    backend = HostReadCheckingBackend()
    engine.runner.rounds = traced = TracedRounds(backend)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    req = dict(prompts=PROMPTS[:2], sampling=sp, speculation_k=2, routes="sequence")
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        got = engine.generate(GenerationRequest(**req))
    want = TorchEngine(model, speculation_k=2, compile="off", kv_block_size=4).generate(GenerationRequest(**req))
    assert [s.routes for s in got] == [s.routes for s in want]
    assert any(key[0] in ("round", "verify") and key[-1] is True for key in traced.keys)  # traced, recording
    assert backend.calls == len(traced.keys) > 0 and backend.host_reads == []
    torch._dynamo.reset()
