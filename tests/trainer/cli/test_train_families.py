"""`specrl train` on a tiny Qwen2 and a tiny Llama (llama3-scaled) checkpoint, each with a draft:
ten RL steps on the built-in arithmetic task, the held-out reward logged.

The checkpoints are transformers' `save_pretrained` of a random model sized to the built-in
character tokenizer (no tokenizer shipped: `specrl train` uses that one); `specrl draft-init`
grafts an MTP layer onto each and fits it on the policy's own completions, as a user would run it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner

from tests.family_fixtures import LLAMA3, randomise
from trainer.cli.main import main
from trainer.tokenizer import CharTokenizer

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)  # fmt: skip
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_parameters": LLAMA3}),
}


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_specrl_train_runs_ten_steps_with_a_draft(tmp_path: Path, family: str) -> None:
    config_cls, model_cls, overrides = FAMILIES[family]
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, **SHAPE, **overrides))
    randomise(model, 0)
    model.save_pretrained(tmp_path / "hf")
    runner = CliRunner()
    init = ["draft-init", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "policy")]
    result = runner.invoke(main, [*init, "--prompts", "32", "--steps", "10", "--batch-size", "8"])
    assert result.exit_code == 0, result.output
    raw = json.loads((tmp_path / "policy" / "config.json").read_text())
    assert raw["architectures"] == [model_cls.__name__] and raw["num_nextn_predict_layers"] == 1

    args = ["train", "--model", str(tmp_path / "policy"), "--local-sidecars", "1", "--run-dir", str(tmp_path / "run")]
    args += ["--set", "steps=10", "--set", "eval_every=10", "--set", "eval_size=8"]
    args += ["--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2"]
    args += ["--set", "rollout.max_new_tokens=12", "--set", "algorithm.filter_equal_groups=false"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "done: 10 steps" in result.output
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["step"] == 10 and "reward/eval_mean" in last
    assert last["mismatch/logprob_abs_max"] < 1e-4  # the trainer's log-probs are the sidecar's
    assert all(r["spec/acceptance_length"] > 1.0 for r in rows if "spec/acceptance_length" in r)  # it speculated
    assert any("spec/acceptance_length" in r for r in rows)
    assert any("draft" in k and k.startswith("train/") for k in last)  # and trained the draft online


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_draft_init_fits_an_eagle3_draft_that_serves_transformers_greedy(tmp_path: Path, family: str) -> None:
    """`specrl draft-init --draft-kind eagle3` on a save_pretrained checkpoint of the family: the
    draft directory it writes, served with `--draft`, speculates and keeps transformers' greedy."""
    from sidecar.engine.torch_engine import TorchEngine
    from sidecar.types import GenerationRequest, SamplingParams

    config_cls, model_cls, overrides = FAMILIES[family]
    tok = CharTokenizer()
    torch.manual_seed(0)
    shape = SHAPE | {"num_hidden_layers": 4}  # three taps below the last layer
    model = model_cls(config_cls(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, **shape, **overrides)).eval()
    randomise(model, 0)
    model.save_pretrained(tmp_path / "hf")
    args = ["draft-init", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "draft"), "--draft-kind", "eagle3"]
    result = CliRunner().invoke(main, [*args, "--prompts", "16", "--steps", "3", "--batch-size", "8"])
    assert result.exit_code == 0, result.output
    engine = TorchEngine.from_checkpoint(tmp_path / "hf", draft=tmp_path / "draft", speculation_k=3)
    assert engine.info().speculation_method == "eagle3"
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7], [60, 61]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    samples = engine.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=3))
    with torch.no_grad():
        for prompt, s in zip(prompts, samples, strict=True):
            seq = list(prompt)
            for _ in range(12):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            assert s.token_ids == seq[len(prompt) :]
    assert sum(s.counters.verify_steps for s in samples) > 0
