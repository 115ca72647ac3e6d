"""Configure megatron-core's own YaRN rotary embedding from a ``RopeConfig``, so the trainer rotates like the engines.

megatron-core 0.16 builds ``YarnRotaryEmbedding`` when ``GPTModel(position_embedding_type="yarn")`` and reads
the YaRN values from plain attributes on the ``TransformerConfig`` (they are not dataclass fields, so they
cannot be passed to its constructor): ``yarn_rotary_scaling_factor``, ``yarn_original_max_position_embeddings``,
``yarn_beta_fast``, ``yarn_beta_slow``, ``yarn_mscale``, ``yarn_mscale_all_dim`` and
``yarn_correction_range_round_to_int``. Its frequencies follow the same float32 operation order as
``yarn.inv_freq`` (YaRN, Peng et al. 2023, arXiv:2309.00071), so the angles agree bit for bit.

Where Megatron differs from Hugging Face (and so from ``yarn``), ``configure`` reconciles them:

* The attention scale. Megatron does not fold it into the cached cos/sin handed to attention: the
  ``GPTModel`` rotary embedding returns raw angles and each attention layer multiplies cos and sin by
  ``_yarn_get_concentration_factor_from_config(config)`` (for q and k alike), which is the HF convention
  in effect. But Megatron computes ``get_mscale(s, yarn_mscale) / get_mscale(s, yarn_mscale_all_dim)``
  always, while HF ignores ``mscale`` unless ``mscale_all_dim`` is non-zero and lets ``attention_factor``
  override everything. ``configure`` passes the raw values when both agree and otherwise sets the
  equivalent ``yarn_mscale`` (with ``yarn_mscale_all_dim = 0``, Megatron's scale is ``0.1·m·ln s + 1``).
* Factor 1. Megatron's YaRN blend of two equal frequency tensors may round one ulp away from plain RoPE;
  ``yarn`` returns plain RoPE exactly, so ``configure`` selects Megatron's plain ``"rope"`` embedding.
* ``fused_single_qkv_rope`` drops the scale silently, so ``configure`` refuses it when the scale is not 1
  (``apply_rope_fusion`` is fine: TE's fused RoPE warns and falls back to the unfused path). Megatron's
  dynamic-batching inference context also ignores the scale; the trainer does not use it.

llama3 scaling: megatron-core's ``GPTModel(rope_scaling=True)`` applies Llama 3.1's scaling with only the
factor configurable (``low_freq_factor`` 1, ``high_freq_factor`` 4 and an original context of 8192 are
fixed in ``RotaryEmbedding._apply_scaling``). So ``configure`` asks for plain ``"rope"`` and
``install_frequencies`` then sets the built model's inverse frequencies to ``yarn.inv_freq`` (the same
float32 operations as Megatron's and transformers', for any of the four values).

On a machine without CUDA, constructing ``YarnRotaryEmbedding`` (and calling it) needs
``torch.cuda.current_device`` to return the CPU device even with ``use_cpu_initialization=True``: it moves
its frequency tensors to ``torch.cuda.current_device()`` on every call. The trainer's CPU platform module
provides that.
"""

from __future__ import annotations

import math
from typing import Any

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer import TransformerConfig

from yarn.rope import RopeConfig, attention_scale, inv_freq

# The TransformerConfig attributes GPTModel(position_embedding_type="yarn") reads with getattr.
YARN_ATTRIBUTES = (
    "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_mscale",
    "yarn_mscale_all_dim",
    "yarn_correction_range_round_to_int",
)


def configure(config: TransformerConfig, rope: RopeConfig, *, rotary_percent: float = 1.0) -> dict[str, Any]:
    """Set ``rope``'s YaRN values on ``config`` (in place) and return the rotary ``GPTModel`` kwargs.

    Use as ``GPTModel(config=config, ..., **configure(config, rope))``. The returned kwargs are
    ``position_embedding_type`` ("rope" for plain RoPE, "yarn" otherwise), ``rotary_base``,
    ``rotary_percent`` and ``seq_len_interpolation_factor`` (None). ``rotary_percent`` < 1 rotates the
    first ``rope.head_dim`` of each head's ``kv_channels`` (GLM-4.5's partial rotary; Megatron's
    ``rotary_percent``, the rest passing through), plain RoPE only. Raises ValueError for a config
    that cannot reproduce ``rope`` (head size, interleaved rotary, MLA, fused single-QKV RoPE).
    """
    if int(config.kv_channels * rotary_percent) != rope.head_dim:
        raise ValueError(
            f"TransformerConfig.kv_channels ({config.kv_channels}) x rotary_percent ({rotary_percent}) must equal "
            f"RopeConfig.head_dim ({rope.head_dim}), the rotated dimensions"
        )
    if rotary_percent != 1.0 and rope.rope_type != "default" and rope.factor != 1.0:
        raise ValueError(
            f"partial rotary (rotary_percent={rotary_percent}) with {rope.rope_type} scaling is not supported"
        )
    if config.rotary_interleaved:
        raise ValueError("TransformerConfig.rotary_interleaved must be False: yarn uses the rotate-half layout")
    if config.multi_latent_attention:
        raise ValueError("multi_latent_attention uses its own MLA YaRN path; yarn.megatron supports standard attention")
    scale = attention_scale(rope)
    if scale != 1.0 and config.fused_single_qkv_rope:
        raise ValueError(
            f"TransformerConfig.fused_single_qkv_rope ignores the YaRN attention scale ({scale}); set it to False"
        )
    for name in YARN_ATTRIBUTES:  # a stale yarn_rotary_scaling_factor would scale plain RoPE in attention
        if hasattr(config, name):
            delattr(config, name)
    kwargs: dict[str, Any] = {
        "position_embedding_type": "rope",
        "rotary_base": rope.base,
        "rotary_percent": rotary_percent,
        "seq_len_interpolation_factor": None,
    }
    if rope.rope_type == "llama3":
        return kwargs  # plain RoPE's module, given llama3's frequencies by `install_frequencies`
    if rope.rope_type == "default" or rope.factor == 1.0:
        if scale != 1.0:
            raise ValueError(
                f"attention_factor={rope.attention_factor} with factor=1 cannot be expressed in megatron-core "
                "(its YaRN scale is 1 whenever the factor is 1); drop attention_factor or use factor > 1"
            )
        return kwargs
    assert rope.original_max_position_embeddings is not None  # RopeConfig checks this for yarn
    values: dict[str, Any] = {
        "yarn_rotary_scaling_factor": rope.factor,
        "yarn_original_max_position_embeddings": rope.original_max_position_embeddings,
        "yarn_beta_fast": rope.beta_fast,
        "yarn_beta_slow": rope.beta_slow,
        "yarn_mscale": rope.mscale,
        "yarn_mscale_all_dim": rope.mscale_all_dim,
        "yarn_correction_range_round_to_int": rope.truncate,
    }
    for name, value in values.items():
        setattr(config, name, value)
    if _yarn_get_concentration_factor_from_config(config) != scale:
        # Megatron's scale with mscale_all_dim = 0 is 0.1·m·ln(factor) + 1: pick m to reproduce ours.
        config.yarn_mscale = (scale - 1.0) / (0.1 * math.log(rope.factor))
        config.yarn_mscale_all_dim = 0.0
        megatron_scale = _yarn_get_concentration_factor_from_config(config)
        if not math.isclose(megatron_scale, scale, rel_tol=1e-12):
            raise RuntimeError(f"megatron-core YaRN scale {megatron_scale} != yarn attention_scale {scale}")
    kwargs["position_embedding_type"] = "yarn"
    return kwargs


def install_frequencies(model: Any, rope: RopeConfig) -> None:
    """Give a ``GPTModel`` built with ``configure``'s kwargs the inverse frequencies of ``rope`` where
    Megatron cannot compute them itself (llama3); a no-op otherwise. Call it before the first forward
    (Megatron's rotary embedding caches its output per sequence length)."""
    if rope.rope_type != "llama3":
        return
    rotary = model.rotary_pos_emb
    rotary.inv_freq = inv_freq(rope).to(device=rotary.inv_freq.device, dtype=rotary.inv_freq.dtype)
    rotary.forward.cache_clear()  # the lru_cache of the embedding by sequence length
