"""`specrl draft-init` on a checkpoint without MTP layers grafts one (`trainer.draft.mtp_graft`) and fits it.

Oracles: the trunk's tensors it was copied from and closed forms (unit norms; eh_proj passing the
hidden state, so the next token's embedding cannot change the draft before the fit); plain greedy
decoding with the full forward pass of the *original* plain checkpoint (what `specrl serve` on
the grafted checkpoint must produce at k = 3, token for token); the acceptance length the
sidecar counts (τ = generated tokens / verify steps) on held-out prompts. How other starts compare
after the same fit: tools/bench/graft_starts.py (docs/checkpoints.md's table).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from sidecar.client.client import SidecarClient
from sidecar.engine.config import EngineConfig
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.model import ModelConfig, build_model
from sidecar.serve_config import ServeConfig
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar_fixtures import greedy_reference
from trainer.cli.main import main
from trainer.draft.mtp_graft import graft_mtp_layer
from trainer.rl.local_sidecars import LocalSidecars
from trainer.rl.tasks import ArithmeticTask
from trainer.rl.warmup import (
    DraftInitConfig,
    WarmupConfig,
    acceptance_length,
    draft_init,
    make_model,
    supervised_warmup,
)
from trainer.tokenizer import CharTokenizer

TASK = ArithmeticTask(regime="zero", digits=2)
TOK = CharTokenizer()


def plain(**overrides: object) -> ModelConfig:
    """The RL-loop tests' tiny shape, without MTP layers (a plain model, as transformers writes one)."""
    shape: dict[str, object] = {"hidden_size": 64, "intermediate_size": 192, "max_position_embeddings": 128}
    return ModelConfig.tiny(
        vocab_size=TOK.vocab_size, tie_word_embeddings=True, num_nextn_predict_layers=0, **(shape | overrides)
    )


def test_a_mimo_graft_is_in_mimos_layout_hidden_state_first(tmp_path: Path) -> None:
    config, tensors = load_checkpoint(make_model(tmp_path / "plain", plain(architectures=["MiMoForCausalLM"]), seed=1))
    grafted, out = graft_mtp_layer(config, tensors)
    h, p = config.hidden_size, "model.mtp_layers.0."
    assert torch.equal(out[p + "input_proj.weight"], torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
    assert torch.equal(out[p + "final_layernorm.weight"], tensors["model.norm.weight"])
    assert torch.equal(out[p + "self_attn.q_proj.bias"], tensors["model.layers.1.self_attn.q_proj.bias"])
    model = build_model(grafted)
    model.load_state_dict(out, strict=True)
    ids = torch.tensor([TOK.encode("12+34=?\n46")])
    other = ids.clone()
    other[0, 1:] = (other[0, 1:] + 7) % TOK.vocab_size
    hidden = model.hidden_states(ids)  # the hidden state alone passes: the next token's embedding cannot move it
    assert torch.allclose(model.mtp_logits(ids, hidden), model.mtp_logits(other, hidden), atol=1e-6)


def test_the_grafted_layer_starts_from_the_trunks_last_layer_and_its_hidden_state(tmp_path: Path) -> None:
    config, tensors = load_checkpoint(make_model(tmp_path / "plain", plain(num_hidden_layers=3), seed=1))
    grafted, out = graft_mtp_layer(config, tensors)
    assert grafted.num_nextn_predict_layers == 1 and config.num_nextn_predict_layers == 0
    assert all(torch.equal(out[n], t) for n, t in tensors.items())  # the trunk is untouched
    h, p = config.hidden_size, "mtp.layers.0."
    for sub in ("self_attn.q_proj.weight", "self_attn.k_norm.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
        assert torch.equal(out[p + sub], tensors["model.layers.2." + sub])  # the last of 3 layers
    assert torch.equal(out[p + "enorm.weight"], torch.ones(h)) and torch.equal(out[p + "hnorm.weight"], torch.ones(h))
    assert torch.equal(out[p + "shared_head.norm.weight"], tensors["model.norm.weight"])
    assert torch.equal(out[p + "eh_proj.weight"], torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1))

    # before any fit the draft reads the hidden state alone: the next token's embedding cannot move it
    model = build_model(grafted)
    model.load_state_dict(out, strict=True)
    ids = torch.tensor([TOK.encode("12+34=?\n46")])
    other = ids.clone()
    other[0, 1:] = (other[0, 1:] + 7) % TOK.vocab_size  # every "next token" changed, the states kept
    hidden = model.hidden_states(ids)
    assert torch.allclose(model.mtp_logits(ids, hidden), model.mtp_logits(other, hidden), atol=1e-6)
    with pytest.raises(ValueError, match="already has 1 MTP layer"):
        graft_mtp_layer(grafted, out)


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [TOK.encode(TASK.sample(rng, "eval").prompt) for _ in range(n)]


@pytest.mark.slow
def test_draft_init_grafts_a_layer_that_specrl_serve_serves_losslessly(tmp_path: Path) -> None:
    start = make_model(tmp_path / "plain", plain(), seed=0)
    (start / "generation_config.json").write_text(json.dumps({"eos_token_id": TOK.eos_id}))
    args = ["draft-init", "--model", str(start), "--out", str(tmp_path / "grafted"), "--prompts", "16"]
    result = CliRunner().invoke(main, [*args, "--steps", "3", "--batch-size", "8", "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert f"wrote {tmp_path / 'grafted'}" in result.output

    config, grafted = load_checkpoint(tmp_path / "grafted")
    raw = json.loads((tmp_path / "grafted" / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1 and config.num_nextn_predict_layers == 1
    assert (tmp_path / "grafted" / "generation_config.json").read_text() == (
        start / "generation_config.json"
    ).read_text()
    plain_config, trunk = load_checkpoint(start)
    assert all(torch.equal(grafted[n], t) for n, t in trunk.items())  # draft-init leaves the trunk alone
    assert {n for n in grafted if n.startswith("mtp.layers.0.")}  # and the draft is in the checkpoint

    prompts = _prompts(6)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=(TOK.eos_id,))
    serve = ServeConfig(engine=EngineConfig(speculation_k=3))
    with LocalSidecars(tmp_path / "grafted", 1, tmp_path / "logs", serve=serve) as local:  # `specrl serve`
        client = SidecarClient(local.start()[0])
        info = client.info().engine
        assert (info.speculation_method, info.speculation_k) == ("mtp", 3)
        samples = client.generate(GenerationRequest(prompts=prompts, sampling=sampling, speculation_k=3))
        client.close()
    assert sum(s.counters.verify_steps for s in samples) > 0  # it did speculate
    for s in samples:
        want = greedy_reference(trunk, prompts[s.prompt_index], 20, config=plain_config, stop=TOK.eos_id)
        assert s.token_ids == want, s.prompt_index


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "MiMoForCausalLM"])
def test_a_grafted_fitted_draft_accepts_more_than_two_tokens_a_step_on_the_arithmetic_task(
    tmp_path: Path, architecture: str
) -> None:
    """The RL-loop tests' warmed tiny model (2 layers, hidden 64), without MTP layers, grafted and
    fitted with draft-init's default budget; τ at k = 3 and the demo's temperature 1. MiMo: a Qwen2
    trunk, its draft grafted, fitted and served in MiMo's own layout (`model.mtp_layers.0.*`)."""
    torch.set_num_threads(1)
    make_model(tmp_path / "init", plain(architectures=[architecture]), seed=0)
    supervised_warmup(tmp_path / "init", tmp_path / "warm", TASK, TOK, WarmupConfig(steps=150, batch_size=32, lr=3e-3))
    losses = draft_init(tmp_path / "warm", tmp_path / "policy", TASK, TOK, DraftInitConfig(prompts=256))
    assert losses[-1] < 0.2 * losses[0], losses
    config, tensors = load_checkpoint(tmp_path / "policy")
    prefix = "model.mtp_layers.0." if architecture == "MiMoForCausalLM" else "mtp.layers.0."
    assert config.num_nextn_predict_layers == 1 and any(n.startswith(prefix) for n in tensors)
    _, warm = load_checkpoint(tmp_path / "warm")
    assert all(torch.equal(warm[n], tensors[n]) for n in warm)  # the trunk untouched
    kw = {"k": 3, "temperature": 1.0, "max_new_tokens": 24, "stop": TOK.eos_id}
    tau = acceptance_length(tmp_path / "policy", _prompts(32), **kw)  # type: ignore[arg-type]
    assert tau > 2.0, tau


@pytest.mark.slow
@pytest.mark.long
def test_on_the_demo_model_a_grafted_fitted_draft_accepts_more_than_two_tokens_a_step(tmp_path: Path) -> None:
    """The demo's model (24 layers, width 128) without its MTP layer, warmed up and draft-initialised
    as the demo does it (minutes on a 2-core CPU: the first row of docs/checkpoints.md's table)."""
    from trainer.cli.demo import DemoConfig, demo_model_config

    torch.set_num_threads(1)
    demo = DemoConfig()
    config = dataclasses.replace(demo_model_config(demo.layers), num_nextn_predict_layers=0)
    make_model(tmp_path / "init", config, seed=0)
    supervised_warmup(tmp_path / "init", tmp_path / "warm", TASK, TOK, demo.warmup)
    draft_init(tmp_path / "warm", tmp_path / "policy", TASK, TOK, demo.draft_init)
    kw = {"k": 3, "temperature": 1.0, "max_new_tokens": 40, "stop": TOK.eos_id}
    tau = acceptance_length(tmp_path / "policy", _prompts(32), **kw)  # type: ignore[arg-type]
    assert tau > 2.0, tau
