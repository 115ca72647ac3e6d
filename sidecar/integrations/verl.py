"""verl finds specrl without a fork: `actor_rollout_ref.rollout.name=specrl` (verl==0.9.1).

This module is the `verl.plugins` entry point (pyproject.toml), which verl imports when it is
imported itself, in the driver and in every Ray worker. It registers:

- the replica (`RolloutReplicaRegistry`, what verl's `LLMServerManager` builds per replica):
  `sidecar.integrations.verl_server.SpecrlReplica`, attached to a running sidecar;
- the rollout adapter (`verl.workers.rollout.base._ROLLOUT_REGISTRY`, what verl's actor worker
  builds and feeds weights through the checkpoint engine):
  `sidecar.integrations.verl_weights.SpecrlRolloutAdapter`.

Both are loaded lazily, by name, as verl loads its own backends. Without the entry point (a
source checkout not installed), set VERL_USE_EXTERNAL_MODULES=sidecar.integrations.verl.
"""

from __future__ import annotations

from verl.workers.rollout import base as _rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry

NAME = "specrl"
VERL_VERSION = "0.9.1"
"""The verl release this plugin is written and tested against."""

ADAPTER = "sidecar.integrations.verl_weights.SpecrlRolloutAdapter"


def _load_replica() -> type:
    from sidecar.integrations.verl_server import SpecrlReplica

    return SpecrlReplica


def register() -> None:
    """Make `rollout.name=specrl` known to verl (idempotent)."""
    RolloutReplicaRegistry.register(NAME, _load_replica)
    _rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = ADAPTER


register()
