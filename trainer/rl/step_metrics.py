"""What one RL step logs about itself: its timings phase by phase (`StepTimes`, the `time/*` keys,
the step's length and the generation's share), the speculation figures of its rollouts
(`spec/*`), the sidecars' prefix cache (`prefix_cache/*`) and the quantiles of its response
lengths (`rollout/response_len_qNN`)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from sidecar.types import SidecarStats, SpeculationCounters


@dataclass(kw_only=True, slots=True)
class StepTimes:
    """Seconds one RL step spent, phase by phase: filled by the functions that time them, logged
    as `time/<field>` with the step's total and shares (`metrics`)."""

    generation: float = 0.0
    """The step's rollout (speculative unless k is 0)."""
    generation_plain: float | None = None
    """The same prompts with speculation off (`rollout.measure_plain`); None when not measured."""
    refill: float = 0.0
    """DAPO refill rounds."""
    wait_generation: float = 0.0
    """What the trainer waited for its batch (all of generation at lag 0)."""
    wait_weights: float = 0.0
    """What the producer waited for weights before starting the batch (the lag bound)."""
    stale_regeneration: float = 0.0
    """Regenerating groups older than the lag bound."""
    logprobs: float = 0.0
    train: float = 0.0
    weight_push: float = 0.0

    def metrics(self, *, overlapped: bool) -> dict[str, float]:
        """`time/*`, the step's length and the generation's share of it, and the speedups when the
        plain pass was measured. `overlapped` (lag > 0): generation ran beside training, so the
        step holds only what the trainer waited for."""
        out = {f"time/{f.name}": v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}
        rest = self.refill + self.logprobs + self.train + self.weight_push
        if overlapped:
            exposed = self.wait_generation + self.stale_regeneration
            step = exposed + rest - self.refill
            out["time/generation_exposed_share"] = exposed / step
        else:
            step = self.generation + rest
        out["time/step"] = step
        out["time/generation_share"] = (self.generation + self.refill) / step
        if self.generation_plain is not None:
            out["speedup/generation"] = self.generation_plain / self.generation
            out["speedup/step"] = (self.generation_plain + rest) / step
        return out


def speculation_metrics(c: SpeculationCounters) -> dict[str, float]:
    out = {"spec/acceptance_length": c.acceptance_length, "spec/acceptance_rate": c.acceptance_rate}
    for i, d in enumerate(c.drafted_per_position):  # a position never accepted has no accepted count
        a = c.accepted_per_position[i] if i < len(c.accepted_per_position) else 0
        out[f"spec/accept_pos{i}"] = a / d if d else 0.0
    return out


def prefix_cache_metrics(before: dict[str, SidecarStats], after: dict[str, SidecarStats]) -> dict[str, float]:
    """`prefix_cache/*` of the sidecars' stats between two readings (by address, `Fleet.latest_stats`):
    prefill tokens computed and taken from the prefix cache, the hit rate (taken / both), the
    blocks cached now and evictions. Per weight version, so versions folded out of GetStats' list
    between the readings (which no longer change) drop nothing."""
    hits = prefill = evictions = cached = 0
    for address, now in after.items():
        then = before.get(address)
        if then is not None and now.uptime_seconds < then.uptime_seconds:
            then = None  # restarted: everything since its start is new
        old = {v.weight_version: v for v in then.versions} if then is not None else {}
        for v in now.versions:
            o = old.get(v.weight_version)
            hits += v.prefix_cache_hit_tokens - (o.prefix_cache_hit_tokens if o else 0)
            prefill += v.prefill_tokens - (o.prefill_tokens if o else 0)
        evictions += now.kv.prefix_cache_evictions - (then.kv.prefix_cache_evictions if then is not None else 0)
        cached += now.kv.blocks_cached
    return {
        "prefix_cache/hit_tokens": float(hits),
        "prefix_cache/prefill_tokens": float(prefill),
        "prefix_cache/hit_rate": hits / (hits + prefill) if hits + prefill else 0.0,
        "prefix_cache/blocks_cached": float(cached),
        "prefix_cache/evictions": float(evictions),
    }


LENGTH_QUANTILES = (0, 10, 25, 50, 75, 90, 100)
"""Percentiles of the response lengths logged per step (`rollout/response_len_qNN`): the
length distribution decides when a batch drains, which `specrl plan` needs (the mean alone
does not say how long the last row runs)."""


def length_quantiles(lengths: list[int]) -> dict[str, float]:
    """`rollout/response_len_qNN` for NN in LENGTH_QUANTILES (linear interpolation between order statistics)."""
    if not lengths:
        return {}
    qs = torch.quantile(
        torch.tensor(lengths, dtype=torch.float64), torch.tensor(LENGTH_QUANTILES, dtype=torch.float64) / 100.0
    )
    return {f"rollout/response_len_q{q:02d}": float(v) for q, v in zip(LENGTH_QUANTILES, qs.tolist(), strict=True)}


def reward_metric_name(reward: str) -> str:
    """A reward term's name as a metric key ("math"; "rewards.py:score" -> "rewards_py_score")."""
    return re.sub(r"[^A-Za-z0-9_]+", "_", reward).strip("_")
