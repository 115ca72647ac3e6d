"""Speculation statistics of a verl rollout batch, into verl's step metrics.

Each sample's `TokenOutput.extra_fields` carries the sidecar's raw counters (`verl_server.token_output`);
verl's agent loop puts them into the batch's `non_tensor_batch`, one entry per sample.
`speculation_metrics` sums them into τ (generated tokens / verify steps, bonus token included),
the acceptance rate and acceptance per draft position, the weight versions that sampled the
batch, and the sidecars' generation time. `SpecrlAgentLoopManager` (verl's `AgentLoopManager`
plus these figures) hands them to the trainer in `meta_info["timing"]`, the dict verl's
trainer merges into its step metrics: they appear as `timing_s/specrl/tau` and so on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl.experimental.agent_loop import AgentLoopManager
from verl.utils.ray_utils import auto_await

PREFIX = "specrl/"


def speculation_metrics(non_tensor_batch: Mapping[str, Sequence[Any]]) -> dict[str, float]:
    """Batch figures from the per-sample counters; {} when the batch holds none (another backend)."""
    if "specrl_verify_steps" not in non_tensor_batch:
        return {}

    def total(key: str) -> int:
        return int(sum(int(v) for v in non_tensor_batch[key] if v is not None))

    verify, generated = total("specrl_verify_steps"), total("specrl_generated_tokens")
    drafted, accepted = total("specrl_drafted_tokens"), total("specrl_accepted_tokens")
    out: dict[str, float] = {
        PREFIX + "tau": generated / verify if verify else 0.0,
        PREFIX + "acceptance_rate": accepted / drafted if drafted else 0.0,
        PREFIX + "verify_steps": float(verify),
        PREFIX + "generated_tokens": float(generated),
    }
    drafted_at: list[int] = []
    accepted_at: list[int] = []
    for d_row, a_row in zip(
        non_tensor_batch["specrl_drafted_per_position"], non_tensor_batch["specrl_accepted_per_position"], strict=True
    ):
        for sums, row in ((drafted_at, d_row or []), (accepted_at, a_row or [])):
            sums.extend([0] * (len(row) - len(sums)))
            for i, v in enumerate(row):
                sums[i] += int(v)
    for i, d in enumerate(drafted_at):
        a = accepted_at[i] if i < len(accepted_at) else 0
        out[f"{PREFIX}acceptance/position_{i + 1}"] = a / d if d else 0.0
    versions = [int(v) for v in non_tensor_batch["specrl_weight_version"] if v is not None]
    if versions:
        out[PREFIX + "weight_version/min"] = float(min(versions))
        out[PREFIX + "weight_version/max"] = float(max(versions))
    seconds = [float(v) for v in non_tensor_batch["specrl_generate_s"] if v is not None]
    if seconds:
        out[PREFIX + "generate_s/mean"] = sum(seconds) / len(seconds)
        out[PREFIX + "generate_s/max"] = max(seconds)
    return out


class SpecrlAgentLoopManager(AgentLoopManager):
    """verl's AgentLoopManager whose outputs also carry the speculation figures
    (`actor_rollout_ref.rollout.agent.agent_loop_manager_class=sidecar.integrations.verl_metrics.SpecrlAgentLoopManager`)."""

    @auto_await
    async def generate_sequences(self, prompts: Any) -> Any:
        output = await super().generate_sequences(prompts)
        output.meta_info.setdefault("timing", {}).update(speculation_metrics(output.non_tensor_batch))
        return output
