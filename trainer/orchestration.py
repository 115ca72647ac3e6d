"""Rollout orchestration: fan prompts over the sidecars, gather every sample exactly once.

Work is tracked per (prompt, sample index). Each round splits the still-missing samples over
the live sidecars (one `Generate` per sidecar and per missing-count, each with its own request
id and a deadline); finished samples are kept as they stream in, even from a sidecar that fails
later. A sidecar that errors, dies or misses the deadline is marked down (its live request is
aborted), and its missing samples go to the others in the next round — so no sample is lost, and
one already received is never asked for again (duplicates are dropped and counted). Every such
event is logged and returned with the result.

Weights: `push_weights` streams target + draft to every live sidecar as one versioned update;
given the export order, each tensor is exported once and streamed to all sidecars together, so
the trainer holds at most `stream_bytes` of them in flight, never a second copy of the model.
A sidecar that was down and answers its health check again rejoins only after it has been
pushed the current version; every request carries `min_weight_version`, so a stale sidecar
refuses rather than sampling from old weights.

Acceptance figures come from the sidecars' raw counters (`GetStats`), read as deltas.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import torch

from sidecar.client import ClientConfig, SidecarCallError, SidecarClient
from sidecar.errors import SpecrlError
from sidecar.types import GenerationRequest, Sample, SamplingParams, SpeculationCounters, TensorSpec, WeightSelector

log = logging.getLogger(__name__)
WeightSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]


class RolloutError(SpecrlError):
    """No live sidecar could produce the samples (all down, or every round failed)."""


@dataclass(kw_only=True, slots=True)
class RolloutResult:
    """All samples of one fan-out, and what happened on the way."""

    samples: list[Sample]
    """Sorted by (prompt_index, sample_index), indices of the caller's prompts."""
    seconds: float
    rerouted: int = 0
    """Samples re-asked from another sidecar after theirs failed."""
    duplicates: int = 0
    """Samples received twice and dropped (should stay 0)."""
    events: list[str] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class _Job:
    client: SidecarClient
    prompts: list[int]
    """Caller's prompt index of each prompt in this request."""
    sample_ids: list[list[int]]
    """Caller's sample indices per prompt (all of the same length: samples_per_prompt)."""
    request: GenerationRequest


class Orchestrator:
    """The trainer's view of the sidecar fleet."""

    def __init__(
        self,
        addresses: list[str],
        *,
        deadline_s: float = 300.0,
        call_timeout_s: float = 10.0,
        probe_interval_s: float = 30.0,
        stream_bytes: int = 256 << 20,
        delta_pushes: bool = False,
    ) -> None:
        """`delta_pushes`: send weights as sparse deltas where smaller (`ClientConfig.delta_pushes`)."""
        if not addresses:
            raise ValueError("the orchestrator needs at least one sidecar address")
        config = ClientConfig(
            timeout_s=call_timeout_s, retries=1, generate_timeout_s=deadline_s, delta_pushes=delta_pushes
        )
        self.clients = [SidecarClient(a, config) for a in addresses]
        self.deadline_s = deadline_s
        self.version = 0
        self._weights: WeightSource | None = None
        self._names: Sequence[str] | None = None
        self._specs: dict[tuple[str, ...], list[TensorSpec]] = {}
        self.stream_bytes = stream_bytes
        """Bytes of tensors a streamed push may queue for a sidecar (one tensor always fits)."""
        self._down: set[str] = set()
        self.probe_interval_s = probe_interval_s
        """How often a down sidecar is probed for rejoining (a hung one costs a call deadline)."""
        self._next_probe: dict[str, float] = {}
        self._counters: dict[str, tuple[float, SpeculationCounters]] = {}
        self._requests = 0

    # ---- fleet state -------------------------------------------------------------------------
    def live(self) -> list[SidecarClient]:
        return [c for c in self.clients if c.address not in self._down]

    def _mark_down(self, client: SidecarClient, why: str, events: list[str]) -> None:
        client.delta_base.forget()  # it may come back with other weights: its rejoin push is full
        if client.address not in self._down:
            self._down.add(client.address)
            self._next_probe[client.address] = time.monotonic() + self.probe_interval_s
            msg = f"sidecar {client.address} is down ({why})"
            log.warning(msg)
            events.append(msg)

    def served_versions(self) -> dict[str, int]:
        """Weight version each live sidecar serves (GetInfo)."""
        return {c.address: c.info().weight_version for c in self.live()}

    def push_weights(
        self, weights: WeightSource, version: int | None = None, *, names: Sequence[str] | None = None
    ) -> float:
        """Push `weights()` (target + draft) to every live sidecar as `version` (default: the
        next one); returns the wall seconds. Sidecars that fail are marked down.

        With `names`, the order in which `weights()` yields its tensors, the tensors are exported
        once and streamed to all sidecars at the same time, at most `stream_bytes` ahead of the
        slowest, so the trainer never holds a second copy of the model. Without, the whole
        model is gathered into one dict first. An error raised by `weights()` itself (or names
        that do not match the served model) propagates; no sidecar applies anything then, and
        the served version stays what it was.
        """
        start = time.perf_counter()
        version = version if version is not None else self.version + 1
        events: list[str] = []
        failures = self._push_to(self.live(), weights, names, version)
        for client, why in failures.items():
            self._mark_down(client, f"weight push failed: {why}", events)
        if not self.live():
            raise RolloutError(f"no sidecar accepted weight version {version}: {'; '.join(events)}")
        self.version, self._weights, self._names = version, weights, names
        return time.perf_counter() - start

    def _push_to(
        self,
        clients: list[SidecarClient],
        weights: WeightSource,
        names: Sequence[str] | None,
        version: int,
    ) -> dict[SidecarClient, str]:
        """Push to `clients` concurrently; returns the ones that failed, with why."""
        if not clients:
            return {}
        if names is None:
            tensors = dict(weights())  # shared by all pushes; each sends it in its manifest order
            with ThreadPoolExecutor(max_workers=len(clients)) as pool:
                futures = {c: pool.submit(c.push_weights, tensors, version) for c in clients}
                return self._failures(futures)
        # The served model does not change (a sidecar serving another one refuses the push and is
        # marked down all the same), so its specs are asked for once.
        key = tuple(names)
        specs = self._specs.get(key)
        failures: dict[SidecarClient, str] = {}
        if specs is None:
            specs, failures = self._specs_in_order(clients, names)  # failures: no answer
            clients = [c for c in clients if c not in failures]
            if clients:
                self._specs = {key: specs}
        feeds = {c: _Feed(self.stream_bytes) for c in clients}
        with ThreadPoolExecutor(max_workers=max(1, len(clients))) as pool:
            futures = {c: pool.submit(c.push_weights, iter(feeds[c]), version, specs=specs) for c in clients}
            source_error: BaseException | None = None
            try:
                for name, tensor in weights():
                    nbytes = tensor.numel() * tensor.element_size()
                    for c, feed in feeds.items():
                        feed.offer((name, tensor), nbytes, futures[c])
            except BaseException as e:  # the trainer's own failure: end every stream without a commit
                source_error = e
            for c, feed in feeds.items():
                feed.offer(_SourceFailed() if source_error is not None else _END, 0, futures[c])
            if source_error is not None:
                for f in futures.values():
                    with contextlib.suppress(Exception):
                        f.result(timeout=self.deadline_s)
                raise source_error
            failures.update(self._failures(futures))
        return failures

    def _failures(self, futures: dict[SidecarClient, Future[Any]]) -> dict[SidecarClient, str]:
        failed: dict[SidecarClient, str] = {}
        for client, fut in futures.items():
            try:
                fut.result(timeout=self.deadline_s)
            except (SidecarCallError, TimeoutError) as e:
                failed[client] = str(e) or "no answer within the deadline"
        return failed  # anything else (the trainer's tensors did not match their specs) propagates

    def _specs_in_order(
        self, clients: list[SidecarClient], names: Sequence[str]
    ) -> tuple[list[TensorSpec], dict[SidecarClient, str]]:
        """The served model's tensor specs in the order of `names` (from the first sidecar that
        answers DescribeWeights), and the sidecars that did not answer."""
        unanswered: dict[SidecarClient, str] = {}
        for c in clients:
            try:
                served, _ = c.describe_weights(WeightSelector.ALL)
            except SidecarCallError as e:
                unanswered[c] = str(e)
                continue
            by_name, given = {s.name: s for s in served}, set(names)
            unknown = [n for n in names if n not in by_name]
            missing = [n for n in by_name if n not in given]
            if unknown or missing or len(given) != len(names):
                raise ValueError(
                    f"the weights to push do not match the model sidecar {c.address} serves: "
                    f"unknown {unknown[:5]}, missing {missing[:5]}, {len(names) - len(given)} repeated; "
                    "push the checkpoint the sidecars were started from (same config, naming contract)"
                )
            return [by_name[n] for n in names], unanswered
        return [], unanswered

    def start_version(self) -> int:
        """One above the highest version any sidecar serves (a push must be newer)."""
        return max(c.info().weight_version for c in self.clients) + 1

    def rejoin(self, events: list[str], *, force: bool = True) -> None:
        """Bring back down sidecars that answer their health check, after pushing them the
        current weights (never used while behind). Without `force`, each down sidecar is probed
        at most once per `probe_interval_s`."""
        now = time.monotonic()
        for n, old in enumerate(self.clients):
            if old.address not in self._down:
                continue
            if not force and now < self._next_probe.get(old.address, 0.0):
                continue
            self._next_probe[old.address] = now + self.probe_interval_s
            c = SidecarClient(old.address, old.config)  # fresh channel: no reconnect backoff
            if not c.health():
                c.close()
                continue
            old.close()
            self.clients[n] = c
            try:
                behind = self._weights is not None and c.info().weight_version < self.version
            except SidecarCallError as e:
                log.info("sidecar %s answers but not GetInfo yet: %s", c.address, e)
                continue
            if behind and self._weights is not None:
                failed = self._push_to([c], self._weights, self._names, self.version)
                if failed:
                    log.info(
                        "sidecar %s answers but could not take version %d yet: %s", c.address, self.version, failed[c]
                    )
                    continue
            self._down.discard(c.address)
            msg = f"sidecar {c.address} rejoined at weight version {self.version}"
            log.warning(msg)
            events.append(msg)

    # ---- generation ------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        samples_per_prompt: int,
        speculation_k: int | None = None,
    ) -> RolloutResult:
        """Every (prompt, sample) exactly once, spread over the live sidecars."""
        start = time.perf_counter()
        self._requests += 1
        missing: dict[int, list[int]] = {p: list(range(samples_per_prompt)) for p in range(len(prompts))}
        got: dict[tuple[int, int], Sample] = {}
        events: list[str] = []
        rerouted = duplicates = 0
        for round_ in range(len(self.clients) + 1):
            self.rejoin(events, force=False)
            live = self.live()
            if not live:
                raise RolloutError(
                    f"no live sidecar for {sum(map(len, missing.values()))} samples: {'; '.join(events)}"
                )
            if round_ > 0:
                n = sum(map(len, missing.values()))
                rerouted += n
                msg = f"re-routing {n} samples of {len(missing)} prompts to {[c.address for c in live]}"
                log.warning(msg)
                events.append(msg)
            jobs = self._plan(prompts, missing, live, sampling, speculation_k, round_)
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                futures = [pool.submit(self._run, job) for job in jobs]
                outcomes = [f.result(timeout=self.deadline_s + 60.0) for f in futures]
            for job, (samples, error) in zip(jobs, outcomes, strict=True):
                for s in samples:
                    key = (job.prompts[s.prompt_index], job.sample_ids[s.prompt_index][s.sample_index])
                    if key in got:
                        duplicates += 1
                        continue
                    s.prompt_index, s.sample_index = key
                    got[key] = s
                if error is not None:
                    self._mark_down(job.client, error, events)
            missing = {
                p: [i for i in range(samples_per_prompt) if (p, i) not in got]
                for p in range(len(prompts))
                if any((p, i) not in got for i in range(samples_per_prompt))
            }
            if not missing:
                break
        if missing:
            raise RolloutError(f"{sum(map(len, missing.values()))} samples were never produced: {'; '.join(events)}")
        samples = [got[k] for k in sorted(got)]
        return RolloutResult(
            samples=samples,
            seconds=time.perf_counter() - start,
            rerouted=rerouted,
            duplicates=duplicates,
            events=events,
        )

    def _plan(
        self,
        prompts: list[list[int]],
        missing: dict[int, list[int]],
        live: list[SidecarClient],
        sampling: SamplingParams,
        speculation_k: int | None,
        round_: int,
    ) -> list[_Job]:
        """Round-robin the missing prompts over `live`; one request per (sidecar, missing count)."""
        per_client: dict[int, dict[int, list[int]]] = {}
        for n, p in enumerate(sorted(missing)):
            per_client.setdefault(n % len(live), {}).setdefault(len(missing[p]), []).append(p)
        jobs = []
        for ci, groups in sorted(per_client.items()):
            for count, ps in sorted(groups.items()):
                rid = f"rollout{self._requests}-r{round_}-s{ci}-g{count}"
                seed = None if sampling.seed is None else sampling.seed * 1_000_003 + self._requests * 101 + round_
                request = GenerationRequest(
                    prompts=[prompts[p] for p in ps],
                    sampling=replace(sampling, seed=seed),
                    samples_per_prompt=count,
                    request_id=rid,
                    min_weight_version=self.version,
                    speculation_k=speculation_k,
                )
                jobs.append(_Job(client=live[ci], prompts=ps, sample_ids=[missing[p] for p in ps], request=request))
        return jobs

    def _run(self, job: _Job) -> tuple[list[Sample], str | None]:
        """Stream one request; returns the samples received and the error (None if complete)."""
        samples: list[Sample] = []
        try:
            for s in job.client.stream_generate(job.request, timeout_s=self.deadline_s):
                samples.append(s)
        except SidecarCallError as e:
            if e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                with contextlib.suppress(SidecarCallError):  # best effort: free a straggler's slots
                    job.client.abort(job.request.request_id)
                return samples, f"no answer within the {self.deadline_s:.0f}s deadline"
            return samples, f"{e.code.name}: {e.details}"
        expected = len(job.prompts) * job.request.samples_per_prompt
        if len(samples) != expected:
            return samples, f"stream ended after {len(samples)} of {expected} samples"
        return samples, None

    # ---- statistics --------------------------------------------------------------------------
    def speculation_delta(self) -> SpeculationCounters:
        """Raw speculation counters accumulated on the live sidecars since the last call."""
        total = SpeculationCounters()
        for c in self.live():
            try:
                stats = c.stats()
            except SidecarCallError:
                continue
            before = self._counters.get(c.address)
            if before is None or stats.uptime_seconds < before[0]:  # first reading, or restarted
                before = (0.0, SpeculationCounters())
            total.add(stats.total.minus(before[1]))
            self._counters[c.address] = (stats.uptime_seconds, stats.total)
        return total

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def __enter__(self) -> Orchestrator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SourceFailed(Exception):
    """Ends a push stream without a commit because the trainer's weight source raised."""


_END = object()


class _Feed:
    """One sidecar's side of the fan-out: (name, tensor) pairs queued up to `limit_bytes`."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._items: deque[tuple[object, int]] = deque()
        self._bytes = 0
        self._changed = threading.Condition()

    def offer(self, item: object, nbytes: int, push: Future[Any]) -> None:
        """Queue `item` once it fits (one item always does), unless that push has already ended."""
        with self._changed:
            while self._items and self._bytes + nbytes > self.limit_bytes and not push.done():
                self._changed.wait(0.05)
            if push.done():
                return
            self._items.append((item, nbytes))
            self._bytes += nbytes
            self._changed.notify_all()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            with self._changed:
                while not self._items:
                    self._changed.wait()
                item, nbytes = self._items.popleft()
                self._bytes -= nbytes
                self._changed.notify_all()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
