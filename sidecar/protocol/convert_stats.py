"""GetStats across the gRPC edge: per-version counters, the k in use, the draft-collapse alarm,
the engine's KV blocks.

Split from `convert.py` (one concern a module: the stats a trainer or a dashboard reads, apart
from the messages of generation and weight pushes); the same one-function-per-message-pair rule.
"""

from __future__ import annotations

from sidecar.protocol.convert import (
    counters_from_pb,
    counters_to_pb,
    speculation_status_from_pb,
    speculation_status_to_pb,
)
from sidecar.protocol.specrl.v1 import control_pb2
from sidecar.types import DraftCollapse, KVUsage, SidecarStats, VersionStats


def stats_to_pb(stats: SidecarStats) -> control_pb2.GetStatsResponse:
    return control_pb2.GetStatsResponse(
        versions=[
            control_pb2.VersionStats(
                weight_version=v.weight_version,
                counters=counters_to_pb(v.counters),
                samples_finished=v.samples_finished,
                busy_seconds=v.busy_seconds,
                samples_nonfinite=v.samples_nonfinite,
                prompt_tokens=v.prompt_tokens,
                prefill_tokens=v.prefill_tokens,
                prefix_cache_hit_tokens=v.prefix_cache_hit_tokens,
            )
            for v in stats.versions
        ],
        total=counters_to_pb(stats.total),
        weight_version=stats.weight_version,
        queued_sequences=stats.queued_sequences,
        running_sequences=stats.running_sequences,
        uptime_seconds=stats.uptime_seconds,
        speculation=speculation_status_to_pb(stats.speculation),
        draft_collapsed=draft_collapse_to_pb(stats.draft_collapsed),
        draft_collapses=stats.draft_collapses,
        kv=kv_usage_to_pb(stats.kv),
    )


def kv_usage_to_pb(kv: KVUsage) -> control_pb2.KVUsage:
    return control_pb2.KVUsage(
        block_size=kv.block_size,
        blocks_total=kv.blocks_total,
        blocks_used=kv.blocks_used,
        blocks_shared=kv.blocks_shared,
        preemptions=kv.preemptions,
        blocks_cached=kv.blocks_cached,
        prefix_cache_evictions=kv.prefix_cache_evictions,
    )


def kv_usage_from_pb(msg: control_pb2.KVUsage) -> KVUsage:
    return KVUsage(
        block_size=msg.block_size,
        blocks_total=msg.blocks_total,
        blocks_used=msg.blocks_used,
        blocks_shared=msg.blocks_shared,
        preemptions=msg.preemptions,
        blocks_cached=msg.blocks_cached,
        prefix_cache_evictions=msg.prefix_cache_evictions,
    )


def draft_collapse_to_pb(c: DraftCollapse | None) -> control_pb2.DraftCollapse | None:
    if c is None:
        return None
    return control_pb2.DraftCollapse(
        weight_version=c.weight_version,
        latest_version=c.latest_version,
        reference_version=c.reference_version,
        tau_before=c.tau_before,
        tau_after=c.tau_after,
        verify_steps=c.verify_steps,
    )


def draft_collapse_from_pb(msg: control_pb2.GetStatsResponse) -> DraftCollapse | None:
    if not msg.HasField("draft_collapsed"):
        return None
    c = msg.draft_collapsed
    return DraftCollapse(
        weight_version=c.weight_version,
        latest_version=c.latest_version,
        reference_version=c.reference_version,
        tau_before=c.tau_before,
        tau_after=c.tau_after,
        verify_steps=c.verify_steps,
    )


def stats_from_pb(msg: control_pb2.GetStatsResponse) -> SidecarStats:
    return SidecarStats(
        versions=[
            VersionStats(
                weight_version=v.weight_version,
                counters=counters_from_pb(v.counters),
                samples_finished=v.samples_finished,
                busy_seconds=v.busy_seconds,
                samples_nonfinite=v.samples_nonfinite,
                prompt_tokens=v.prompt_tokens,
                prefill_tokens=v.prefill_tokens,
                prefix_cache_hit_tokens=v.prefix_cache_hit_tokens,
            )
            for v in msg.versions
        ],
        total=counters_from_pb(msg.total),
        weight_version=msg.weight_version,
        queued_sequences=msg.queued_sequences,
        running_sequences=msg.running_sequences,
        uptime_seconds=msg.uptime_seconds,
        speculation=speculation_status_from_pb(msg.speculation, msg.speculation.reason not in ("", "fixed")),
        draft_collapsed=draft_collapse_from_pb(msg),
        draft_collapses=msg.draft_collapses,
        kv=kv_usage_from_pb(msg.kv),
    )
