"""Draft training is isolated from the policy and learns the target.

- The trunk's gradient is bit-identical with and without the draft loss (detached inputs).
- On a fixed policy's own samples the draft loss goes down.
- The draft function equals an independent oracle: transformers' Qwen3 decoder layer fed the
  DeepSeek-V3 MTP input by hand (embedding first, rotary at t + 1, shared head).
"""

from __future__ import annotations

import pytest
import torch

from muon import HybridOptimizerConfig
from sidecar.model.checkpoint import model_state_dict
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from tests.sidecar_fixtures import hf_qwen3_config
from trainer.draft.objective import DraftConfig
from trainer.policy.policy import Policy, TrainBatch


def _sample(engine: Qwen3WithMTP, prompts: torch.Tensor, new: int, seed: int) -> torch.Tensor:
    """Plain autoregressive sampling at T = 1 from the engine's reference forward."""
    gen = torch.Generator().manual_seed(seed)
    tokens = prompts
    with torch.no_grad():
        for _ in range(new):
            probs = torch.softmax(engine(tokens)[:, -1].float(), -1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return tokens


def _batch(tokens: torch.Tensor, prompt_len: int, advantages: list[float]) -> TrainBatch:
    mask = torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
    mask[:, prompt_len - 1 :] = 1.0
    return TrainBatch(tokens=tokens, mask=mask, advantages=torch.tensor(advantages))


@pytest.fixture(scope="module")
def setup() -> tuple[ModelConfig, Qwen3WithMTP, dict[str, torch.Tensor], torch.Tensor]:
    mc = ModelConfig.tiny()
    engine = build_model(mc, seed=11)
    prompts = torch.randint(0, mc.vocab_size, (4, 6), generator=torch.Generator().manual_seed(1))
    return mc, engine, model_state_dict(engine), _sample(engine, prompts, 18, seed=2)


@pytest.mark.parametrize("tied", [False, True])
def test_policy_gradient_identical_with_and_without_draft_loss(setup, tied: bool) -> None:
    mc, _, state, tokens = setup
    if tied:  # the draft then shares the embedding as its output head: still no path into the trunk
        mc = ModelConfig.tiny(tie_word_embeddings=True)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    batch = _batch(tokens, 6, [1.0, -1.0, 0.5, -0.5])
    grads = []
    for train_draft in (False, True):
        policy = Policy(mc, Policy.Config(draft=DraftConfig(train=train_draft)), dict(state))
        metrics = policy.backward(batch)
        assert ("draft_loss" in metrics) == train_draft
        if train_draft:  # the draft did get a gradient of its own
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.draft.parameters())
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("objective", ["kl", "hard"])
def test_draft_loss_decreases_on_fixed_policy_samples(setup, objective: str) -> None:
    mc, _, state, tokens = setup
    frozen = HybridOptimizerConfig(lr=0.0, weight_decay=0.0)  # the policy stays fixed
    cfg = Policy.Config(
        optimizer=frozen,
        draft=DraftConfig(objective=objective, optimizer=HybridOptimizerConfig(lr=3e-3, weight_decay=0.0)),
    )
    policy = Policy(mc, cfg, dict(state))
    batch = _batch(tokens, 6, [0.0, 0.0, 0.0, 0.0])
    before = {n: t.clone() for n, t in policy.export_named_tensors() if not n.startswith("mtp.")}
    losses = [policy.train_step(batch)["draft_loss"] for _ in range(25)]
    after = {n: t for n, t in policy.export_named_tensors() if not n.startswith("mtp.")}
    assert all(torch.equal(before[n], after[n]) for n in before)  # trunk untouched
    assert losses[-1] < 0.7 * losses[0], losses
    assert sum(losses[-5:]) < sum(losses[:5])


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_draft_matches_transformers_decoder_layer(setup) -> None:
    transformers = pytest.importorskip("transformers")
    mc, engine, state, tokens = setup
    policy = Policy(mc, Policy.Config(), dict(state))
    hf = transformers.Qwen3ForCausalLM(hf_qwen3_config(mc, num_hidden_layers=1)).eval()
    p = "mtp.layers.0."
    sub = {
        k[len(p) :]: v
        for k, v in state.items()
        if k.startswith(p) and not k[len(p) :].startswith(("enorm", "hnorm", "eh_proj", "shared_head"))
    }
    hf_state = {f"model.layers.0.{k}": v for k, v in sub.items()}
    hf_state["model.norm.weight"] = state[p + "shared_head.norm.weight"]
    hf_state["lm_head.weight"] = state["lm_head.weight"]
    hf_state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(hf_state)
    with torch.no_grad():
        h = engine.hidden_states(tokens)[:, :-1]  # trunk h_t (independently checked in the log-prob test)
        e = torch.nn.functional.embedding(tokens[:, 1:], state["model.embed_tokens.weight"])  # embed(x_{t+1})
        eps = mc.rms_norm_eps
        x = torch.cat([_rms(e, state[p + "enorm.weight"], eps), _rms(h, state[p + "hnorm.weight"], eps)], -1)
        x = x @ state[p + "eh_proj.weight"].T
        positions = torch.arange(1, tokens.shape[1]).expand(tokens.shape[0], -1)
        want = hf(inputs_embeds=x, position_ids=positions).logits
    torch.testing.assert_close(policy.draft_logits(tokens), want, rtol=0, atol=1e-4)


def test_two_layer_chain_step_matches_engine_building_blocks() -> None:
    """Step j = 1 of the teacher-forced chain: layer 1 on (layer 0's output at t, embed(x_{t+2})),
    rotary at t + 2, predicting x_{t+3} — rebuilt from the engine's own primitives."""
    mc = ModelConfig.tiny(num_nextn_predict_layers=2)
    engine = build_model(mc, seed=13)
    policy = Policy(mc, Policy.Config(), model_state_dict(engine))
    tokens = torch.randint(0, mc.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        h = engine.hidden_states(tokens)
        out0 = engine.mtp_hidden(tokens, h, 0)  # (B, T-1, H): position t sees h_t, x_{t+1}
        layer1 = engine.mtp.layers[1]
        positions = torch.arange(2, tokens.shape[1]).expand(2, -1)
        cos, sin = engine.rope(positions)
        out1 = layer1(layer1.combine(engine.model.embed_tokens(tokens[:, 2:]), out0[:, :-1]), cos, sin)
        want = engine.mtp_head(1, out1)  # (B, T-2, V)
    torch.testing.assert_close(policy.draft_logits(tokens, layer=1), want, rtol=0, atol=1e-4)
    mask = torch.ones(2, 11)
    metrics = policy.backward(TrainBatch(tokens=tokens, mask=mask, advantages=torch.tensor([1.0, -1.0])))
    assert {"draft_loss_0", "draft_loss_1"} <= metrics.keys()


def test_draft_only_step_leaves_the_trunk_and_learns(setup) -> None:
    mc, _, state, tokens = setup
    policy = Policy(
        mc, Policy.Config(draft=DraftConfig(optimizer=HybridOptimizerConfig(lr=3e-3, weight_decay=0.0))), dict(state)
    )
    mask = _batch(tokens, 6, [0.0] * 4).mask
    losses = [policy.train_draft_step(tokens, mask)["draft_loss"] for _ in range(15)]
    trunk = {n: t for n, t in policy.export_named_tensors() if not n.startswith("mtp.")}
    assert all(torch.equal(trunk[n], state[n]) for n in trunk)
    assert all(p.grad is None for p in policy.model.parameters())  # no trunk backward at all
    assert losses[-1] < 0.8 * losses[0], losses


def test_a_draft_step_on_kept_trunk_outputs_equals_one_that_runs_the_trunk(setup) -> None:
    """Draft-init computes each sample's trunk outputs once (the trunk is frozen) and pads them
    into every batch: the draft must learn exactly what it learns when each step runs the trunk,
    here with rows of different lengths (right padding differs between the two paths)."""
    mc, _, state, tokens = setup
    mask = _batch(tokens, 6, [0.0] * 4).mask
    mask[1, 15:] = 0.0  # row 1 ends early: its padded positions must not matter
    mask[3, 10:] = 0.0
    config = Policy.Config(draft=DraftConfig(optimizer=HybridOptimizerConfig(lr=3e-3, weight_decay=0.0)))
    running, keeping = Policy(mc, config, dict(state)), Policy(mc, config, dict(state))
    kept = [keeping.trunk_outputs(tokens[i : i + 1, : 7 + int(mask[i].sum())]) for i in range(4)]

    def padded(j: int) -> torch.Tensor:
        out = torch.zeros(4, tokens.shape[1], kept[0][j].shape[-1])
        for i, t in enumerate(kept):
            out[i, : t[j].shape[1]] = t[j][0]
        return out

    for _ in range(3):
        a = running.train_draft_step(tokens, mask)
        b = keeping.train_draft_step(tokens, mask, (padded(0), padded(1)))
        assert b["draft_loss"] == pytest.approx(a["draft_loss"], rel=1e-5)
    ran = dict(running.export_named_tensors())
    for name, value in keeping.export_named_tensors():
        torch.testing.assert_close(value, ran[name], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="do not match tokens"):
        keeping.train_draft_step(tokens, mask, (padded(0)[:, :-1], padded(1)))
