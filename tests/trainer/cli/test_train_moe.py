"""`specrl train` on a tiny Qwen3-MoE checkpoint with a draft: RL steps on the built-in arithmetic
task end to end (the Megatron MoE policy, the push of every expert, speculation on the sidecar).

The checkpoint is transformers' `save_pretrained` of a random `Qwen3MoeForCausalLM` sized to the
built-in character tokenizer; `specrl draft-init` grafts an MTP layer (a sparse layer itself: a copy
of the last, routed, layer) and fits it on the policy's own completions, as a user would run it.
Run with routing replay off and on (`algorithm.routing_replay=rollout`: the sidecar returns every
sample's routes, the trainer's routers replay them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner

from tests.family_fixtures import randomise
from trainer.cli.main import main
from trainer.tokenizer import CharTokenizer

SHAPE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)  # fmt: skip


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("replay", ["off", "rollout"])
def test_specrl_train_runs_an_moe_policy_with_a_draft(tmp_path: Path, replay: str) -> None:
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, **SHAPE)
    )
    randomise(model, 0)
    model.save_pretrained(tmp_path / "hf")
    runner = CliRunner()
    init = ["draft-init", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "policy")]
    result = runner.invoke(main, [*init, "--prompts", "32", "--steps", "10", "--batch-size", "8"])
    assert result.exit_code == 0, result.output
    raw = json.loads((tmp_path / "policy" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3MoeForCausalLM"] and raw["num_nextn_predict_layers"] == 1

    args = ["train", "--model", str(tmp_path / "policy"), "--local-sidecars", "1", "--run-dir", str(tmp_path / "run")]
    args += ["--set", "steps=6", "--set", "eval_every=6", "--set", "eval_size=8"]
    args += ["--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2"]
    args += ["--set", "rollout.max_new_tokens=12", "--set", "algorithm.filter_equal_groups=false"]
    args += ["--set", f"algorithm.routing_replay={replay}"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "done: 6 steps" in result.output
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 6 and "reward/eval_mean" in rows[-1]
    gaps = [r["mismatch/logprob_abs_max"] for r in rows if "mismatch/logprob_abs_max" in r]
    assert len(gaps) == 6 and max(gaps) < 1e-4  # the trainer's log-probs are the sidecar's, every step
    assert any(r.get("spec/acceptance_length", 0.0) > 1.0 for r in rows)  # it speculated
    agreement = [r["train/routing_agreement"] for r in rows if "train/routing_agreement" in r]
    if replay == "rollout":  # the live router agrees with the sampler's routes it replays (float32, equal weights)
        assert len(agreement) == 6 and min(agreement) > 0.99, agreement
    else:
        assert agreement == []
