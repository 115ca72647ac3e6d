"""Route parameters to Muon or AdamW and build the trainer's :class:`HybridOptimizer`.

Muon is defined for the hidden weight matrices of a network; embeddings and the output head
(lookups and a classifier whose rows are tokens, not a linear map between hidden spaces), norm
gains and biases are optimised with AdamW, as in the reference implementations (Jordan et al.
2024; Moonlight, arXiv:2502.16982). The rule:

1. a caller-supplied ``route(name, param)`` decides first if it returns ``"muon"`` or ``"adamw"``
   (or ``"exclude"``: not in this optimizer at all);
2. anything that is not 2-D → AdamW (norm gains, biases);
3. names containing an embedding/head pattern (``embedding``, ``embed_tokens``, ``output_layer``,
   ``lm_head``), a norm pattern (``norm``, which covers ``layernorm``), a mixture of experts' router
   (Megatron's ``mlp.router.``, the contract's ``mlp.gate.``: like the output head, a classifier
   whose rows are experts, not a map between hidden spaces) or ending in ``bias`` → AdamW;
4. every other 2-D matrix → Muon: each routed expert's matrices are parameters of their own
   (Megatron's ``SequentialMLP.local_experts.{e}``, the MTP draft's ``mlp.experts.{e}``), so each
   expert is orthogonalised on its own, never stacked with the others.

Forcing a non-2-D tensor to Muon is a configuration error and names the parameter. Megatron's
fused ``linear_qkv`` is split into Q, K, V (per query group by default, see ``muon.layout``); a
SwiGLU ``linear_fc1`` into gate and up when ``split_gated_fc1``. To give a subset (the MTP draft head) its own optimizer and
clipping, exclude it with ``route`` and build a second optimizer over just that subset.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from muon.hybrid import HybridOptimizer
from muon.layout import QKV_SPLIT_MODES, QKVLayout, RowBlocks, gated_fc1_blocks
from muon.newton_schulz import NewtonSchulzConfig
from muon.optimizer import SCALE_MODES, Muon
from muon.tensor_parallel import global_shape

Destination = Literal["muon", "adamw"]
RouteFn = Callable[[str, nn.Parameter], Literal["muon", "adamw", "exclude"] | None]
"""Routing override: "muon"/"adamw" decides a parameter, "exclude" leaves it out of this
optimizer (e.g. the MTP draft head, which gets its own), None applies the default rule."""

QKV_SUFFIX = "linear_qkv.weight"
FC1_SUFFIX = "linear_fc1.weight"


@dataclass(kw_only=True, slots=True)
class HybridOptimizerConfig:
    """Hyperparameters of the Muon + AdamW pair (one learning rate transfers between them)."""

    lr: float = 3e-4
    """AdamW learning rate; also Muon's unless ``muon_lr`` is set (with ``match_adamw_rms`` the
    same value is right for both)."""
    muon_lr: float | None = None
    """Muon learning rate if it should differ from ``lr`` (e.g. ~0.02 with ``keller_jordan``)."""
    weight_decay: float = 0.1
    """Decoupled weight decay for Muon matrices and 2-D AdamW tensors (embeddings, head)."""
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (β₁, β₂)."""
    adamw_eps: float = 1e-8
    """AdamW ε."""
    decay_1d: bool = False
    """Apply weight decay to 1-D AdamW tensors (norm gains, biases) too; off by convention."""
    momentum: float = 0.95
    """Muon momentum μ."""
    nesterov: bool = True
    """Muon Nesterov momentum."""
    scale: str = "match_adamw_rms"
    """Muon update scale, a key of ``muon.optimizer.SCALE_MODES``."""
    newton_schulz: NewtonSchulzConfig = field(default_factory=NewtonSchulzConfig)
    """Orthogonalisation schedule, steps and precision."""
    split_qkv: bool = True
    """Orthogonalise Megatron ``linear_qkv`` as separate Q, K, V blocks (needs ``qkv_layout``)."""
    qkv_split_mode: str = "per_group"
    """``"per_group"``: each query group's Q, K, V block on its own; ``"per_kind"``: one Q, one K,
    one V matrix across all groups (megatron-core's own Muon). See ``muon.layout``."""
    split_gated_fc1: bool = False
    """Orthogonalise a SwiGLU ``linear_fc1`` as separate gate and up matrices."""
    adamw_name_patterns: tuple[str, ...] = (
        "embedding",
        "embed_tokens",
        "output_layer",
        "lm_head",
        "norm",
        "mlp.router.",
        "mlp.gate.",
    )
    """Substrings (lower-case match) of parameter names that always go to AdamW (embeddings, the
    output head, norms, and a mixture of experts' routers)."""

    def __post_init__(self) -> None:
        for name in ("lr", "weight_decay", "adamw_eps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"HybridOptimizerConfig.{name}={value!r} must be a finite number >= 0")
        if self.muon_lr is not None and not (math.isfinite(self.muon_lr) and self.muon_lr >= 0):
            raise ValueError(f"HybridOptimizerConfig.muon_lr={self.muon_lr!r} must be >= 0, or None to reuse lr")
        if len(self.adamw_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adamw_betas):
            raise ValueError(f"HybridOptimizerConfig.adamw_betas={self.adamw_betas!r} must be two numbers in [0, 1)")
        if not (0.0 <= self.momentum < 1.0):
            raise ValueError(f"HybridOptimizerConfig.momentum={self.momentum!r} must be in [0, 1), e.g. 0.95")
        if self.scale not in SCALE_MODES:
            raise ValueError(
                f"HybridOptimizerConfig.scale={self.scale!r} is unknown; choose one of {sorted(SCALE_MODES)}"
            )
        if self.qkv_split_mode not in QKV_SPLIT_MODES:
            raise ValueError(
                f"HybridOptimizerConfig.qkv_split_mode={self.qkv_split_mode!r} is unknown; choose one of {QKV_SPLIT_MODES}"
            )


def default_route(name: str, param: nn.Parameter, config: HybridOptimizerConfig) -> Destination:
    """The default rule (module docstring, steps 2–4)."""
    lowered = name.lower()
    if param.ndim != 2 or lowered.endswith("bias") or any(p in lowered for p in config.adamw_name_patterns):
        return "adamw"
    return "muon"


def _row_blocks(
    name: str,
    param: nn.Parameter,
    config: HybridOptimizerConfig,
    qkv_layout: QKVLayout | None,
    tp_group: dist.ProcessGroup | None,
) -> RowBlocks | None:
    rows = global_shape(param, tp_group)[0]
    if name.endswith(QKV_SUFFIX) and config.split_qkv:
        if qkv_layout is None:
            raise ValueError(
                f"parameter {name!r} is a fused QKV weight and split_qkv is on: pass qkv_layout=QKVLayout(...) "
                "or set HybridOptimizerConfig.split_qkv=False"
            )
        blocks = qkv_layout.row_blocks(config.qkv_split_mode)
        if blocks.rows != rows:
            raise ValueError(
                f"parameter {name!r} has {rows} (global) rows but {qkv_layout} describes {blocks.rows}; check "
                "the layout, and under tensor parallelism that each rank holds whole query groups "
                "(num_query_groups divisible by the TP size)"
            )
        return blocks
    if name.endswith(FC1_SUFFIX) and config.split_gated_fc1:
        try:
            return gated_fc1_blocks(rows)
        except ValueError as err:
            raise ValueError(f"parameter {name!r}: {err}") from err
    return None


def build_optimizer(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    config: HybridOptimizerConfig,
    *,
    qkv_layout: QKVLayout | None = None,
    route: RouteFn | None = None,
    tp_group: dist.ProcessGroup | None = None,
    expert_group: dist.ProcessGroup | None = None,
) -> HybridOptimizer:
    """Route ``named_parameters`` (trainable ones only) and build Muon + AdamW as one optimizer.

    ``tp_group`` is the tensor-parallel group of megatron-core parameters (None: no tensor
    parallelism). Order of parameters is preserved inside each optimizer, so the same model gives
    the same state-dict layout. ``expert_group``: the expert-parallel group of a mixture of
    experts (None: no expert parallelism), over which the gradient norm sums the experts.
    """
    muon_named: list[tuple[str, nn.Parameter]] = []
    adamw_named: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for name, param in named_parameters:
        if not param.requires_grad or id(param) in seen:
            continue  # frozen, or a tied weight already routed under its first name
        seen.add(id(param))
        choice = route(name, param) if route is not None else None
        if choice not in (None, "muon", "adamw", "exclude"):
            raise ValueError(f"route({name!r}) returned {choice!r}; return 'muon', 'adamw', 'exclude' or None")
        if choice == "exclude":
            continue
        choice = choice or default_route(name, param, config)
        if choice == "muon" and param.ndim != 2:
            raise ValueError(
                f"parameter {name!r} has shape {tuple(param.shape)} but was routed to Muon, which only "
                "optimises 2-D matrices; route it to AdamW"
            )
        (muon_named if choice == "muon" else adamw_named).append((name, param))

    muon = None
    if muon_named:
        row_blocks: dict[torch.Tensor, RowBlocks] = {}
        for name, param in muon_named:
            blocks = _row_blocks(name, param, config, qkv_layout, tp_group)
            if blocks is not None:
                row_blocks[param] = blocks
        muon = Muon(
            [{"params": muon_named, "optimizer": "muon"}],
            lr=config.lr if config.muon_lr is None else config.muon_lr,
            momentum=config.momentum,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
            scale=config.scale,
            newton_schulz=config.newton_schulz,
            row_blocks=row_blocks,
            tp_group=tp_group,
        )
    adamw = None
    if adamw_named:
        decay = [(n, p) for n, p in adamw_named if p.ndim >= 2 or config.decay_1d]
        no_decay = [(n, p) for n, p in adamw_named if not (p.ndim >= 2 or config.decay_1d)]
        groups = [
            {"params": decay, "weight_decay": config.weight_decay, "optimizer": "adamw"},
            {"params": no_decay, "weight_decay": 0.0, "optimizer": "adamw"},
        ]
        adamw = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=config.lr, betas=config.adamw_betas, eps=config.adamw_eps
        )
        adamw_named = decay + no_decay  # the order AdamW holds them in
    return HybridOptimizer(
        muon=muon,
        adamw=adamw,
        muon_names=[n for n, _ in muon_named],
        adamw_names=[n for n, _ in adamw_named],
        tp_group=tp_group,
        expert_group=expert_group,
    )
