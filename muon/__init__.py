"""Muon optimizer (Newton–Schulz orthogonalised momentum) for the specrl trainer.

``build_optimizer(model.named_parameters(), HybridOptimizerConfig(...), qkv_layout=...)`` routes
hidden 2-D matrices to :class:`Muon` and the rest to AdamW and returns one
:class:`HybridOptimizer` to step, clip, zero and checkpoint. See ``muon.newton_schulz`` for the
orthogonalisation (quintic and Polar Express schedules), ``muon.layout`` for fused Q/K/V and
gate/up weights and ``muon.tensor_parallel`` for megatron-core tensor parallelism.
"""

from muon.hybrid import HybridOptimizer
from muon.layout import QKV_SPLIT_MODES, QKVLayout, RowBlocks, gated_fc1_blocks
from muon.newton_schulz import (
    POLAR_EXPRESS_COEFFICIENTS,
    QUINTIC_COEFFICIENTS,
    SCHEDULES,
    NewtonSchulzConfig,
    orthogonalize,
)
from muon.optimizer import SCALE_MODES, Muon, scaled_polar
from muon.routing import HybridOptimizerConfig, build_optimizer, default_route

__all__ = [
    "POLAR_EXPRESS_COEFFICIENTS",
    "QKV_SPLIT_MODES",
    "QUINTIC_COEFFICIENTS",
    "SCALE_MODES",
    "SCHEDULES",
    "HybridOptimizer",
    "HybridOptimizerConfig",
    "Muon",
    "NewtonSchulzConfig",
    "QKVLayout",
    "RowBlocks",
    "build_optimizer",
    "default_route",
    "gated_fc1_blocks",
    "orthogonalize",
    "scaled_polar",
]
