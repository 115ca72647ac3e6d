"""The Muon optimizer for 2-D hidden weight matrices, tensor-parallel and fused-layout aware.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) keeps a momentum buffer per
weight matrix and steps along its orthogonalised version (``muon.newton_schulz``):

    B ← μ·B + (1 − μ)·G                       (an EMA; the scale is irrelevant after NS)
    U ← (1 − μ)·G + μ·B  if Nesterov else B
    W ← W·(1 − lr·λ) − lr · s(rows, cols) · NS(U)

with decoupled weight decay λ (as AdamW, Loshchilov & Hutter 2019) and a shape-dependent update
scale s. ``"match_adamw_rms"`` = 0.2·√max(rows, cols) gives the update the RMS (0.2) of a typical
AdamW update, so AdamW learning rates and weight decay transfer (Moonlight, Liu et al. 2025,
arXiv:2502.16982); ``"keller_jordan"`` = √max(1, rows/cols) is the original scaling (then Muon
wants its own lr, ~0.02). This matches ``torch.optim.Muon`` for plain matrices, and adds what the
trainer needs: a choice of Newton–Schulz schedule and precision, fused Q/K/V and gate/up blocks
orthogonalised separately (``muon.layout``), and tensor-parallel shards orthogonalised as the full
matrix (``muon.tensor_parallel``), so the update does not depend on the TP size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from muon.layout import RowBlocks
from muon.newton_schulz import NewtonSchulzConfig, orthogonalize
from muon.tensor_parallel import gather_full, global_shape, local_chunk, shard_spec

ADAMW_UPDATE_RMS = 0.2
"""Typical RMS of an AdamW update (Moonlight, Sec. 2.2); ``match_adamw_rms`` scales Muon to it."""

SCALE_MODES: dict[str, Callable[[int, int], float]] = {
    "match_adamw_rms": lambda rows, cols: ADAMW_UPDATE_RMS * math.sqrt(max(rows, cols)),
    "keller_jordan": lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    "none": lambda rows, cols: 1.0,
}
"""Update scale s(rows, cols) applied to each orthogonalised (block) matrix."""


def check_hyperparameters(*, lr: float, momentum: float, weight_decay: float, scale: str, where: str = "Muon") -> None:
    """Raise ValueError naming the first bad Muon hyperparameter."""
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"{where}: lr={lr!r} must be a finite number >= 0")
    if not (0.0 <= momentum < 1.0):
        raise ValueError(f"{where}: momentum={momentum!r} must be in [0, 1), e.g. 0.95")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"{where}: weight_decay={weight_decay!r} must be a finite number >= 0")
    if scale not in SCALE_MODES:
        raise ValueError(f"{where}: scale={scale!r} is unknown; choose one of {sorted(SCALE_MODES)}")


def scaled_polar(
    update: Tensor,  # (rows, cols) the full (global) momentum-updated matrix
    *,
    newton_schulz: NewtonSchulzConfig,
    scale: str,
    blocks: RowBlocks | None = None,
) -> Tensor:  # (rows, cols) s·NS(update), block by block when ``blocks`` is given
    """Orthogonalise ``update`` (each block of ``blocks`` separately) and apply the update scale.

    The scale uses each block's own shape, so every block gets the same target RMS.
    """
    scale_fn = SCALE_MODES[scale]
    if blocks is None:
        return orthogonalize(update, newton_schulz) * scale_fn(update.size(0), update.size(1))
    parts = [
        orthogonalize(part, newton_schulz) * scale_fn(part.size(-2), part.size(-1)) for part in blocks.split(update)
    ]
    return blocks.merge(parts)


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weights; see the module docstring for the update rule.

    ``params`` are tensors, ``(name, tensor)`` pairs (names then appear in errors), or param-group
    dicts. ``row_blocks`` maps a fused parameter to its block layout; ``tp_group`` is the
    tensor-parallel process group (None: no tensor parallelism) used for parameters that carry
    megatron-core's ``tensor_model_parallel`` attribute.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        scale: str = "match_adamw_rms",
        newton_schulz: NewtonSchulzConfig | None = None,
        row_blocks: Mapping[Tensor, RowBlocks] | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        ns = newton_schulz or NewtonSchulzConfig()
        check_hyperparameters(lr=lr, momentum=momentum, weight_decay=weight_decay, scale=scale)
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "scale": scale,
            "ns_schedule": ns.schedule,
            "ns_steps": ns.steps,
            "ns_dtype": ns.dtype,
            "ns_eps": ns.eps,
        }
        self._row_blocks: dict[Tensor, RowBlocks] = dict(row_blocks or {})
        self.tp_group = tp_group
        super().__init__(params, defaults)
        known = {p for group in self.param_groups for p in group["params"]}
        for p, blocks in self._row_blocks.items():
            if p not in known:
                raise ValueError(f"row_blocks names a tensor of shape {tuple(p.shape)} that is not a Muon parameter")
            rows = global_shape(p, tp_group)[0]
            if rows != blocks.rows:
                raise ValueError(f"row_blocks for a parameter of {rows} global rows describes {blocks.rows} rows")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"Muon param group {len(self.param_groups) - 1}"
        check_hyperparameters(
            lr=group["lr"],
            momentum=group["momentum"],
            weight_decay=group["weight_decay"],
            scale=group["scale"],
            where=where,
        )
        self._newton_schulz(group)  # validates the Newton–Schulz fields
        names = group.get("param_names") or [f"#{i} of {where}" for i in range(len(group["params"]))]
        for name, p in zip(names, group["params"], strict=True):
            if p.ndim != 2:
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(p.shape)}: Muon only optimises 2-D matrices; "
                    "route it to AdamW instead"
                )

    def __getstate__(self) -> dict[str, Any]:  # keep the layouts and TP group on copy/pickle
        state = super().__getstate__()
        state.update(_row_blocks=self._row_blocks, tp_group=self.tp_group)
        return state

    @staticmethod
    def _newton_schulz(group: Mapping[str, Any]) -> NewtonSchulzConfig:
        return NewtonSchulzConfig(
            schedule=group["ns_schedule"], steps=group["ns_steps"], dtype=group["ns_dtype"], eps=group["ns_eps"]
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step for every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ns = self._newton_schulz(group)
            lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:  # kept in the parameter's dtype (fp32 main params)
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                grad = p.grad.to(buf.dtype)
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                blocks = self._row_blocks.get(p)
                spec = shard_spec(p, self.tp_group, row_stride=blocks.tp_stride if blocks else None)
                full = update if spec is None else gather_full(update, spec)
                direction = scaled_polar(full, newton_schulz=ns, scale=group["scale"], blocks=blocks)
                if spec is not None:
                    direction = local_chunk(direction, spec)
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(direction.to(p.dtype), alpha=-lr)
        return loss
