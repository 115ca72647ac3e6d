"""Checkpoints whose config.json the engine does not implement are refused at start, naming the key.

Oracle: transformers itself. The checkpoints are written by its `save_pretrained` (the layout users
download); the keys its Qwen3 configuration declares are the keys the table must cover; and the
silently-wrong rows are shown to matter by transformers' own forward changing with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from click.testing import CliRunner

from sidecar.engine.torch_engine import TorchEngine
from sidecar.errors import CheckpointError
from sidecar.model.architectures import (
    CONFIG_KEYS,
    FAMILIES,
    UnsupportedConfigError,
    architectures_markdown,
    check_config,
)
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.model import ModelConfig

SHAPE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def hf_checkpoint(path: Path, config_cls: Any, model_cls: Any, **overrides: Any) -> Path:
    torch.manual_seed(0)
    model_cls(config_cls(**(SHAPE | overrides))).save_pretrained(path)
    return path


ROWS = {
    "hidden_act": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"hidden_act": "gelu"}, "hidden_act"),
    "sliding_window": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        "use_sliding_window",
    ),
    "attention_bias": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        {"attention_bias": True},
        "attention_bias",
    ),
    "qwen2_sliding_window": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        "use_sliding_window",
    ),
    "llama_attention_bias": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"attention_bias": True},
        "attention_bias",
    ),
    "llama_mlp_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"mlp_bias": True}, "mlp_bias"),
    "llama_linear_rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
        "rope_type 'linear'",
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        "architecture 'MixtralForCausalLM'",
    ),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_a_checkpoint_the_engine_does_not_implement_is_refused_naming_the_key(tmp_path: Path, row: str) -> None:
    config_cls, model_cls, overrides, needle = ROWS[row]
    path = hf_checkpoint(tmp_path / row, config_cls, model_cls, **overrides)
    with pytest.raises(CheckpointError, match=needle) as caught:
        TorchEngine.from_checkpoint(path)
    assert "upported: Qwen3ForCausalLM (model_type qwen3), Qwen2ForCausalLM" in str(caught.value)
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(path)  # the loader every other entry point (trainer, verify, SGLang adapter) uses


def test_serve_ends_in_one_error_line_naming_the_key(tmp_path: Path) -> None:
    from trainer.cli.main import main

    path = hf_checkpoint(tmp_path / "gelu", transformers.Qwen3Config, transformers.Qwen3ForCausalLM, hidden_act="gelu")
    result = CliRunner().invoke(main, ["serve", "--model", str(path), "--port", "0"])
    assert result.exit_code != 0 and "hidden_act" in result.output and "Traceback" not in result.output, result.output


def test_verify_refuses_to_certify_a_model_the_engine_does_not_implement(tmp_path: Path) -> None:
    from trainer.cli.main import main

    path = hf_checkpoint(
        tmp_path / "swa", transformers.Qwen3Config, transformers.Qwen3ForCausalLM, use_sliding_window=True
    )
    result = CliRunner().invoke(main, ["verify", "--sidecar", "127.0.0.1:1", "--model", str(path)])
    assert result.exit_code != 0 and "use_sliding_window" in result.output and "Traceback" not in result.output


def _logits(family: str, overrides: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
    config_cls, model_cls = FAMILY_CLASSES[family]
    torch.manual_seed(0)
    with torch.no_grad():
        return model_cls(config_cls(**(SHAPE | overrides))).eval()(ids).logits


FAMILY_CLASSES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
}


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("qwen3", {"hidden_act": "gelu"}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
        ("llama", {"mlp_bias": True}),
    ],
)
def test_the_refused_values_change_transformers_forward(family: str, overrides: dict[str, Any]) -> None:
    """The refusals are needed: at the same weights transformers computes another distribution."""
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(1))
    plain = _logits(family, {}, ids)
    other = _logits(family, overrides, ids)
    assert (plain - other).abs().max() > 1e-3


@pytest.mark.parametrize("family", list(FAMILY_CLASSES))
def test_the_table_covers_every_key_transformers_config_declares(family: str) -> None:
    declared = set(FAMILY_CLASSES[family][0].__annotations__)
    covered = {k.key for k in CONFIG_KEYS}
    assert declared - covered == set(), "add these keys to sidecar/model/architectures.py CONFIG_KEYS"


@pytest.mark.parametrize("family", list(FAMILY_CLASSES))
def test_save_pretrained_checkpoints_of_every_family_load_as_their_family(tmp_path: Path, family: str) -> None:
    config_cls, model_cls = FAMILY_CLASSES[family]
    config, _ = load_checkpoint(hf_checkpoint(tmp_path / family, config_cls, model_cls))
    assert config.family == family and config.architectures == [model_cls.__name__]
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config  # specrl's own config.json of that family
    reads = FAMILIES[model_cls.__name__].reads  # keys the family's config.json sets (GLM-4.5's): no contradiction
    if "use_qk_norm" not in reads:
        with pytest.raises(ValueError, match="qk_norm=.* contradicts"):  # the fields describe the family's attention
            ModelConfig.tiny(architectures=[model_cls.__name__], qk_norm=not config.qk_norm)
    if "attention_bias" not in reads:
        with pytest.raises(ValueError, match="attention_bias=.* contradicts"):
            ModelConfig.tiny(architectures=[model_cls.__name__], attention_bias=not config.attention_bias)


def test_what_save_pretrained_writes_for_the_implemented_model_is_accepted(tmp_path: Path) -> None:
    path = hf_checkpoint(tmp_path / "ok", transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
    config, _ = load_checkpoint(path)
    assert config.architectures == ["Qwen3ForCausalLM"]
    check_config(ModelConfig.tiny().to_hf_dict())  # specrl's own checkpoints


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"model_type": "llama"}, "model_type 'llama' contradicts"),
        ({"model_type": "mistral", "architectures": None}, "model_type 'mistral'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "linear"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope"),
    ],
)
def test_other_unimplemented_values_are_refused_by_name(raw: dict[str, Any], needle: str) -> None:
    base = ModelConfig.tiny().to_hf_dict()
    with pytest.raises(UnsupportedConfigError, match=needle):
        ModelConfig.from_hf_dict(base | raw)
    with pytest.raises(ValueError, match="architecture 'MixtralForCausalLM'"):
        ModelConfig.tiny(architectures=["MixtralForCausalLM"])


def test_the_readme_lists_every_architecture_the_engine_serves() -> None:
    """README.md's table of supported architectures is the registry's (`architectures_markdown`), and
    the README keeps within its 550 lines."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert architectures_markdown() in readme, "paste architectures_markdown() into README.md's 'Which checkpoints'"
    assert all(f"`{a}`" in architectures_markdown() for a in FAMILIES)
    assert len(readme.splitlines()) <= 550


def test_a_key_the_familys_modeling_code_does_not_read_is_not_refused(tmp_path: Path) -> None:
    """Qwen2 hard-codes its q/k/v biases: `attention_bias: true` (MiMo's config.json has it) does not
    change transformers' Qwen2 forward, so it is accepted there, and refused for Llama, where it would
    put a bias on o_proj too."""
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits("qwen2", {}, ids), _logits("qwen2", {"attention_bias": True}, ids))
    path = hf_checkpoint(tmp_path / "q2", transformers.Qwen2Config, transformers.Qwen2ForCausalLM, attention_bias=True)
    config, _ = load_checkpoint(path)
    assert config.attention_bias and config.family == "qwen2"
    with pytest.raises(UnsupportedConfigError, match="attention_bias"):
        check_config(ModelConfig.tiny(architectures=["LlamaForCausalLM"]).to_hf_dict() | {"attention_bias": True})
