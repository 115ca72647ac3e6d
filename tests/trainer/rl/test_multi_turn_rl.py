"""Multi-turn RL end to end: `specrl train` with the built-in calculator environment against a real
local sidecar, speculation on.

Oracles: the trainer's own log-prob recomputation of every token the policy sampled (the
sidecar's log-probs must equal it, over conversations whose later turns were prompted with the
whole history; the environment's observation tokens carry no sampled log-prob, so a loss mask that
let one in would show as a mismatch of whole nats), and the episode bookkeeping of each batch
(masks cover exactly the sampled tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from muon import HybridOptimizerConfig
from sidecar.model.model import ModelConfig
from trainer.policy.policy import Policy, TrainBatch
from trainer.rl.config import RLConfig, RolloutConfig, SidecarsConfig, TaskConfig
from trainer.rl.loop import train
from trainer.rl.warmup import make_model
from trainer.tokenizer import CharTokenizer

TOK = CharTokenizer()


@pytest.mark.slow
def test_specrl_train_runs_calculator_episodes_and_trains_only_the_policy_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ModelConfig.tiny(
        vocab_size=TOK.vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        max_position_embeddings=128,
    )
    make_model(tmp_path / "init", config, seed=0)  # untrained: it writes ']' (a tool call) now and then
    batches: list[TrainBatch] = []
    real = Policy.train_updates

    def recorded(self: Policy, batch: TrainBatch, **kw: Any) -> dict[str, float]:
        batches.append(batch)
        return real(self, batch, **kw)

    monkeypatch.setattr(Policy, "train_updates", recorded)
    cfg = RLConfig(
        model=tmp_path / "init",
        task=TaskConfig(kind="calculator", digits=2, max_turns=3, max_episode_tokens=96),
        rollout=RolloutConfig(prompts_per_step=8, samples_per_prompt=4, temperature=1.0, max_new_tokens=16),
        optimizer=HybridOptimizerConfig(lr=1e-4),
        sidecars=SidecarsConfig(local=1),
        steps=2,
        eval_every=2,
        eval_size=8,
        run_dir=tmp_path / "run",
    )
    history = train(cfg, progress=False)
    assert [m["weights/version"] for m in history] == [2.0, 3.0]
    assert all(m["mismatch/logprob_abs_max"] < 1e-4 for m in history), history
    assert all(1.0 <= m["rollout/turns_mean"] <= 3.0 for m in history)
    assert sum(m["rollout/tool_calls_mean"] for m in history) > 0, "no episode called the calculator"
    assert any(m["rollout/observation_token_share"] > 0 for m in history)
    # a later turn's history starts with the earlier turns' cached blocks (one sidecar: all pinned)
    assert any(m["prefix_cache/hit_rate"] > 0 for m in history), [m["prefix_cache/hit_rate"] for m in history]
    assert all("time/turn_1" in m and "rollout/turn_1_prompt_tokens" in m for m in history)
    assert "reward/eval_mean" in history[-1] and "spec/acceptance_length" in history[-1]
    observed = 0
    for batch in batches:
        assert batch.generated is not None and batch.rollout_logprobs is not None
        # observation tokens: generated (after the prompt) but out of the mask, with log-prob 0
        after_prompt = torch.zeros_like(batch.generated, dtype=torch.bool)
        for i in range(batch.tokens.shape[0]):
            nonzero = (batch.generated[i] > 0).nonzero()
            if len(nonzero):
                after_prompt[i, int(nonzero[0]) : int(nonzero[-1]) + 1] = True
        observation = after_prompt & (batch.generated == 0)
        observed += int(observation.sum())
        assert bool((batch.rollout_logprobs[observation] == 0).all())
        assert bool((batch.mask[observation] == 0).all())
    assert observed > 0


@pytest.mark.long
@pytest.mark.parametrize("seed", [0, 1])
def test_rl_on_the_calculator_raises_the_held_out_reward(tmp_path: Path, seed: int) -> None:
    """A small model warmed up part of the way on the calculator's reference solutions (it calls the
    calculator twice but copies its numbers wrong a fifth of the time), then 20 RL steps of
    calculator episodes with speculation: the held-out reward (greedy episodes, 128 problems) rises
    beyond 2 standard errors of the difference. (`docs/environments.md` quotes the figures.)"""
    from trainer.rl.environments import CalculatorEnvironment
    from trainer.rl.warmup import DraftInitConfig, WarmupConfig, draft_init, supervised_warmup

    torch.set_num_threads(1)
    env = CalculatorEnvironment(digits=2)
    config = ModelConfig.tiny(
        vocab_size=TOK.vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    make_model(tmp_path / "init", config, seed=seed)
    supervised_warmup(tmp_path / "init", tmp_path / "warm", env, TOK, WarmupConfig(steps=150, batch_size=32, lr=3e-3))
    draft_init(
        tmp_path / "warm",
        tmp_path / "policy",
        env,
        TOK,
        DraftInitConfig(prompts=256, steps=80, lr=3e-3, max_new_tokens=16),
    )
    cfg = RLConfig(
        model=tmp_path / "policy",
        task=TaskConfig(kind="calculator", digits=2, max_turns=4, max_episode_tokens=120),
        rollout=RolloutConfig(
            prompts_per_step=8, samples_per_prompt=8, temperature=1.0, max_new_tokens=16, speculation_k=3
        ),
        optimizer=HybridOptimizerConfig(lr=5e-4),
        sidecars=SidecarsConfig(local=1),
        steps=20,
        eval_every=20,
        eval_size=128,
        run_dir=tmp_path / "run",
    )
    history = train(cfg, progress=False)
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    before, after = first["reward/eval_mean"], history[-1]["reward/eval_mean"]
    spread = (first["reward/eval_stderr"] ** 2 + history[-1]["reward/eval_stderr"] ** 2) ** 0.5
    print(f"seed {seed}: held-out reward {before:.3f} -> {after:.3f} (2 SE of the difference: {2 * spread:.3f})")
    assert after - before > 2 * spread, (before, after, spread)
    assert all(m["rollout/tool_calls_mean"] > 1.5 for m in history)
    assert all(m["spec/acceptance_length"] > 1.0 and m["mismatch/logprob_abs_max"] < 1e-4 for m in history)
