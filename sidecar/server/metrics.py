"""Observability of a sidecar: Prometheus metrics (prometheus-client) and GPU telemetry (NVML).

A custom collector reads the scheduler's snapshot at scrape time, so nothing is updated on
the hot path and the exported values are exactly GetStats' raw counters (plus a few derived
gauges for dashboards). Each sidecar owns its own `CollectorRegistry`: several sidecars (or
tests) in one process do not collide in the global registry.

Exported (prefix `specrl_`):
- counters `verify_steps_total`, `drafted_tokens_total`, `accepted_tokens_total`,
  `generated_tokens_total`, `samples_finished_total`, `samples_nonfinite_total`, `prompt_tokens_total`,
  `prefill_tokens_total` (prompt tokens admitted, and those the prefill computed),
  `prefix_cache_hit_tokens_total` (those the prefill took from the prefix cache), `busy_seconds_total`;
- gauges `acceptance_length` (tau = generated / verify steps, bonus token included),
  `acceptance_rate` (accepted / drafted), `position_acceptance_rate{position}` (per draft
  position), all over the served weight version so they follow the current policy;
  `tokens_per_second` (over the scheduler's throughput window), `queue_depth`,
  `running_sequences`, `weight_version`, `paused`, `speculation_k` (the k in use at the latest
  step: in automatic mode the controller's choice), `speculation_auto`,
  `speculation_expected_speedup` (the controller's prediction for that k),
  `speculation_reason{reason}` (1 for the reason of the latest decision: fixed, model, probe,
  guard, collapsed, off), counter `speculation_guard_trips_total`;
- the draft-collapse alarm (`sidecar.speculation.collapse`): gauges `draft_collapsed` (1 while
  raised), `draft_collapse_version` (the first collapsed weight version; 0 when not raised),
  `draft_collapse_tau{when}` (tau over drafting verify steps before: the last working version,
  after: the collapsed one), counter `draft_collapses_total` (alert on `specrl_draft_collapsed == 1`);
- the engine's paged KV cache (`Engine.kv_usage`, zeros where the engine pages none itself): gauges
  `kv_block_size` (token slots a block), `kv_blocks_total`, `kv_blocks_used` (a shared block once),
  `kv_blocks_shared` (held by more than one sequence), counter `preemptions_total` (sequences whose
  blocks were freed when the pool ran out, to resume later); the prefix cache's gauge
  `kv_blocks_cached` and counter `prefix_cache_evictions_total`.

GPU telemetry comes from NVML (nvidia-ml-py) and is cleanly absent where there is no NVIDIA
driver: on a CPU-only machine `pynvml` imports but `nvmlInit` raises `NVMLError` (no driver
library); then, and if the package is missing, `gpu_telemetry()` is empty and says so once in
the log. A reading a device does not support (e.g. power on some boards) is left at 0 rather
than failing the whole report.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sidecar.server.scheduler import Scheduler
from sidecar.types import DraftCollapse, GpuTelemetry, KVUsage, SpeculationCounters

log = logging.getLogger(__name__)
T = TypeVar("T")


class SidecarMetrics(Collector):
    """Collector over a scheduler; `serve(port)` exposes it over HTTP."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Any]:
        snap = self._scheduler.snapshot()
        total = SpeculationCounters()
        samples = 0
        nonfinite = prompt = prefill = hits = 0
        busy = 0.0
        current = SpeculationCounters()
        for v in [snap.earlier, *snap.versions]:
            total.add(v.counters)
            samples += v.samples_finished
            nonfinite += v.samples_nonfinite
            prompt += v.prompt_tokens
            prefill += v.prefill_tokens
            hits += v.prefix_cache_hit_tokens
            busy += v.busy_seconds
            if v.weight_version == snap.weight_version:
                current = v.counters
        for name, value, doc in (
            ("verify_steps", total.verify_steps, "Target forward passes that produced tokens, per sequence"),
            ("drafted_tokens", total.drafted_tokens, "Draft tokens proposed for verification"),
            ("accepted_tokens", total.accepted_tokens, "Draft tokens accepted by the target"),
            ("generated_tokens", total.generated_tokens, "Tokens emitted to samples"),
            ("samples_finished", samples, "Samples finished"),
            ("samples_nonfinite", nonfinite, "Samples finished with a NaN or infinite log-prob (broken weights)"),
            ("prompt_tokens", prompt, "Prompt tokens of the sequences admitted (each sample counts its prompt)"),
            ("prefill_tokens", prefill, "Prompt tokens the prefill computed (a prompt shared by samples once)"),
            ("prefix_cache_hit_tokens", hits, "Prefix tokens the prefill took from the prefix cache"),
            ("busy_seconds", busy, "Seconds the engine spent computing"),
        ):
            c = CounterMetricFamily(f"specrl_{name}", doc)
            c.add_metric([], value)
            yield c
        spec = snap.info.speculation_status
        trips = CounterMetricFamily("specrl_speculation_guard_trips", "Times the guard backed off to plain decoding")
        trips.add_metric([], spec.guard_trips)
        yield trips
        reason = GaugeMetricFamily(
            "specrl_speculation_reason", "Why k is what it is (1 on the latest decision's reason)", labels=["reason"]
        )
        for r in ("fixed", "model", "probe", "guard", "collapsed", "off"):
            reason.add_metric([r], float(spec.reason == r))
        yield reason
        yield from _collapse_metrics(snap.draft_collapsed, snap.draft_collapses)
        yield from _kv_metrics(snap.kv)
        gauges = (
            ("acceptance_length", current.acceptance_length, "Acceptance length tau of the served weight version"),
            ("acceptance_rate", current.acceptance_rate, "Accepted over drafted tokens of the served version"),
            ("tokens_per_second", self._scheduler.tokens_per_second(), "Generated tokens per second, recent window"),
            ("queue_depth", snap.queued, "Sequences waiting for an engine slot"),
            ("running_sequences", snap.running, "Sequences in the running engine batch"),
            ("weight_version", snap.weight_version, "Served weight version"),
            ("paused", int(snap.paused), "1 while paused"),
            ("speculation_k", spec.speculation_k, "Draft length k in use (automatic mode: chosen at the latest step)"),
            ("speculation_auto", int(spec.speculation_auto), "1 while the sidecar chooses k per step"),
            ("speculation_expected_speedup", spec.expected_speedup, "Predicted tokens/s of k over plain decoding"),
        )
        for name, value, doc in gauges:
            g = GaugeMetricFamily(f"specrl_{name}", doc)
            g.add_metric([], float(value))
            yield g
        per_pos = GaugeMetricFamily(
            "specrl_position_acceptance_rate",
            "Acceptance rate at each draft position (0 = right after the last verified token), served version",
            labels=["position"],
        )
        for i, drafted in enumerate(current.drafted_per_position):
            accepted = current.accepted_per_position[i] if i < len(current.accepted_per_position) else 0
            per_pos.add_metric([str(i)], accepted / drafted if drafted else 0.0)
        yield per_pos

    def serve(self, port: int, host: str = "127.0.0.1") -> tuple[Any, int]:
        """Start the HTTP endpoint on a daemon thread; returns (server, bound port)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port


def _collapse_metrics(condition: DraftCollapse | None, collapses: int) -> Iterator[Any]:
    """The draft-collapse alarm's series (module docstring)."""
    count = CounterMetricFamily("specrl_draft_collapses", "Draft collapses raised since the sidecar started")
    count.add_metric([], collapses)
    yield count
    raised = GaugeMetricFamily("specrl_draft_collapsed", "1 while a weight version's draft is collapsed (tau ~ 1.0)")
    raised.add_metric([], float(condition is not None))
    yield raised
    version = GaugeMetricFamily("specrl_draft_collapse_version", "First collapsed weight version (0: none raised)")
    version.add_metric([], float(condition.weight_version if condition is not None else 0))
    yield version
    tau = GaugeMetricFamily(
        "specrl_draft_collapse_tau",
        "tau over drafting verify steps: before (last working version), after (collapsed version)",
        labels=["when"],
    )
    if condition is not None:
        tau.add_metric(["before"], condition.tau_before)
        tau.add_metric(["after"], condition.tau_after)
    yield tau


def _kv_metrics(kv: KVUsage) -> Iterator[Any]:
    """The KV pool's series (module docstring)."""
    preemptions = CounterMetricFamily(
        "specrl_preemptions", "Sequences preempted when the KV pool ran out (blocks freed, resumed later)"
    )
    preemptions.add_metric([], kv.preemptions)
    yield preemptions
    evictions = CounterMetricFamily(
        "specrl_prefix_cache_evictions", "Idle prefix-cache blocks taken for other tokens (least recently used)"
    )
    evictions.add_metric([], kv.prefix_cache_evictions)
    yield evictions
    for name, value, doc in (
        ("kv_block_size", kv.block_size, "Token slots a KV block holds"),
        ("kv_blocks_total", kv.blocks_total, "Blocks of the KV pool"),
        ("kv_blocks_used", kv.blocks_used, "KV blocks held by running sequences (a shared block counted once)"),
        ("kv_blocks_shared", kv.blocks_shared, "KV blocks held by more than one sequence (a shared prompt)"),
        ("kv_blocks_cached", kv.blocks_cached, "KV blocks the prefix cache keeps (held or idle)"),
    ):
        g = GaugeMetricFamily(f"specrl_{name}", doc)
        g.add_metric([], float(value))
        yield g


# --- GPU telemetry (NVML) ---------------------------------------------------------------

_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "nvml": None}


def _nvml() -> Any:
    """The initialised pynvml module, or None without a usable NVIDIA driver."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                import pynvml
            except ImportError:
                log.info("nvidia-ml-py is not installed; GPU telemetry is off")
                return None
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as e:
                log.info("NVML unavailable (%s); GPU telemetry is off", e)
                return None
            _state["nvml"] = pynvml
        return _state["nvml"]


def _read(nvml: Any, default: T, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), or `default` when the device does not support that reading."""
    try:
        return fn(*args)
    except nvml.NVMLError:
        return default


def gpu_telemetry() -> list[GpuTelemetry]:
    """Live readings of every visible GPU; [] without NVML."""
    nvml = _nvml()
    if nvml is None:
        return []
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as e:
        log.warning("NVML device count failed: %s", e)
        return []
    gpus = []
    for i in range(count):
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
        except nvml.NVMLError:
            continue
        name: Any = _read(nvml, "", nvml.nvmlDeviceGetName, h)
        mem: Any = _read(nvml, None, nvml.nvmlDeviceGetMemoryInfo, h)
        rates: Any = _read(nvml, None, nvml.nvmlDeviceGetUtilizationRates, h)
        util = rates.gpu if rates is not None else 0
        temp: Any = _read(nvml, 0, nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU)
        power_mw: Any = _read(nvml, 0, nvml.nvmlDeviceGetPowerUsage, h)
        gpus.append(
            GpuTelemetry(
                index=i,
                name=name.decode() if isinstance(name, bytes) else str(name),
                memory_total_bytes=int(mem.total) if mem is not None else 0,
                memory_used_bytes=int(mem.used) if mem is not None else 0,
                utilization_percent=int(util),
                temperature_celsius=int(temp),
                power_watts=power_mw / 1000.0,
            )
        )
    return gpus
