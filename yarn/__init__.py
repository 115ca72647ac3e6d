"""YaRN rotary-embedding scaling shared by the trainer and the engines (Peng et al. 2023, arXiv:2309.00071).

One ``RopeConfig`` drives the engines' ``RotaryEmbedding``/``apply_rotary`` and, through
``yarn.megatron.configure``, megatron-core's own ``YarnRotaryEmbedding`` in the trainer.
"""

from yarn.rope import ROPE_TYPES, RopeConfig, RotaryEmbedding, apply_rotary, attention_scale, inv_freq

__all__ = ["ROPE_TYPES", "RopeConfig", "RotaryEmbedding", "apply_rotary", "attention_scale", "inv_freq"]
