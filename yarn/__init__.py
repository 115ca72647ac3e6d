"""Rotary embeddings and their scaling variants (plain, YaRN: Peng et al. 2023, arXiv:2309.00071; llama3),
shared by the trainer and the engines.

One ``RopeConfig`` drives the engines' ``RotaryEmbedding``/``apply_rotary`` and, through
``yarn.megatron.configure``, megatron-core's own ``YarnRotaryEmbedding`` in the trainer.
"""

from yarn.rope import ROPE_TYPES, RopeConfig, RotaryEmbedding, apply_rotary, attention_scale, inv_freq

__all__ = ["ROPE_TYPES", "RopeConfig", "RotaryEmbedding", "apply_rotary", "attention_scale", "inv_freq"]
