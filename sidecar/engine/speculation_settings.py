"""The torch engine's speculation settings: the default k, automatic k's controller, and their status.

Split from `torch_engine.py` (a mixin `TorchEngine` inherits, as `served_weights`): the default k for
requests submitted from now on (fixed, or automatic with a `SpeculationPolicy` choosing 0..k per
step), its validation against the draft the engine serves, and the status GetInfo, GetStats and
Prometheus report.
"""

from __future__ import annotations

import dataclasses

from sidecar.speculation.config import SpeculationPolicyConfig
from sidecar.speculation.controller import SpeculationPolicy
from sidecar.types import SpeculationStatus


class SpeculationSettings:
    """The speculation side of `TorchEngine` (see the module docstring)."""

    max_speculation_k: int
    num_mtp: int
    _k: int
    _auto: bool
    _policy: SpeculationPolicy | None
    _policy_config: SpeculationPolicyConfig | None

    @property
    def speculation_k(self) -> int:
        return self._k

    def _check_k(self, k: int) -> None:
        if k < 0 or k > self.max_speculation_k:
            why = (
                "the model has no MTP layers and no EAGLE-3 draft"
                if not self.num_mtp
                else f"max_speculation_k is {self.max_speculation_k}"
            )
            raise ValueError(f"speculation k must be in [0, {self.max_speculation_k}] ({why}), got {k}")

    def set_speculation_k(self, k: int) -> None:
        """Fixed default k for requests submitted from now on (running sequences keep theirs)."""
        self._check_k(k)
        self._k = k
        self._auto = False  # running auto-mode sequences keep the controller

    def set_speculation_auto(self, k: int) -> None:
        """Automatic default: requests submitted from now on that do not pin k get a per-step k
        in [0, k] from the controller (its measurements are kept while k stays the same); the
        engine's speculation_k is then that largest k."""
        self._check_k(k)
        self._k, self._auto = k, True
        if self._policy is None or self._policy.config.max_speculation_k != k:
            cfg = self._policy_config or SpeculationPolicyConfig(max_speculation_k=k)
            self._policy = SpeculationPolicy(dataclasses.replace(cfg, max_speculation_k=k))

    def set_speculation_policy(self, policy: SpeculationPolicy) -> None:
        """Auto mode with a given controller (tools and tests install a scripted or configured one)."""
        self._check_k(policy.config.max_speculation_k)
        self._k, self._auto = policy.config.max_speculation_k, True
        self._policy = policy

    @property
    def speculation_auto(self) -> bool:
        return self._auto

    def speculation_status(self) -> SpeculationStatus:
        """The k in use and why (GetInfo / GetStats / Prometheus)."""
        if not self._auto or self._policy is None:
            return SpeculationStatus(
                speculation_auto=False, speculation_k=self._k, reason="fixed", detail=f"fixed default k={self._k}"
            )
        d = self._policy.last
        return SpeculationStatus(
            speculation_auto=True,
            speculation_k=d.k,
            reason=d.reason,
            detail=d.detail,
            expected_speedup=d.expected_speedup,
            batch_size=d.batch_size,
            acceptance=self._policy.acceptance.rates(),
            guard_trips=self._policy.trips,
        )
