"""The served model's shape: `ModelConfig`, the config.json keys of the checkpoint contract.

Read from a Hugging Face config.json (`from_hf_dict`, which refuses what the engine does not
implement: `architectures.check_config`) and written back (`to_hf_dict`); its attention variants
(`attention_bias`, `qk_norm`) and MTP layout (`mtp_layout`) are the family's
(`architectures.FAMILIES`). The model (`model.py`), the naming contract (`checkpoint.py`) and the
trainer read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from sidecar.model.architectures import check_config, family_of
from yarn import RopeConfig

_FAMILY_FIELDS = ("attention_bias", "qk_norm", "mtp_layout")
"""The fields the family decides (`architectures.Family`), never config.json keys of their own."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of the model; the fields are the config.json keys of the checkpoint contract."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    """None for plain RoPE, or a Hugging Face rope_scaling dict (e.g. rope_type "yarn")."""
    max_position_embeddings: int = 4096
    """Context length: prompt + generated tokens never exceed it."""
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    """"float32", "bfloat16" or "float16": the dtype weights are stored and computed in."""
    num_nextn_predict_layers: int = 0
    """Number of MTP (draft) layers; 0 means the model cannot speculate."""
    architectures: list[str] = field(default_factory=lambda: ["Qwen3ForCausalLM"])
    """config.json's `architectures`: the family (`architectures.FAMILIES`), whose attention the
    two fields below must describe (`from_hf_dict` and `tiny` set them from it)."""
    attention_bias: bool = False
    """Biases on the q, k and v projections, never on o_proj (Qwen2; GLM-4.5's `attention_bias`)."""
    qk_norm: bool = True
    """Per-head RMSNorm on q and k before the rotary embedding (Qwen3)."""
    mtp_layout: str = "specrl"
    """The MTP layers' layout: "specrl" (`mtp.layers.*`) or "mimo" (`model.mtp_layers.*`, hidden state first)."""
    eos_token_id: list[int] = field(default_factory=list)
    """End-of-sequence ids (config.json's eos_token_id, an int or a list there); may be empty."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads must divide num_attention_heads ({self.num_attention_heads}), "
                f"got {self.num_key_value_heads}"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number (rotary pairs), got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.max_position_embeddings < 2:
            raise ValueError(f"max_position_embeddings must be >= 2, got {self.max_position_embeddings}")
        if self.torch_dtype not in _DTYPES:
            raise ValueError(f"torch_dtype must be one of {sorted(_DTYPES)}, got {self.torch_dtype!r}")
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in self.eos_token_id):
            raise ValueError(
                f"eos_token_id must hold token ids in [0, {self.vocab_size}), got {self.eos_token_id}; "
                "fix eos_token_id in config.json"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"rope_scaling must be null or a dict, got {self.rope_scaling!r}")
        family = family_of(self.architectures)
        for name in _FAMILY_FIELDS:
            if getattr(self, name) != getattr(family, name):
                raise ValueError(
                    f"{name}={getattr(self, name)} contradicts architectures {self.architectures}, whose "
                    f"modeling code has {name}={getattr(family, name)}; set it so or name another architecture"
                )

    @property
    def family(self) -> str:
        """The architecture's family name (its model_type, e.g. "qwen2"), as GetInfo reports it."""
        return family_of(self.architectures).model_type

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    def rope_config(self) -> RopeConfig:
        """The rotary settings shared by trunk and MTP layers (YaRN when rope_scaling says so)."""
        return RopeConfig.from_hf(self.to_hf_dict())

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A small valid config for tests: vocab 64, hidden 64, 2 layers, 4/2 heads, 1 MTP layer."""
        base: dict[str, Any] = dict(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_theta=10_000.0,
            max_position_embeddings=512,
            num_nextn_predict_layers=1,
        )
        base.update(overrides)
        family = family_of(base.get("architectures"))
        for name in _FAMILY_FIELDS:
            base.setdefault(name, getattr(family, name))
        return cls(**base)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4 or 5 layout). Every key that changes
        the forward is read or, where the engine does not implement its value, refused
        (`UnsupportedConfigError`, a ValueError naming it: `architectures.CONFIG_KEYS`); other keys do
        not change transformers' forward either and are ignored."""
        check_config(d)
        d = dict(d)
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        params = d.get("rope_parameters")  # transformers >= 5 folds theta and scaling in here
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            kind = params.get("rope_type", params.get("type", "default"))
            if kind != "default" and rope_scaling is None:
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        heads = d["num_attention_heads"]
        out: dict[str, Any] = {
            "vocab_size": d["vocab_size"],
            "hidden_size": d["hidden_size"],
            "intermediate_size": d["intermediate_size"],
            "num_hidden_layers": d["num_hidden_layers"],
            "num_attention_heads": heads,
            "num_key_value_heads": d.get("num_key_value_heads") or heads,
            "head_dim": d.get("head_dim") or d["hidden_size"] // heads,
            "rms_norm_eps": d.get("rms_norm_eps", 1e-6),
            "rope_theta": float(rope_theta if rope_theta is not None else 10_000.0),
            "rope_scaling": rope_scaling,
            "max_position_embeddings": d.get("max_position_embeddings", 4096),
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
            "torch_dtype": d.get("torch_dtype") or d.get("dtype") or "float32",
            "num_nextn_predict_layers": int(d.get("num_nextn_predict_layers") or 0),
        }
        family = family_of(list(d["architectures"]) if d.get("architectures") else None, d.get("model_type"))
        out["architectures"] = [family.architecture]
        out |= {name: getattr(family, name) for name in _FAMILY_FIELDS}
        eos = d.get("eos_token_id")
        if eos is not None:
            out["eos_token_id"] = [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
        return cls(**out)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json dict (the family's keys plus num_nextn_predict_layers); the attention's variants
        are the architecture's, named only where transformers reads a key (Qwen3's, Llama's attention_bias)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _FAMILY_FIELDS}
        d["model_type"] = self.family
        d["hidden_act"] = "silu"
        if not self.attention_bias:
            d["attention_bias"] = False
        return d
