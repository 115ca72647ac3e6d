"""The trainer trains an EAGLE-3 draft the way it trains MTP: detached inputs, its own optimizer.

- The taps the trainer reads (`gpt.forward_taps`, pre-hooks on megatron's layers) equal the
  engine model's own (`Qwen3WithMTP.hidden_states(aux_layers=...)`), an independent forward.
- The policy gradient is bit-identical with and without EAGLE-3 draft training, and with no
  draft at all (the taps are only captured).
- Step 0 of the trainer's chain is the served module's teacher-forced `forward`.
- The draft loss goes down on a fixed policy's samples; a reduced draft vocabulary trains on the
  target restricted to it; `save_draft` writes a directory the engine serves, and training the
  draft raises the engine's acceptance over its initialisation.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from muon import HybridOptimizerConfig
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.eagle3 import PUSH_PREFIX, Eagle3Config, build_eagle3
from sidecar.model.eagle3_checkpoint import load_eagle3_draft
from sidecar.model.kv_cache import KVCache
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, SamplingParams, WeightSelector
from tests.trainer.draft.test_trainer_draft import _batch, _sample
from trainer.draft.objective import DraftConfig, Eagle3Head
from trainer.policy import gpt
from trainer.policy.policy import Policy

TAPS = [1, 2, 3]


@pytest.fixture(scope="module")
def setup() -> tuple[ModelConfig, Qwen3WithMTP, dict[str, torch.Tensor], torch.Tensor]:
    mc = ModelConfig.tiny(num_hidden_layers=4, num_nextn_predict_layers=0)
    engine = build_model(mc, seed=11)
    prompts = torch.randint(0, mc.vocab_size, (4, 6), generator=torch.Generator().manual_seed(1))
    return mc, engine, model_state_dict(engine), _sample(engine, prompts, 18, seed=2)


def _eagle3(mc: ModelConfig, **overrides: object) -> Eagle3Config:
    return Eagle3Config.for_target(mc, aux_layer_ids=TAPS, **overrides)  # type: ignore[arg-type]


def test_taps_equal_the_engine_models_own(setup) -> None:
    mc, engine, state, tokens = setup
    policy = Policy(mc, Policy.Config(), dict(state), eagle3=_eagle3(mc))
    with torch.no_grad():
        logits, hidden, taps = gpt.forward_taps(policy.model, tokens, TAPS)
        plain_logits, plain_hidden = gpt.forward(policy.model, tokens)
        aux: list[torch.Tensor] = []
        engine.hidden_states(tokens, aux_layers=tuple(TAPS), aux=aux)
    assert torch.equal(logits, plain_logits) and torch.equal(hidden, plain_hidden)  # only captured
    assert taps.shape == (*tokens.shape, 3 * mc.hidden_size)
    torch.testing.assert_close(taps, torch.cat(aux, dim=-1), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="tap layer 9"):
        gpt.forward_taps(policy.model, tokens, [0, 9])


def test_policy_gradient_identical_with_and_without_eagle3_training(setup) -> None:
    mc, _, state, tokens = setup
    batch = _batch(tokens, 6, [1.0, -1.0, 0.5, -0.5])
    grads = []
    for eagle3, train_draft in ((None, False), (_eagle3(mc), False), (_eagle3(mc), True)):
        policy = Policy(mc, Policy.Config(draft=DraftConfig(train=train_draft)), dict(state), eagle3=eagle3)
        metrics = policy.backward(batch)
        assert ("draft_loss" in metrics) == train_draft
        if train_draft:
            assert policy.draft is not None
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.draft.parameters())
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters()})
    for other in grads[1:]:
        assert other.keys() == grads[0].keys()
        for name in grads[0]:
            assert torch.equal(grads[0][name], other[name]), name


def test_the_chain_equals_its_entries_run_one_at_a_time_through_a_kv_cache(setup) -> None:
    """The teacher-forced chain (whole sequences, causal attention) against the engine's cached step
    fed one entry at a time: step 0 from fc(taps), step 1 from step 0's outputs, each in its own cache
    at rotary position t + j + 1. The whole-sequence forward is step 0 through the draft's head."""
    mc, engine, _, tokens = setup
    head = Eagle3Head.of(build_eagle3(_eagle3(mc), seed=3))
    cfg = head.config
    with torch.no_grad():
        aux: list[torch.Tensor] = []
        engine.hidden_states(tokens, aux_layers=tuple(TAPS), aux=aux)
        taps = torch.cat(aux, dim=-1)
        embed = engine.model.embed_tokens.weight
        outs = head.chain(tokens, taps, lambda ids: torch.nn.functional.embedding(ids, embed), depth=2)
        b, n = tokens.shape
        inputs = head.fuse(taps)
        for j, out in enumerate(outs):
            cache = KVCache(
                num_layers=1,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim,
                dtype=inputs.dtype,
                device="cpu",
                batch=b,
                capacity=n,
            )
            steps = []
            for t in range(n - 1 - j):
                plan = cache.plan([1] * b, width=1)
                token = tokens[:, t + j + 1 : t + j + 2]
                steps.append(head.step(token, inputs[:, t : t + 1], embed, cache, plan, plan.positions + 1 + j))
                cache.commit(plan)
            torch.testing.assert_close(out, torch.cat(steps, dim=1), atol=1e-5, rtol=1e-5)
            inputs = out
        torch.testing.assert_close(head.logits(0, outs[0]), head(taps, tokens, embed))
    assert [o.shape[1] for o in outs] == [n - 1, n - 2]


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_draft_loss_decreases_and_the_trunk_stays(setup, draft_vocab: int | None) -> None:
    mc, _, state, tokens = setup
    overrides = {} if draft_vocab is None else {"draft_vocab_size": draft_vocab}
    cfg = Policy.Config(
        optimizer=HybridOptimizerConfig(lr=0.0, weight_decay=0.0),
        draft=DraftConfig(chain_depth=2, optimizer=HybridOptimizerConfig(lr=3e-3, weight_decay=0.0)),
    )
    policy = Policy(mc, cfg, dict(state), eagle3=_eagle3(mc, **overrides))
    assert isinstance(policy.draft, Eagle3Head)
    if draft_vocab is not None:  # the most frequent ids of these samples, as a reduced vocabulary is chosen
        counts = torch.bincount(tokens.flatten(), minlength=mc.vocab_size)
        policy.draft.set_draft_vocab(counts.topk(draft_vocab).indices.sort().values)
    batch = _batch(tokens, 6, [0.0, 0.0, 0.0, 0.0])
    before = {n: t.clone() for n, t in policy.export_named_tensors() if not n.startswith(PUSH_PREFIX)}
    losses = [policy.train_step(batch)["draft_loss"] for _ in range(25)]
    after = {n: t for n, t in policy.export_named_tensors() if not n.startswith(PUSH_PREFIX)}
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0], losses


def test_hard_objective_refuses_a_reduced_vocabulary(setup) -> None:
    mc, _, state, tokens = setup
    policy = Policy(
        mc, Policy.Config(draft=DraftConfig(objective="hard")), dict(state), eagle3=_eagle3(mc, draft_vocab_size=32)
    )
    with pytest.raises(ValueError, match="full vocabulary"):
        policy.backward(_batch(tokens, 6, [1.0, -1.0, 0.5, -0.5]))


def _tau(target: Path, draft: Path, prompts: list[list[int]]) -> float:
    engine = TorchEngine.from_checkpoint(target, speculation_k=3, draft=draft)
    samples = engine.generate(
        GenerationRequest(prompts=prompts, sampling=SamplingParams(temperature=1.0, max_new_tokens=24, seed=4))
    )
    return sum(s.counters.generated_tokens for s in samples) / sum(s.counters.verify_steps for s in samples)


@pytest.mark.slow
def test_a_trained_draft_is_served_and_accepts_more_than_its_start(setup, tmp_path: Path) -> None:
    mc, _, state, _ = setup
    # a confident policy whose next token depends mostly on the last one (residual branches
    # scaled down): a draft can learn it in a few steps, a fresh one cannot guess it
    state = {
        k: v * (4.0 if k == "lm_head.weight" else 0.05 if k.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
        for k, v in state.items()
    }
    engine = build_model(mc)
    engine.load_state_dict(state)
    target = tmp_path / "policy"
    save_checkpoint(target, mc, state)
    cfg = Policy.Config(
        optimizer=HybridOptimizerConfig(lr=0.0, weight_decay=0.0),
        draft=DraftConfig(chain_depth=3, optimizer=HybridOptimizerConfig(lr=1e-2, weight_decay=0.0)),
    )
    policy = Policy.from_checkpoint(target, cfg, eagle3=_eagle3(mc))
    policy.save_draft(tmp_path / "start")
    prompts = torch.randint(0, mc.vocab_size, (16, 4), generator=torch.Generator().manual_seed(7))
    tokens = _sample(engine, prompts, 24, seed=8)
    mask = torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
    mask[:, 3:] = 1.0
    trunk = policy.trunk_outputs(tokens)
    for _ in range(100):
        policy.train_draft_step(tokens, mask, trunk)
    policy.save_draft(tmp_path / "trained")
    served = load_eagle3_draft(tmp_path / "trained", target=mc)
    assert isinstance(policy.draft, Eagle3Head)
    for name, p in policy.draft.state_dict().items():
        assert torch.equal(served.state_dict()[name], p), name
    held_out = torch.randint(0, mc.vocab_size, (8, 4), generator=torch.Generator().manual_seed(9)).tolist()
    start, trained = _tau(target, tmp_path / "start", held_out), _tau(target, tmp_path / "trained", held_out)
    assert trained > start + 0.3, (start, trained)
    with pytest.raises(ValueError, match="no EAGLE-3 draft"):
        Policy(mc, Policy.Config(), dict(state)).save_draft(tmp_path / "x")


def test_a_push_carries_the_trained_draft_and_generation_follows_it(setup, tmp_path: Path) -> None:
    mc, _, state, tokens = setup
    served = build_eagle3(_eagle3(mc), seed=3)
    cfg = Policy.Config(
        optimizer=HybridOptimizerConfig(lr=0.0, weight_decay=0.0),
        draft=DraftConfig(optimizer=HybridOptimizerConfig(lr=3e-3, weight_decay=0.0)),
    )
    policy = Policy(mc, cfg, dict(state), eagle3=served)
    target = build_model(mc)
    target.load_state_dict(state)
    engine = TorchEngine(target, speculation_k=2, draft=copy.deepcopy(served))
    assert policy.export_names() == [n for n, _ in policy.export_named_tensors()]
    assert set(policy.export_names()) == {s.name for s in engine.weight_specs(WeightSelector.ALL)}
    assert {s.name for s in engine.weight_specs(WeightSelector.DRAFT)} == {
        n for n in policy.export_names() if n.startswith(PUSH_PREFIX)
    }
    for _ in range(3):
        policy.train_step(_batch(tokens, 6, [0.0, 0.0, 0.0, 0.0]))
    engine.update_weights(dict(policy.export_named_tensors()), WeightSelector.ALL, version=1)
    assert isinstance(policy.draft, Eagle3Head)
    engine_draft = engine.drafter.pushed_parameters()
    for name, p in policy.draft.named_parameters():
        assert torch.equal(engine_draft[PUSH_PREFIX + name], p), name
    # the oracle of the pushed weights: a fresh engine serving the saved draft
    policy.save_draft(tmp_path / "pushed")
    fresh = TorchEngine(copy.deepcopy(target), speculation_k=2, draft=load_eagle3_draft(tmp_path / "pushed", target=mc))
    request = GenerationRequest(
        prompts=tokens[:, :6].tolist(), sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    )
    after_push, oracle = engine.generate(request), fresh.generate(request)
    assert [s.token_ids for s in after_push] == [s.token_ids for s in oracle]
    assert [s.counters.accepted_tokens for s in after_push] == [s.counters.accepted_tokens for s in oracle]
