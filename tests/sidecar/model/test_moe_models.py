"""Mixture-of-experts checkpoints against transformers' own forward (issue 58).

Oracle: transformers' `Qwen3MoeForCausalLM` on tiny random checkpoints its `save_pretrained`
writes (the layout users download), with weights scaled up from its initialisation so that routing
is decisive and every expert matters. Checked:

- the float32 log-softmax of every position equals transformers' within 1e-4, for
  norm_topk_prob true and false, a dense layer among sparse ones (`mlp_only_layers`) and every other
  layer sparse (`decoder_sparse_step` 2); the negative control: the same weights read with
  norm_topk_prob flipped are caught by the same comparison;
- the engine's greedy output equals transformers' own greedy decoding token for token: ragged
  prompts in one batch, in the paged KV pool with small blocks (a row spans several), eagerly and in
  the fixed-shape rounds a GPU captures (`compile` off / on);
- speculation is lossless on an MoE target: greedy with specrl's own MTP layer (a sparse layer
  itself) and with an EAGLE-3 draft at k = 1..3 equals plain greedy; at temperature > 0 the
  chi-square harness of `test_eagle3_distribution` passes on an MoE target and still rejects the
  wrong acceptance rules.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from sidecar.engine.torch_engine import TorchEngine
from sidecar.losslessness.statistics import pooled_chi_square_pvalue
from sidecar.losslessness.wrong_rules import WRONG_RULES
from sidecar.model.checkpoint import load_checkpoint, model_state_dict, read_tensors
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.model.moe import MoEConfig, SparseMoE
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar.engine.test_eagle3_distribution import PROMPT as DIST_PROMPT
from tests.sidecar.engine.test_eagle3_distribution import engine_counts, exact_joint
from tests.sidecar.engine_fixtures import aligned_eagle3

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SHAPE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)

VARIANTS: dict[str, dict[str, Any]] = {
    "renormalised": {"norm_topk_prob": True},
    "not_renormalised": {"norm_topk_prob": False},
    "mlp_only_layers": {"norm_topk_prob": True, "mlp_only_layers": [1]},
    "decoder_sparse_step_2": {"norm_topk_prob": False, "decoder_sparse_step": 2},
}

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41]]
NEW = 12


def scaled(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Weights well away from transformers' 0.02 initialisation: decisive routing, every expert
    and norm visible in the output (so that a wrong rule shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if name.endswith("mlp.gate.weight") else std))


def hf_qwen3_moe(path: Path, **overrides: Any) -> tuple[transformers.Qwen3MoeForCausalLM, Path]:
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**(SHAPE | overrides))).eval()
    scaled(hf, seed=1)
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    return hf_qwen3_moe(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def loaded(path: Path, **moe_overrides: Any) -> Qwen3WithMTP:
    config, tensors = load_checkpoint(path)
    if moe_overrides:
        assert config.moe is not None
        config.moe = dataclasses.replace(config.moe, **moe_overrides)
    model = build_model(config)
    model.load_state_dict(tensors, strict=True)
    return model


def logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float().log_softmax(-1)


def test_the_layers_are_sparse_where_transformers_makes_them_sparse(checkpoint: tuple[Any, Path]) -> None:
    hf, path = checkpoint
    model = loaded(path)
    ours = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    theirs = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert ours == theirs and any(ours)
    assert set(model_state_dict(model)) == set(read_tensors(path))  # the names save_pretrained writes


def test_log_softmax_matches_transformers_at_every_position(checkpoint: tuple[Any, Path]) -> None:
    hf, path = checkpoint
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 64), generator=torch.Generator().manual_seed(2))
    ours, theirs = logprobs(loaded(path), ids), logprobs(hf, ids)
    assert (ours - theirs).abs().max() < 1e-4


@pytest.mark.parametrize("variant", ["renormalised", "not_renormalised"])
def test_reading_norm_topk_prob_wrong_is_caught(tmp_path: Path, variant: str) -> None:
    """The negative control: the comparison above fails for the same weights routed with the
    renormalisation flipped (why norm_topk_prob is read from the JSON, not defaulted)."""
    hf, path = hf_qwen3_moe(tmp_path, **VARIANTS[variant])
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(3))
    flipped = loaded(path, norm_topk_prob=not VARIANTS[variant]["norm_topk_prob"])
    assert (logprobs(flipped, ids) - logprobs(hf, ids)).abs().max() > 1e-2


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by transformers' own forward over the whole sequence, one token at a time."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def engine_greedy(engine: TorchEngine, prompts: list[list[int]], k: int, new: int = NEW) -> list[list[int]]:
    req = GenerationRequest(
        prompts=prompts, sampling=SamplingParams(temperature=0.0, max_new_tokens=new), speculation_k=k
    )
    return [s.token_ids for s in engine.generate(req)]


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_engine_greedy_equals_transformers_greedy(checkpoint: tuple[Any, Path], compile_mode: str) -> None:
    hf, path = checkpoint
    expected = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    engine = TorchEngine.from_checkpoint(path, compile=compile_mode, kv_block_size=4, max_batch_size=4)
    assert engine_greedy(engine, PROMPTS, 0) == expected  # batched, ragged, rows over several KV blocks
    assert engine_greedy(engine, PROMPTS[2:3], 0) == expected[2:3]  # alone


def moe_target(num_nextn_predict_layers: int = 0, eps: float = 1.0, seed: int = 5, **shape: Any) -> Qwen3WithMTP:
    """A specrl Qwen3-MoE (4 layers, the second dense); `eps` < 1 scales every attention and MLP
    output (experts included) towards a near-bigram model an aligned draft can follow."""
    moe = MoEConfig(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]
    )
    config = ModelConfig.tiny(
        num_hidden_layers=4,
        num_nextn_predict_layers=num_nextn_predict_layers,
        architectures=["Qwen3MoeForCausalLM"],
        moe=moe,
        **shape,
    )
    model = build_model(config, seed=seed)
    with torch.no_grad():
        for layer in [*model.model.layers, *model.mtp.layers]:
            layer.self_attn.o_proj.weight.mul_(eps)
            for name, p in layer.mlp.named_parameters():
                if name.endswith("down_proj.weight"):
                    p.mul_(eps)
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.gate.weight.mul_(4.0)  # decisive routing
    return model


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_greedy_with_an_mtp_layer_that_routes_equals_plain_greedy(compile_mode: str) -> None:
    """specrl's own MTP layer on an MoE target is a sparse layer (its draft routes too)."""
    model = moe_target(num_nextn_predict_layers=1)
    assert isinstance(model.mtp_layer(0).mlp, SparseMoE)
    engine = TorchEngine(model, speculation_k=3, compile=compile_mode, kv_block_size=4)
    plain = engine_greedy(engine, PROMPTS, 0)
    with torch.no_grad():  # the plain full forward, no cache
        assert plain[:2] == [_greedy_by_forward(model, p, NEW) for p in PROMPTS[:2]]
    for k in (1, 2, 3):
        assert engine_greedy(engine, PROMPTS, k) == plain, k
    assert engine.stats()[0].counters.drafted_tokens > 0


def _greedy_by_forward(model: Qwen3WithMTP, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_greedy_with_an_eagle3_draft_on_an_moe_target_equals_plain_greedy(compile_mode: str) -> None:
    target = moe_target(eps=0.002)
    draft = aligned_eagle3(target)
    engine = TorchEngine(target, speculation_k=3, draft=draft, compile=compile_mode, kv_block_size=4)
    plain = engine_greedy(engine, PROMPTS, 0)
    with torch.no_grad():
        assert plain[:2] == [_greedy_by_forward(target, p, NEW) for p in PROMPTS[:2]]
    for k in (1, 2, 3):
        assert engine_greedy(engine, PROMPTS, k) == plain, k
    counters = engine.stats()[0].counters
    assert counters.acceptance_rate > 0.5, counters  # the draft is aligned: long accepted runs ran


V = 8


@pytest.fixture(scope="module")
def sampled_target() -> Qwen3WithMTP:
    return moe_target(eps=0.1, vocab_size=V)


@pytest.mark.slow
def test_eagle3_samples_on_an_moe_target_follow_the_exact_target_distribution(sampled_target: Qwen3WithMTP) -> None:
    sp, k = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1), 2
    counts, acceptance = engine_counts(sampled_target, aligned_eagle3(sampled_target), sp, k)
    assert 0.2 < acceptance < 0.9, acceptance  # both the accept and the residual paths carry mass
    assert pooled_chi_square_pvalue(counts, exact_joint(sampled_target, sp)) > 1e-3
    assert len(DIST_PROMPT) == 5  # the harness's prompt: its exact joint enumerates 3 tokens after it


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule", sorted(WRONG_RULES))
def test_the_harness_still_rejects_wrong_acceptance_rules_on_an_moe_target(
    sampled_target: Qwen3WithMTP, wrong_rule: str
) -> None:
    sp, k = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1), 2
    counts = engine_counts(sampled_target, aligned_eagle3(sampled_target), sp, k, rule=WRONG_RULES[wrong_rule])[0]
    assert pooled_chi_square_pvalue(counts, exact_joint(sampled_target, sp)) < 1e-4


@pytest.mark.slow
def test_the_fixed_shape_expert_sum_traces_whole_without_host_reads() -> None:
    """What a GPU captures: every phase of a fixed-shape round of an MoE target (its MTP layer
    routing too) traces with `fullgraph=True`, no host transfer inside, and greedy output is the
    plain forward's (the harness of `test_fixed_shape_forwards`)."""
    from tests.sidecar.engine.test_fixed_shape_forwards import HostReadCheckingBackend, TracedRounds

    torch._dynamo.reset()
    model = moe_target(num_nextn_predict_layers=1)
    engine = TorchEngine(model, speculation_k=2, compile="on", kv_block_size=4)
    backend = HostReadCheckingBackend()
    engine.runner.rounds = traced = TracedRounds(backend)
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        out = engine_greedy(engine, PROMPTS[:2], 2, new=6)
    with torch.no_grad():
        assert out == [_greedy_by_forward(model, p, 6) for p in PROMPTS[:2]]
    assert backend.calls == len(traced.keys) > 0
    assert backend.host_reads == []
    torch._dynamo.reset()
