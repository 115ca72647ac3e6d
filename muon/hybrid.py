"""One optimizer object over Muon (hidden matrices) and AdamW (everything else).

The trainer steps, zeroes, clips and checkpoints its optimizer as one thing; with two inner
optimizers that is easy to get subtly wrong (clipping each part by its own norm, checkpointing
one half, an LR schedule that only reaches one). :class:`HybridOptimizer` owns both and exposes
their param groups as one list, so a ``torch.optim.lr_scheduler`` (it is a
``torch.optim.Optimizer``) or Megatron's scheduler drives both.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from muon.optimizer import Muon
from muon.tensor_parallel import total_grad_norm

_FORMAT = "specrl.muon.hybrid/1"


class HybridOptimizer(torch.optim.Optimizer):
    """Muon for the routed matrices plus AdamW for the rest, stepped as one optimizer.

    Built by :func:`muon.build_optimizer`. ``param_groups`` lists Muon's groups first, then
    AdamW's (each group has ``"optimizer"`` set to ``"muon"`` or ``"adamw"``); the lists are the
    inner optimizers' own group dicts, so changing ``group["lr"]`` reaches the inner optimizer.
    """

    # Deliberately does not call Optimizer.__init__: the state and groups live in the inner
    # optimizers and are exposed through properties.
    def __init__(
        self,
        *,
        muon: Muon | None,
        adamw: torch.optim.AdamW | None,
        muon_names: list[str],
        adamw_names: list[str],
        tp_group: dist.ProcessGroup | None = None,
        expert_group: dist.ProcessGroup | None = None,
    ) -> None:
        if muon is None and adamw is None:
            raise ValueError("HybridOptimizer got no parameters at all; check the named_parameters passed in")
        self.muon = muon
        self.adamw = adamw
        self.muon_names = list(muon_names)
        self.adamw_names = list(adamw_names)
        self.tp_group = tp_group
        self.expert_group = expert_group
        """The expert-parallel group: each of its ranks holds other experts (Megatron marks their
        parameters ``allreduce=False``), whose gradients the norm sums over it; None without EP."""
        self.defaults: dict[str, Any] = {}

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The non-empty inner optimizers, Muon first."""
        return [opt for opt in (self.muon, self.adamw) if opt is not None]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> ChainMap[Tensor, Any]:  # type: ignore[override]
        return ChainMap(*(opt.state for opt in self.optimizers))

    def parameters(self) -> Iterator[Tensor]:
        """Every parameter this optimizer updates."""
        for group in self.param_groups:
            yield from group["params"]

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """(name, parameter) for every parameter, Muon's first."""
        muon_params = [p for g in self.muon.param_groups for p in g["params"]] if self.muon else []
        adamw_params = [p for g in self.adamw.param_groups for p in g["params"]] if self.adamw else []
        yield from zip(self.muon_names, muon_params, strict=True)
        yield from zip(self.adamw_names, adamw_params, strict=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step both inner optimizers (a closure is evaluated once)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:  # () total norm before clipping
        """Scale all gradients together so their joint norm is at most ``max_norm``.

        The norm covers Muon's and AdamW's parameters jointly (and, under tensor parallelism, the
        unsharded model: see ``muon.tensor_parallel.total_grad_norm``). Returns the norm before
        clipping, as ``torch.nn.utils.clip_grad_norm_`` does. Under expert parallelism the experts
        of every rank count (``expert_group``).
        """
        if not max_norm > 0:
            raise ValueError(f"clip_grad_norm_: max_norm={max_norm!r} must be > 0")
        params = list(self.parameters())
        total = total_grad_norm(params, self.tp_group, norm_type, expert_group=self.expert_group)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def state_dict(self) -> dict[str, Any]:
        """Both inner state dicts plus the parameter names that key them (for a checked resume)."""
        return {
            "format": _FORMAT,
            "muon": self.muon.state_dict() if self.muon else None,
            "adamw": self.adamw.state_dict() if self.adamw else None,
            "muon_names": list(self.muon_names),
            "adamw_names": list(self.adamw_names),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the parameter routing must be the same as when saved."""
        if state_dict.get("format") != _FORMAT:
            raise ValueError(
                f"not a HybridOptimizer state dict (format={state_dict.get('format')!r}, want {_FORMAT!r})"
            )
        for part in ("muon", "adamw"):
            saved, ours = state_dict[f"{part}_names"], getattr(self, f"{part}_names")
            if saved != ours:
                missing = sorted(set(saved) ^ set(ours))
                detail = f"differing names: {missing[:5]}" if missing else "same names in another order"
                raise ValueError(f"checkpoint routes other parameters to {part} than this optimizer ({detail})")
        if self.muon is not None:
            self.muon.load_state_dict(state_dict["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state_dict["adamw"])

    def __getstate__(self) -> dict[str, Any]:
        # Optimizer's version would drop the inner optimizers. Like it, leave out instance-level
        # patches of ``step`` (an LR scheduler's wrapper points back at the original object).
        return {k: v for k, v in self.__dict__.items() if k != "step"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("build a new HybridOptimizer (muon.build_optimizer) instead of adding groups")

    def __repr__(self) -> str:
        return f"HybridOptimizer(muon={len(self.muon_names)} params, adamw={len(self.adamw_names)} params)"
