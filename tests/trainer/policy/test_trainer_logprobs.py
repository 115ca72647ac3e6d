"""The Megatron policy computes the engine's log-probs (DESIGN invariant 2) and the engine's draft.

Two independent references: the embedded engine's plain forward (`Qwen3WithMTP`) and Hugging
Face transformers' `Qwen3ForCausalLM` built from the same config and weights. Sequences run past
the YaRN original context (16 positions) to exercise the interpolated frequencies.
"""

from __future__ import annotations

import pytest
import torch

from sidecar.model.checkpoint import model_state_dict
from sidecar.model.model import ModelConfig, build_model
from tests.sidecar_fixtures import hf_qwen3_config
from trainer.policy.policy import Policy, TrainBatch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
SEQ = 64  # four times the original YaRN context (factor 4): the whole extended window


def _hf_reference(mc: ModelConfig, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3ForCausalLM(hf_qwen3_config(mc)).eval()
    trunk = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(trunk, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model


def _gather(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # (B,S,V),(B,S) -> (B,S-1)
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.mark.parametrize(
    ("rope_scaling", "tied", "temperature"),
    [(None, False, 1.0), (YARN, False, 1.0), (YARN, True, 0.7)],
    ids=["rope", "yarn", "yarn-tied-T0.7"],
)
def test_logprobs_match_engine_and_transformers(rope_scaling: dict | None, tied: bool, temperature: float) -> None:
    mc = ModelConfig.tiny(rope_scaling=rope_scaling, tie_word_embeddings=tied, max_position_embeddings=64)
    engine = build_model(mc, seed=3)
    state = model_state_dict(engine)
    # Non-trivial norm gains, so a swapped or misplaced norm cannot hide behind all-ones weights.
    gen = torch.Generator().manual_seed(0)
    for name, t in state.items():
        if name.endswith("norm.weight"):
            t.add_(0.3 * torch.randn(t.shape, generator=gen))
    policy = Policy(mc, Policy.Config(temperature=temperature), dict(state))
    tokens = torch.randint(0, mc.vocab_size, (2, SEQ), generator=gen)

    got = policy.logprobs(tokens)
    with torch.no_grad():
        want_engine = _gather(engine(tokens) / temperature, tokens)
        want_hf = _gather(_hf_reference(mc, state)(tokens).logits / temperature, tokens)
    assert got.dtype == torch.float32 and got.shape == (2, SEQ - 1)
    assert torch.isfinite(got).all() and torch.isfinite(want_engine).all()
    torch.testing.assert_close(got, want_engine, rtol=0, atol=1e-4)
    torch.testing.assert_close(got, want_hf, rtol=0, atol=1e-4)
    # The tail (positions 16..63) is beyond the original context: it must agree just as well.
    assert (got[:, 16:] - want_engine[:, 16:]).abs().max() < 1e-4

    # The draft head computes the engine's draft function (logits of x_{t+2} at position t).
    with torch.no_grad():
        want_draft = engine.mtp_logits(tokens, engine.hidden_states(tokens))
    torch.testing.assert_close(policy.draft_logits(tokens), want_draft, rtol=0, atol=1e-4)


def test_greedy_temperature_means_one() -> None:
    mc = ModelConfig.tiny(num_nextn_predict_layers=0)
    engine = build_model(mc, seed=5)
    policy = Policy(mc, Policy.Config(temperature=0.0), model_state_dict(engine))
    tokens = torch.randint(0, mc.vocab_size, (1, 12))
    with torch.no_grad():
        want = _gather(engine(tokens), tokens)
    torch.testing.assert_close(policy.logprobs(tokens), want, rtol=0, atol=1e-4)


def test_batch_alignment_and_mismatch_metric_against_engine_logprobs() -> None:
    mc = ModelConfig.tiny(num_nextn_predict_layers=0)
    engine = build_model(mc, seed=8)
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]]
    rollout = []
    with torch.no_grad():  # what the engine reports: log p(r_i | prompt, r_<i), each sequence unpadded
        for p, r in zip(prompts, responses, strict=True):
            seq = torch.tensor([p + r])
            rollout.append(_gather(engine(seq), seq)[0, len(p) - 1 :].tolist())
    batch = TrainBatch.from_sequences(prompts, responses, torch.tensor([1.0, -1.0]), rollout_logprobs=rollout)
    # mask over tokens[:, 1:]: sample 0 predicts 6..9 at positions 2..5; sample 1 predicts 10, 11 at 1, 2
    assert batch.mask.tolist() == [[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]]
    policy = Policy(mc, Policy.Config(), model_state_dict(engine))
    m = batch.mask.bool()
    torch.testing.assert_close(policy.logprobs(batch.tokens)[m], batch.rollout_logprobs[m], rtol=0, atol=1e-4)
    metrics = policy.backward(batch)
    assert metrics["mismatch_logprob_abs_max"] < 1e-4
    assert metrics["tokens"] == 6.0


def test_old_logprobs_from_the_training_forward_give_the_same_update_as_a_separate_pass() -> None:
    """The RL loop's default (`separate_logprob_pass` off): with one update per rollout batch the
    PPO ratio's denominator taken detached from the training forward is the separate pass's,
    so policy and draft move bit for bit the same."""
    mc = ModelConfig.tiny()
    state = model_state_dict(build_model(mc, seed=21))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, mc.vocab_size, (5,), generator=gen).tolist() for _ in range(4)]
    responses = [torch.randint(0, mc.vocab_size, (n,), generator=gen).tolist() for n in (7, 3, 9, 5)]
    after = []
    for separate in (True, False):
        policy = Policy(mc, Policy.Config(), dict(state))
        batch = TrainBatch.from_sequences(prompts, responses, torch.tensor([1.0, -1.0, 0.5, -0.5]))
        if separate:
            batch.old_logprobs = policy.logprobs(batch.tokens)
        policy.train_step(batch)
        after.append(dict(policy.export_named_tensors()))
    assert after[0].keys() == after[1].keys()
    moved = [n for n in after[0] if not torch.equal(after[0][n], state[n])]
    assert moved, "the update changed nothing: the comparison would be vacuous"
    for name in after[0]:
        assert torch.equal(after[0][name], after[1][name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logprobs_match_engine_on_cuda() -> None:
    mc = ModelConfig.tiny(rope_scaling=YARN, max_position_embeddings=64)
    engine = build_model(mc, seed=3, device="cuda")
    policy = Policy(mc, Policy.Config(), {k: v.cpu() for k, v in model_state_dict(engine).items()})
    tokens = torch.randint(0, mc.vocab_size, (2, SEQ), device="cuda")
    with torch.no_grad():
        want = _gather(engine(tokens), tokens)
    torch.testing.assert_close(policy.logprobs(tokens), want, rtol=0, atol=1e-4)
