"""What the engine implements of a Hugging Face config.json: one table, read by every entry point.

A checkpoint's config.json says which forward its weights were trained with. transformers' own
modeling code for the architecture is the oracle (`modeling_qwen3.py` for `Qwen3ForCausalLM`): every
key it reads that changes the forward is in `CONFIG_KEYS`, either *read* (implemented, tested against
transformers) or *refused unless* it holds the one value the engine implements. A key that is not
listed does not change transformers' forward of a supported architecture either (bookkeeping such
as `use_cache` or `initializer_range`), and is ignored as transformers ignores it.

`check_config(raw)` runs inside `ModelConfig.from_hf_dict`, so `specrl serve` (both engines), the
trainer's preflight and checkpoint loading, `specrl warmup` / `draft-init` and `specrl verify` all
refuse a model the engine would otherwise serve as something it is not (specrl's invariant 1: the
samples are the checkpoint's distribution). `docs/models.md` quotes this table
(`tools/gen_config_docs.py` writes it, a test keeps it current).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from yarn import RopeConfig


@dataclass(frozen=True, slots=True)
class Family:
    """What one architecture's forward is, in the variants the one decoder (`model.py`) implements.

    The engine's model, the naming contract (`checkpoint.py`) and the trainer's Megatron policy and
    bridge read `ModelConfig`'s fields, which `ModelConfig.from_hf_dict` sets from this descriptor;
    nothing else branches on the family."""

    architecture: str
    """config.json's `architectures` entry, e.g. "Qwen2ForCausalLM"."""
    model_type: str
    """config.json's `model_type`, e.g. "qwen2"; GetInfo's family."""
    attention_bias: bool
    """Biases on the q, k and v projections (never on o_proj), as the modeling code hard-codes or reads."""
    qk_norm: bool
    """RMSNorm on each query and key head before the rotary embedding."""
    native_draft: str
    """The draft layout a checkpoint of this family may carry, in words (the README's table)."""
    moe: str
    """Its experts, in words ("no": a dense SwiGLU MLP in every layer)."""
    tested_against: str
    """The oracle its tests compare with (the README's table)."""
    mtp_layout: str = "specrl"
    """Where and how its MTP draft layers are stored: "specrl" (`mtp.layers.{j}.*`, DeepSeek-V3 names,
    the embedding first in the fused input), or "mimo" (`model.mtp_layers.{j}.*`, the hidden state first)."""
    unread_keys: tuple[str, ...] = ()
    """Refusable keys its modeling code does not read (Qwen2 hard-codes its q/k/v biases: `attention_bias`
    does not change its forward)."""


FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        Family(
            "Qwen3ForCausalLM",
            "qwen3",
            attention_bias=False,
            qk_norm=True,
            moe="no",
            native_draft="none (specrl's `mtp.layers.*` by draft-init)",
            tested_against="transformers `Qwen3ForCausalLM`",
        ),
        Family(
            "Qwen2ForCausalLM",
            "qwen2",
            attention_bias=True,
            qk_norm=False,
            moe="no",
            native_draft="none (specrl's `mtp.layers.*` by draft-init)",
            tested_against="transformers `Qwen2ForCausalLM`",
            unread_keys=("attention_bias",),
        ),
        Family(
            "LlamaForCausalLM",
            "llama",
            attention_bias=False,
            qk_norm=False,
            moe="no",
            native_draft="none (specrl's `mtp.layers.*` by draft-init)",
            tested_against="transformers `LlamaForCausalLM` (llama3 rope)",
        ),
        Family(
            "MiMoForCausalLM",
            "mimo",
            attention_bias=True,
            qk_norm=False,
            moe="no",
            native_draft="MiMo MTP (`model.mtp_layers.*`, hidden state first)",
            tested_against="transformers `Qwen2ForCausalLM` (trunk), XiaomiMiMo's `modeling_mimo.py` (MTP)",
            mtp_layout="mimo",
            unread_keys=("attention_bias",),
        ),
    )
}
"""The engine's registry: config.json's `architectures` entry → its family, for every architecture served."""

SUPPORTED_ARCHITECTURES: dict[str, str] = {a: f.model_type for a, f in FAMILIES.items()}
"""config.json's `architectures` entry → its `model_type`, for every architecture the engine serves."""


class UnsupportedConfigError(ValueError):
    """config.json describes a forward the engine does not implement; the message names the keys."""


Rule = Literal["read", "refused unless", "ignored"]


@dataclass(frozen=True, slots=True)
class ConfigKey:
    """One config.json key and what the engine does with it."""

    key: str
    rule: Rule
    supported: str
    """The values the engine implements (for a refused key: the one it accepts), in words."""
    why: str
    """What the key does in transformers' forward, or why it does not matter."""
    accepts: Callable[[Any], bool] | None = None
    """For "refused unless": whether a present value is the implemented one (absent keys pass)."""


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


def _full_attention_only(v: Any) -> bool:
    return v is None or (isinstance(v, list) and all(t == "full_attention" for t in v))


def _absent_or_one(v: Any) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool) and float(v) == 1.0)


_ROPE_WHY = (
    "rotary base and scaling; rope types default, yarn and llama3 (`yarn/`, one implementation for engine and trainer)"
)

CONFIG_KEYS: tuple[ConfigKey, ...] = (
    ConfigKey(
        "architectures", "read", " / ".join(SUPPORTED_ARCHITECTURES), "which modeling code the weights belong to"
    ),
    ConfigKey("model_type", "read", " / ".join(sorted(set(SUPPORTED_ARCHITECTURES.values()))), "the same, as a type"),
    ConfigKey("vocab_size", "read", "any", "embedding and output-head rows"),
    ConfigKey("hidden_size", "read", "any", "residual width"),
    ConfigKey("intermediate_size", "read", "any", "SwiGLU width"),
    ConfigKey("num_hidden_layers", "read", "any", "decoder layers"),
    ConfigKey("num_attention_heads", "read", "any", "query heads"),
    ConfigKey("num_key_value_heads", "read", "a divisor of num_attention_heads (null: = heads)", "grouped-query KV"),
    ConfigKey("head_dim", "read", "even (null: hidden_size / heads)", "per-head width"),
    ConfigKey("rms_norm_eps", "read", "> 0", "every RMSNorm, q/k norms included"),
    ConfigKey("rope_theta", "read", "> 0", _ROPE_WHY),
    ConfigKey("rope_scaling", "read", "null, rope_type default, yarn or llama3", _ROPE_WHY),
    ConfigKey("rope_parameters", "read", "rope_type default, yarn or llama3 (transformers 5)", _ROPE_WHY),
    ConfigKey("max_position_embeddings", "read", ">= 2", "context length: prompt + generated tokens"),
    ConfigKey("tie_word_embeddings", "read", "true / false", "output head = embedding"),
    ConfigKey("torch_dtype", "read", "float32 / bfloat16 / float16", "dtype weights are stored and computed in"),
    ConfigKey("dtype", "read", "float32 / bfloat16 / float16", "transformers 5's name for torch_dtype"),
    ConfigKey("eos_token_id", "read", "ids in the vocabulary (int or list)", "where a sample ends"),
    ConfigKey(
        "num_nextn_predict_layers", "read", ">= 0", "MTP draft layers (`mtp.layers.*`; MiMo: `model.mtp_layers.*`)"
    ),
    ConfigKey("hidden_act", "refused unless", '"silu"', "the MLP's activation (SwiGLU)", _is("silu")),
    ConfigKey(
        "attention_bias",
        "refused unless",
        "false",
        "biases on q/k/v/o projections (Qwen3, Llama); Qwen2's and MiMo's q/k/v biases are in their modeling "
        "code, which does not read this key",
        _is(False),
    ),
    ConfigKey("mlp_bias", "refused unless", "false", "biases on the MLP's projections (Llama)", _is(False)),
    ConfigKey("use_sliding_window", "refused unless", "false", "windowed attention in some layers", _is(False)),
    ConfigKey(
        "layer_types",
        "refused unless",
        '"full_attention" in every layer',
        "per-layer attention kind (sliding_attention: windowed)",
        _full_attention_only,
    ),
    ConfigKey("partial_rotary_factor", "refused unless", "1 (absent)", "rotate only part of each head", _absent_or_one),
    ConfigKey("quantization_config", "refused unless", "absent", "quantized weights", lambda v: v is None),
    ConfigKey("use_mrope", "refused unless", "false", "multimodal rotary sections (MiMo's config)", _is(False)),
    ConfigKey("sliding_window", "ignored", "any", "acts only through use_sliding_window / layer_types"),
    ConfigKey("max_window_layers", "ignored", "any", "acts only through use_sliding_window / layer_types"),
    ConfigKey("attention_dropout", "ignored", "any", "dropout: engine and trainer compute without it (eval mode)"),
    ConfigKey("bos_token_id", "ignored", "any", "generation bookkeeping, not in the forward"),
    ConfigKey("pad_token_id", "ignored", "any", "padding bookkeeping, not in the forward"),
    ConfigKey("initializer_range", "ignored", "any", "initialisation of new weights, not in the forward"),
    ConfigKey("use_cache", "ignored", "any", "whether transformers keeps a KV cache"),
    ConfigKey("pretraining_tp", "ignored", "any", "Llama's tensor-parallel degree in pre-training; not in the forward"),
)
"""Every key of a supported architecture's config.json that transformers' forward reads, in the
order the docs list them."""

_REFUSED = {k.key: k for k in CONFIG_KEYS if k.rule == "refused unless"}


def models_markdown() -> str:
    """The table as docs/models.md's section quotes it (written by tools/gen_config_docs.py)."""
    lines = ["| config.json key | what the engine does | implemented values | what it is |", "|---|---|---|---|"]
    for k in CONFIG_KEYS:
        supported = k.supported.replace("|", "\\|")
        lines.append(f"| `{k.key}` | {k.rule} | {supported} | {k.why} |")
    return "\n".join(lines)


def attention_text(f: Family) -> str:
    """A family's attention in words (the README's table)."""
    parts = ["GQA", "q/k RMSNorm" if f.qk_norm else "no q/k norm", "q/k/v bias" if f.attention_bias else "no bias"]
    return ", ".join(parts)


def architectures_markdown() -> str:
    """The README's table of supported architectures, from `FAMILIES` (a test keeps the README's copy)."""
    lines = ["| architecture (family) | attention | MoE | native draft | tested against |", "|---|---|---|---|---|"]
    for f in FAMILIES.values():
        row = (f"`{f.architecture}` ({f.model_type})", attention_text(f), f.moe, f.native_draft, f.tested_against)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def supported_text() -> str:
    return ", ".join(f"{a} (model_type {t})" for a, t in SUPPORTED_ARCHITECTURES.items())


def family_of(architectures: list[str] | None, model_type: str | None = None) -> Family:
    """The family of a config.json's `architectures` (or, when that is absent, its `model_type`; Qwen3
    when both are); UnsupportedConfigError naming what is supported otherwise."""
    check_architecture(architectures, model_type)
    if architectures:
        family = FAMILIES[architectures[0]]
        if model_type is not None and model_type != family.model_type:
            raise UnsupportedConfigError(
                f"model_type {model_type!r} contradicts architectures {architectures} (model_type "
                f"{family.model_type!r}); fix config.json"
            )
        return family
    by_type = {f.model_type: f for f in FAMILIES.values()}
    return by_type[model_type] if model_type is not None else FAMILIES["Qwen3ForCausalLM"]


def check_architecture(architectures: list[str] | None, model_type: str | None) -> None:
    """UnsupportedConfigError unless every named architecture (and the model_type) is one the engine serves."""
    for arch in architectures or []:
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedConfigError(
                f"architecture {arch!r} is not supported by specrl's engine; supported: {supported_text()}"
            )
    if model_type is not None and model_type not in SUPPORTED_ARCHITECTURES.values():
        raise UnsupportedConfigError(
            f"model_type {model_type!r} is not supported by specrl's engine; supported: {supported_text()}"
        )


def check_config(raw: Mapping[str, Any]) -> None:
    """Refuse a config.json whose forward the engine does not implement (UnsupportedConfigError naming
    every such key, its value and what is supported); return quietly otherwise."""
    archs = raw.get("architectures")
    family = family_of(list(archs) if isinstance(archs, list | tuple) else None, raw.get("model_type"))
    problems = [
        f"{name}: {json.dumps(raw[name])} (implemented: {k.supported}; {k.why})"
        for name, k in _REFUSED.items()
        if raw.get(name) is not None
        and k.accepts is not None
        and not k.accepts(raw[name])
        and name not in family.unread_keys
    ]
    try:
        RopeConfig.from_hf(raw)
    except ValueError as e:
        problems.append(f"rotary embedding: {e}")
    if problems:
        raise UnsupportedConfigError(
            "this config.json describes a model specrl's engine does not implement, so it would serve (and "
            f"train) it as a different model: {'; '.join(problems)}. Supported: {supported_text()} with the keys "
            "listed in docs/models.md"
        )
