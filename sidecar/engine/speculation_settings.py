"""The engine's speculation settings: the default k, automatic k's controller, and their status.

The default k for requests submitted from now on (fixed, or automatic with a `SpeculationController`
choosing 0..k per step), its validation against the draft the engine serves, and the status
GetInfo, GetStats and Prometheus report. A part `TorchEngine` holds (`engine.speculation`), whose
Engine methods of the same names delegate here.
"""

from __future__ import annotations

import dataclasses

from sidecar.model.model import ModelConfig
from sidecar.speculation.config import SpeculationControllerConfig
from sidecar.speculation.controller import SpeculationController
from sidecar.speculation.expert_union import ExpertReads
from sidecar.types import SpeculationStatus


class SpeculationSettings:
    """The default k and automatic k's controller (see the module docstring)."""

    def __init__(
        self,
        k: int,
        *,
        max_speculation_k: int,
        has_draft: bool,
        controller: SpeculationControllerConfig | None,
        expert_reads: ExpertReads | None = None,
    ) -> None:
        """`max_speculation_k`: the largest k a request may ask for (0 without a draft); `controller`: the
        controller's knobs (its max_speculation_k is set by the mode); `expert_reads`: a
        mixture-of-experts target's bytes per forward (`expert_reads_of`), the controller's prior."""
        self.expert_reads = expert_reads
        self.max_speculation_k = max_speculation_k
        self.has_draft = has_draft
        self.k = k
        self.auto = False
        """New requests that do not pin k get the controller's k."""
        self.controller: SpeculationController | None = None
        """Automatic k's controller, kept while rows of automatic k may still run."""
        self._controller_config = controller
        self.set_k(k)

    def check(self, k: int) -> None:
        if k < 0 or k > self.max_speculation_k:
            why = (
                "the model has no MTP layers and no EAGLE-3 draft"
                if not self.has_draft
                else f"max_speculation_k is {self.max_speculation_k}"
            )
            raise ValueError(f"speculation k must be in [0, {self.max_speculation_k}] ({why}), got {k}")

    def set_k(self, k: int) -> None:
        """Fixed default k for requests submitted from now on (running sequences keep theirs)."""
        self.check(k)
        self.k = k
        self.auto = False  # running auto-mode sequences keep the controller

    def set_auto(self, k: int) -> None:
        """Automatic default: requests submitted from now on that do not pin k get a per-step k
        in [0, k] from the controller (its measurements are kept while k stays the same); the
        engine's speculation_k is then that largest k."""
        self.check(k)
        self.k, self.auto = k, True
        if self.controller is None or self.controller.config.max_speculation_k != k:
            cfg = self._controller_config or SpeculationControllerConfig(max_speculation_k=k)
            self.controller = SpeculationController(dataclasses.replace(cfg, max_speculation_k=k), self.expert_reads)

    def set_controller(self, controller: SpeculationController) -> None:
        """Auto mode with a given controller (tools and tests install a scripted or configured one)."""
        self.check(controller.config.max_speculation_k)
        self.k, self.auto = controller.config.max_speculation_k, True
        self.controller = controller

    def status(self) -> SpeculationStatus:
        """The k in use and why (GetInfo / GetStats / Prometheus)."""
        if not self.auto or self.controller is None:
            return SpeculationStatus(
                speculation_auto=False, speculation_k=self.k, reason="fixed", detail=f"fixed default k={self.k}"
            )
        d = self.controller.last
        return SpeculationStatus(
            speculation_auto=True,
            speculation_k=d.k,
            reason=d.reason,
            detail=d.detail,
            expected_speedup=d.expected_speedup,
            batch_size=d.batch_size,
            acceptance=self.controller.acceptance.rates(),
            guard_trips=self.controller.trips,
        )


def expert_reads_of(config: ModelConfig) -> ExpertReads | None:
    """The bytes a trunk forward of a mixture-of-experts `config` reads (`expert_union`): attention,
    dense layers, routers (float32), shared experts and the output head always; each sparse layer's
    routed experts by the union its tokens touch. None for a dense model."""
    moe = config.moe
    if moe is None:
        return None
    h, elt = config.hidden_size, config.dtype.itemsize
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    layers = range(config.num_hidden_layers)
    sparse = sum(config.is_sparse(i) for i in layers)
    attention = config.num_hidden_layers * (h * (q + 2 * kv) + q * h) * elt
    dense = (config.num_hidden_layers - sparse) * 3 * h * config.intermediate_size * elt
    shared = sparse * (3 * h * moe.moe_intermediate_size * moe.n_shared_experts * elt + 4 * h * moe.num_experts)
    head = config.vocab_size * h * elt
    return ExpertReads(
        experts=moe.num_experts,
        top_k=moe.num_experts_per_tok,
        sparse_layers=sparse,
        expert_bytes=3 * h * moe.moe_intermediate_size * elt,
        fixed_bytes=float(attention + dense + shared + head),
    )
