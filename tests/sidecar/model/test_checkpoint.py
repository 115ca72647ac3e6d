"""The checkpoint naming contract, save/load round trips, Hugging Face interoperability and
malformed checkpoints. Oracle for the model itself: transformers' Qwen3ForCausalLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from sidecar.engine.torch_engine import TorchEngine
from sidecar.errors import CheckpointError, InvalidRequestError
from sidecar.model.checkpoint import (
    MTP_PREFIX,
    draft_tensor_names,
    load_checkpoint,
    model_state_dict,
    save_checkpoint,
    target_tensor_names,
)
from sidecar.model.model import ModelConfig, build_model
from sidecar.types import GenerationRequest, SamplingParams


def hf_model(tmp_path: Path, **overrides) -> tuple[Qwen3ForCausalLM, Path]:
    kw = dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**kw)).eval()
    with torch.no_grad():  # HF zero-initialises nothing we care about, but make norms non-trivial
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path = tmp_path / "hf"
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
    ],
    ids=["untied", "tied", "yarn"],
)
def test_transformers_qwen3_checkpoint_loads_with_identical_logits(tmp_path: Path, overrides) -> None:
    hf, path = hf_model(tmp_path, **overrides)
    config, tensors = load_checkpoint(path)
    assert config.num_nextn_predict_layers == 0
    model = build_model(config)
    model.load_state_dict(tensors, strict=True)
    ids = torch.randint(0, config.vocab_size, (2, 300))  # beyond the yarn original context
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_checkpoint_without_mtp_serves_plain_decoding_only(tmp_path: Path) -> None:
    hf, path = hf_model(tmp_path)
    engine = TorchEngine.from_checkpoint(path, speculation_k=3)
    assert engine.info().speculation_method == "" and engine.speculation_k == 0
    prompt = [1, 2, 3, 4]
    (s,) = engine.generate(
        GenerationRequest(prompts=[prompt], sampling=SamplingParams(temperature=0, max_new_tokens=8))
    )
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 4:].tolist()
    assert s.token_ids == expected
    with pytest.raises(InvalidRequestError, match="no MTP draft layers"):
        engine.validate(GenerationRequest(prompts=[prompt], speculation_k=2))
    with pytest.raises(ValueError, match="no MTP layers"):
        engine.set_speculation_k(1)


def test_model_parameters_are_exactly_the_contract_names() -> None:
    for cfg in (ModelConfig.tiny(), ModelConfig.tiny(tie_word_embeddings=True, num_nextn_predict_layers=2)):
        names = set(model_state_dict(build_model(cfg)))
        target, draft = target_tensor_names(cfg), draft_tensor_names(cfg)
        assert names == set(target) | set(draft) and not set(target) & set(draft)
        assert all(n.startswith(MTP_PREFIX) for n in draft)
        assert ("lm_head.weight" in target) == (not cfg.tie_word_embeddings)
    cfg = ModelConfig.tiny()
    assert f"{MTP_PREFIX}0.eh_proj.weight" in draft_tensor_names(cfg)
    assert f"{MTP_PREFIX}0.shared_head.norm.weight" in draft_tensor_names(cfg)
    assert f"{MTP_PREFIX}0.self_attn.q_norm.weight" in draft_tensor_names(cfg)
    assert dict(model_state_dict(build_model(cfg)))[f"{MTP_PREFIX}0.eh_proj.weight"].shape == (64, 128)


def test_save_load_round_trip_and_config_dict(tmp_path: Path) -> None:
    cfg = ModelConfig.tiny(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})
    model = build_model(cfg, seed=3)
    save_checkpoint(tmp_path / "ck", cfg, model_state_dict(model))
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3ForCausalLM"] and raw["num_nextn_predict_layers"] == 1
    cfg2, tensors = load_checkpoint(tmp_path / "ck")
    assert cfg2 == cfg and ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    for name, t in model_state_dict(model).items():
        assert torch.equal(tensors[name], t)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    cfg = ModelConfig.tiny()
    sd = model_state_dict(build_model(cfg, seed=4))
    names = sorted(sd)
    half = len(names) // 2
    path = tmp_path / "sharded"
    path.mkdir()
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, ns in shards.items():
        save_file({n: sd[n].contiguous() for n in ns}, str(path / file))
    weight_map = {n: f for f, ns in shards.items() for n in ns}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    _, tensors = load_checkpoint(path)
    assert all(torch.equal(tensors[n], sd[n]) for n in names)


def corrupt(path: Path, how: str) -> None:
    cfg = ModelConfig.tiny()
    sd = model_state_dict(build_model(cfg, seed=5))
    save_checkpoint(path, cfg, sd)
    weights, config = path / "model.safetensors", path / "config.json"
    if how == "no config":
        config.unlink()
    elif how == "bad json":
        config.write_text("{not json")
    elif how == "config key missing":
        d = json.loads(config.read_text())
        del d["hidden_size"]
        config.write_text(json.dumps(d))
    elif how == "invalid config":
        d = json.loads(config.read_text())
        d["num_key_value_heads"] = 3
        config.write_text(json.dumps(d))
    elif how == "no weights":
        weights.unlink()
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "missing tensor":
        save_file({n: t for n, t in sd.items() if n != "model.norm.weight"}, str(weights))
    elif how == "unknown tensor":
        save_file({**sd, "model.layers.9.mlp.up_proj.weight": torch.zeros(2)}, str(weights))
    elif how == "wrong shape":
        save_file({**sd, "model.norm.weight": torch.ones(3)}, str(weights))


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("no config", "config.json: missing"),
        ("bad json", "not valid JSON"),
        ("config key missing", "'hidden_size' is missing"),
        ("invalid config", "num_key_value_heads must divide"),
        ("no weights", "neither model.safetensors"),
        ("truncated", "truncated or corrupt"),
        ("missing tensor", "missing, e.g. \\['model.norm.weight'\\]"),
        ("unknown tensor", "does not describe"),
        ("wrong shape", "model.norm.weight has shape \\[3\\]"),
    ],
)
def test_malformed_checkpoints_raise_checkpoint_error(tmp_path: Path, how: str, message: str) -> None:
    corrupt(tmp_path / "ck", how)
    with pytest.raises(CheckpointError, match=message):
        TorchEngine.from_checkpoint(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
