"""Resume from a checkpoint continues bit for bit: weights, both optimizers, step and RNGs.

Saving and loading are `trainer/policy/checkpointing.py`'s.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from muon import HybridOptimizerConfig
from sidecar.errors import CheckpointError
from sidecar.model.checkpoint import load_checkpoint, model_state_dict
from sidecar.model.model import ModelConfig, build_model
from trainer.draft.objective import DraftConfig
from trainer.policy.policy import Policy, TrainBatch


def _batches(mc: ModelConfig, n: int) -> list[TrainBatch]:
    gen = torch.Generator().manual_seed(123)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, mc.vocab_size, (3, 16), generator=gen)
        mask = torch.zeros(3, 15)
        mask[:, 4:] = 1.0
        out.append(TrainBatch(tokens=tokens, mask=mask, advantages=torch.randn(3, generator=gen)))
    return out


def _cfg() -> Policy.Config:
    return Policy.Config(
        optimizer=HybridOptimizerConfig(lr=1e-2), draft=DraftConfig(optimizer=HybridOptimizerConfig(lr=1e-2)), seed=77
    )


def _draws() -> tuple[float, float, float]:
    return torch.rand(()).item(), random.random(), float(np.random.rand())


def test_resume_continues_bit_for_bit(tmp_path: Path) -> None:
    mc = ModelConfig.tiny()
    state = model_state_dict(build_model(mc, seed=2))
    batches = _batches(mc, 4)

    a = Policy(mc, _cfg(), dict(state))
    for b in batches[:2]:
        a.train_step(b)
    a.save(tmp_path / "ckpt")
    draws_a = _draws()
    metrics_a = [a.train_step(b) for b in batches[2:]]
    final_a = dict(a.export_named_tensors())

    torch.manual_seed(999)  # disturb every RNG; load must restore them
    random.seed(999)
    np.random.seed(999)
    b_policy = Policy(mc, _cfg(), dict(state))  # fresh: untrained weights and empty optimizer state
    b_policy.load(tmp_path / "ckpt")
    assert b_policy.step_count == 2
    assert _draws() == draws_a
    metrics_b = [b_policy.train_step(b) for b in batches[2:]]
    final_b = dict(b_policy.export_named_tensors())

    assert metrics_a == metrics_b
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), name
    # the run actually trained (else equality would be trivial)
    assert not torch.equal(
        final_a["model.layers.0.self_attn.q_proj.weight"], state["model.layers.0.self_attn.q_proj.weight"]
    )


def test_serving_checkpoint_round_trips_through_the_engine_loader(tmp_path: Path) -> None:
    mc = ModelConfig.tiny()
    state = model_state_dict(build_model(mc, seed=4))
    policy = Policy(mc, _cfg(), dict(state))
    policy.save_hf(tmp_path / "hf")
    loaded_config, tensors = load_checkpoint(tmp_path / "hf")
    assert loaded_config == mc
    assert tensors.keys() == state.keys() and all(torch.equal(tensors[k], state[k]) for k in state)


def test_load_missing_checkpoint_names_the_file(tmp_path: Path) -> None:
    mc = ModelConfig.tiny(num_nextn_predict_layers=0)
    policy = Policy(mc, _cfg(), model_state_dict(build_model(mc, seed=4)))
    with pytest.raises(CheckpointError, match=r"rank00000\.pt"):
        policy.load(tmp_path / "nowhere")
