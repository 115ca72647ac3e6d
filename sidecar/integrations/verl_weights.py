"""verl's weight sync into a sidecar: one atomic, versioned push per training step.

verl hands the rollout side its policy as a generator of (name, tensor) (`BaseRollout.update_weights`,
called by the actor worker in hybrid mode through the checkpoint engine's `naive` backend).
`SpecrlRolloutAdapter` drains that generator into one `WeightUpdateSession`: each tensor is sent
as soon as it arrives, renamed to the checkpoint naming contract (`sidecar.model.checkpoint`:
verl's FSDP and Megatron engines already export Hugging Face names, so only wrapper prefixes
are removed), and the commit applies everything at once and bumps the version by one.

With `engine_kwargs.specrl.draft_checkpoint` set, the draft travels in the same update
(selector ALL): the streamed policy is loaded into a Hugging Face copy, `DraftAligner` refits the
MTP layers to it on the replica's latest rollouts, and the draft tensors are sent before the
commit. The sidecar's draft-collapse alarm is read before every push, logged once per
collapse, and makes the refit happen on that push.

Only the first rank of each replica pushes (it holds full tensors, as every rank does after
verl's gather); the other ranks drain the generator, whose gathering is collective.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from sidecar.client.client import SidecarClient
from sidecar.client.draft_alarm import DraftAlarms
from sidecar.integrations.draft_alignment import DraftAligner
from sidecar.integrations.verl_config import SpecrlConfigError, SpecrlRolloutOptions
from sidecar.integrations.verl_server import server_name
from sidecar.integrations.weight_session import WeightUpdateSession
from sidecar.types import PushResult, TensorSpec, WeightSelector

log = logging.getLogger(__name__)

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "module.")
"""Prefixes wrappers (FSDP1, activation checkpointing, torch.compile, DDP) put before HF names."""

DRAFT_PREFIXES = ("mtp.", "eagle3.", "model.mtp_layers.")


def contract_name(name: str) -> str:
    """verl's exported parameter name -> the checkpoint contract's (Hugging Face Qwen3) name."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
        name = name.replace("._fsdp_wrapped_module.", ".").replace("._checkpoint_wrapped_module.", ".")
    return name


async def _items(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


class SpecrlRolloutAdapter(BaseRollout):
    """verl's `BaseRollout` for `rollout.name=specrl` (built by verl's actor worker per rank)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        self.options = SpecrlRolloutOptions.from_mapping(self.config.engine_kwargs.get("specrl"))
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // world
        self.is_leader_rank = rank % world == 0
        self.address = self.options.sidecar_for(self.replica_rank)
        self._client: SidecarClient | None = None
        self._specs: list[TensorSpec] | None = None
        self._alarms = DraftAlarms()
        self.aligner: DraftAligner | None = None
        self._policy: Any = None
        self.push_results: list[PushResult] = []

    # --- verl's BaseRollout ----------------------------------------------------------------

    async def resume(self, tags: list[str]) -> None:
        """No-op: the sidecar keeps its weights and KV pool on its own device."""

    async def release(self) -> None:
        """No-op (see resume)."""

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        if wire_format != "named_tensors":
            raise SpecrlConfigError(
                f"checkpoint engine wire format {wire_format!r} is not supported by rollout.name=specrl; "
                "use actor_rollout_ref.rollout.checkpoint_engine.backend=naive"
            )
        if kwargs.get("peft_config") is not None:
            raise SpecrlConfigError(
                "LoRA adapters are not pushed to specrl sidecars; set actor_rollout_ref.model.lora.merge=True"
            )
        if not self.is_leader_rank:
            async for _ in _items(weights):
                pass
            return
        result = await self.push(weights)
        global_steps = kwargs.get("global_steps")
        server = ray.get_actor(server_name(self.replica_rank))
        await server.set_global_steps.remote(global_steps)
        log.info("specrl: step %s pushed as weight version %d to %s", global_steps, result.version, self.address)

    # --- the push -------------------------------------------------------------------------

    @property
    def client(self) -> SidecarClient:
        if self._client is None:
            self._client = SidecarClient(self.address, self.options.client_config())
        return self._client

    def _served_specs(self) -> list[TensorSpec]:
        if self._specs is None:
            self._specs, _ = self.client.describe_weights(WeightSelector.ALL)
        return self._specs

    def _bind_aligner(self) -> DraftAligner | None:
        if self.options.draft_checkpoint is None:
            return None
        if self.aligner is None:
            from transformers import AutoModelForCausalLM

            checkpoint = self.options.draft_checkpoint
            self._policy = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
            self.aligner = DraftAligner(checkpoint, self.options.align_config(float(self.config.temperature)))
            self.aligner.bind(self._policy)
        return self.aligner

    async def push(self, weights: Any) -> PushResult:
        """Stream `weights` into one update of the sidecar and commit it (version + 1)."""
        aligner = self._bind_aligner()
        stats = self.client.stats()
        collapsed = self._alarms.observe(self.address, stats) is not None or stats.draft_collapsed is not None
        refit = aligner is not None and aligner.due(collapsed=collapsed)
        specs = [s for s in self._served_specs() if refit or not s.name.startswith(DRAFT_PREFIXES)]
        by_name = {s.name: s for s in specs}
        tied = "lm_head.weight" not in by_name
        policy_state = self._policy.state_dict() if aligner is not None else {}  # the refit's policy
        session = WeightUpdateSession(
            self.client,
            version=stats.weight_version + 1,
            selector=WeightSelector.ALL if refit else WeightSelector.TARGET,
            specs=specs,
        )
        try:
            async for raw_name, tensor in _items(weights):
                name = contract_name(raw_name)
                if name not in by_name:
                    if tied and name == "lm_head.weight":
                        continue  # tied to the embedding, which is sent under its own name
                    raise SpecrlConfigError(
                        f"verl exported {raw_name!r} (contract name {name!r}), which the sidecar at {self.address} "
                        "does not serve; serve the checkpoint verl trains (actor_rollout_ref.model.path)"
                    )
                session.send(name, tensor)
                if name in policy_state:
                    policy_state[name].copy_(tensor.detach().to(policy_state[name].device, torch.float32))
            if refit:
                assert aligner is not None
                server = ray.get_actor(server_name(self.replica_rank))
                sequences = await server.recent_sequences.remote()
                losses = aligner.fit(sequences)
                if losses:
                    log.info(
                        "specrl: draft refit on %d rollouts, KL %.4f -> %.4f", len(sequences), losses[0], losses[-1]
                    )
                for name, tensor in aligner.draft_tensors():
                    session.send(name, tensor)
        except BaseException:
            session.abort()
            raise
        result = session.commit()
        self.push_results.append(result)
        return result
