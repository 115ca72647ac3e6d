"""A fleet of sidecars as one: rollouts spread over the live ones, weights fanned out to all.

The one implementation behind the trainer and any other framework (it imports nothing of the
trainer). Its rules:

Errors (`disposition`): a call error either means the *sidecar* cannot serve now, or that the
*caller's* request is wrong. Only the first moves work elsewhere:
- UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, or a stream that ended before all its samples: the
  sidecar is marked down (its straggling request aborted), its work re-routed to the others; it
  rejoins once its health check answers again and it has been pushed the current weights.
- RESOURCE_EXHAUSTED (admission queue full): the sidecar is busy, not down. Its work is
  re-routed, and the fleet backs off from it (doubling per busy answer, reset by a success); when
  every live sidecar is busy the fleet waits out the shortest back-off, `busy_retries` times at
  most, then surfaces the RESOURCE_EXHAUSTED.
- FAILED_PRECONDITION on Generate from a sidecar serving an older weight version than the fleet
  pushed (it restarted unseen): down, like an unavailable one, and brought up to date on rejoin.
- Everything else (INVALID_ARGUMENT, UNAUTHENTICATED, PERMISSION_DENIED, FAILED_PRECONDITION,
  NOT_FOUND, ABORTED, UNIMPLEMENTED, INTERNAL, ...): the caller's request (or credentials, or an
  engine bug it triggers) would fail the same way anywhere. It is raised to the caller as the
  sidecar's own `SidecarCallError` (code, message, address) and marks nothing down, so one bad
  request cannot walk through the fleet taking every sidecar out.

Generation: the unit of work is one prompt with its samples, a Generate call of its own whose
seed is derived from (request seed, the prompt's index in the caller's request); the engine
derives each sample's stream from that seed and the sample index. So every sample is a
function of (request seed, global prompt index, sample index) and of the weights only — not of
how many sidecars there are, which one served it, or what ran before (for an RL run the request
seed is derived from (run seed, step), so a resumed run samples what the uninterrupted one did).
Finished samples are kept as they stream in, even from a sidecar that fails later; a re-routed
prompt is asked for again up to its highest missing sample index (same seed, so the samples
already held come back identical and are dropped, counted in `regenerated`).

Sessions (multi-turn conversations, `GenerationRequest.session_ids`): a prompt of a session goes
to the sidecar its session is pinned to, so the next turn runs where the conversation's earlier
turns did; a new session is pinned to the live sidecar holding the fewest sessions; a session whose
sidecar is down is re-pinned (counted in `repinned`; the turn is served there from scratch, the
samples the same); one whose sidecar is only busy runs elsewhere that once and keeps its pin.
Pins are forgotten by `end_sessions`, or least recently used first beyond `max_sessions`.

Weights: `push_weights` exports each tensor once and streams it to every live sidecar at once
(`sidecar.client.weight_fanout`). Every Generate carries
`min_weight_version` = the fleet's version, so a stale sidecar refuses rather than sampling old
weights.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import grpc
import torch

from sidecar.client.client import ClientConfig, SidecarCallError, SidecarClient
from sidecar.client.draft_alarm import DraftAlarms
from sidecar.client.weight_fanout import WeightFanout, WeightSender, WeightSource, send_weight_stream
from sidecar.errors import SpecrlError
from sidecar.types import (
    DraftCollapse,
    GenerationRequest,
    PushResult,
    Sample,
    SidecarStats,
    SpeculationCounters,
    TensorSpec,
    WeightSelector,
)

log = logging.getLogger(__name__)
Code = grpc.StatusCode


class NoLiveSidecarError(SpecrlError):
    """Every sidecar of the fleet is down (unavailable, not answering, or behind)."""


class Disposition(enum.Enum):
    """What a failed call means for the fleet."""

    UNAVAILABLE = "unavailable"
    """The sidecar cannot serve now: mark it down, re-route its work."""
    BUSY = "busy"
    """The sidecar is overloaded: back off from it, re-route its work; it stays up."""
    CALLER = "caller"
    """The request (or credentials) is wrong wherever it runs: raise it to the caller."""


_UNAVAILABLE = frozenset({Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED})
_BUSY = frozenset({Code.RESOURCE_EXHAUSTED})


def disposition(code: grpc.StatusCode | None) -> Disposition:
    """The fleet's reading of a call's status code; None is a stream that ended early."""
    if code is None or code in _UNAVAILABLE:
        return Disposition.UNAVAILABLE
    if code in _BUSY:
        return Disposition.BUSY
    return Disposition.CALLER


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a hash of `parts` (no collisions between nearby tuples, unlike sums)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8, person=b"specrl-fleet").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(kw_only=True, slots=True)
class FleetConfig:
    """Deadlines, back-off and credentials of a fleet."""

    client: ClientConfig = field(default_factory=lambda: ClientConfig(timeout_s=10.0, retries=1))
    """Per-sidecar client settings: control-call deadline, token, TLS/mTLS."""
    deadline_s: float = 300.0
    """A Generate stream (or a push) that has not finished by then is given up on; its sidecar is
    marked down and its work re-routed."""
    probe_interval_s: float = 30.0
    """How often a down sidecar is probed for rejoining (a hung one costs a call deadline)."""
    stream_bytes: int = 256 << 20
    """Bytes of tensors a weight push may queue per sidecar ahead of its stream."""
    share_shm: bool = True
    """Local sidecars (shm negotiated, full pushes) read one shared-memory region the fleet writes
    once per push, instead of one region per sidecar written by each sidecar's stream."""
    max_streams_per_sidecar: int = 32
    """Generate calls (one per prompt) open at once per live sidecar; the rest wait their turn."""
    busy_backoff_s: float = 0.5
    """First back-off from a sidecar that answered RESOURCE_EXHAUSTED; doubles per busy answer."""
    max_busy_backoff_s: float = 10.0
    busy_retries: int = 6
    """Rounds the fleet waits for a busy fleet before surfacing RESOURCE_EXHAUSTED."""
    max_sessions: int = 100_000
    """Sessions (`GenerationRequest.session_ids`) the fleet keeps pinned; the least recently used
    is forgotten first (`end_sessions` forgets finished ones at once)."""

    def __post_init__(self) -> None:
        for name in ("deadline_s", "probe_interval_s", "busy_backoff_s", "max_busy_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"FleetConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("stream_bytes", "max_streams_per_sidecar", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"FleetConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.busy_retries < 0:
            raise ValueError(f"FleetConfig.busy_retries must be >= 0, got {self.busy_retries}")


@dataclass(kw_only=True, slots=True)
class FleetResult:
    """All samples of one request, and what happened on the way."""

    samples: list[Sample]
    """Sorted by (prompt_index, sample_index): indices of the caller's request."""
    seconds: float
    rerouted: int = 0
    """Samples asked of another sidecar after theirs failed."""
    regenerated: int = 0
    """Samples already held that came back again with a re-routed prompt (dropped)."""
    duplicates: int = 0
    """Samples received twice from one call (dropped; should stay 0)."""
    nonfinite: int = 0
    """Samples whose log-probs hold a NaN or an infinity (kept as they came; a warning names the
    sidecars and weight versions that served them)."""
    pinned: int = 0
    """Prompts of a session sent to the sidecar their session is pinned to."""
    repinned: int = 0
    """Sessions moved to another sidecar because theirs went down (their next turn prefills the
    whole conversation there)."""
    events: list[str] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class PushReport:
    """One weight push: the version, who serves it, how long it took, who went down."""

    version: int
    results: dict[str, PushResult]
    """Per address of the sidecars that now serve `version`."""
    seconds: float
    events: list[str] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class _Job:
    client: SidecarClient
    prompt: int
    """The prompt's index in the caller's request."""
    request: GenerationRequest


@dataclass(kw_only=True, slots=True)
class _Outcome:
    samples: list[Sample]
    error: SidecarCallError | None = None
    why: str = ""
    """Set when the call did not deliver every sample (error or dropped stream)."""


class Fleet:
    """Several sidecars as one (see the module docstring for the rules)."""

    def __init__(
        self,
        addresses: Sequence[str],
        config: FleetConfig | None = None,
        *,
        connect: Callable[[str, ClientConfig], SidecarClient] = SidecarClient,
        send: WeightSender = send_weight_stream,
    ) -> None:
        if not addresses:
            raise ValueError("a fleet needs at least one sidecar address")
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"sidecar addresses repeat: {list(addresses)}; give each sidecar once")
        self.config = config or FleetConfig()
        self._connect = connect
        self.clients = [connect(a, self.config.client) for a in addresses]
        self.version = 0
        """The weight version the fleet last pushed (every Generate requires at least it)."""
        self._weights: WeightSource | None = None
        self._names: list[str] | None = None
        self._selector = WeightSelector.ALL
        self._specs: dict[tuple[WeightSelector, tuple[str, ...]], list[TensorSpec]] = {}
        self._down: set[str] = set()
        self._next_probe: dict[str, float] = {}
        self._busy_until: dict[str, float] = {}
        self._busy_backoff: dict[str, float] = {}
        self._counters: dict[str, tuple[float, SpeculationCounters]] = {}
        self.latest_stats: dict[str, SidecarStats] = {}  # each sidecar's at the latest `speculation_delta`
        self._alarms = DraftAlarms()
        self._new_alarms: list[str] = []
        self._sessions: collections.OrderedDict[str, str] = collections.OrderedDict()
        """Session id -> the address of the sidecar it is pinned to (least recently used first)."""
        self._fanout = WeightFanout(
            stream_bytes=self.config.stream_bytes,
            deadline_s=self.config.deadline_s,
            share_shm=self.config.share_shm,
            send=send,
        )

    @property
    def send(self) -> WeightSender:
        """The per-sidecar step of a weight push (replace it to use another transport)."""
        return self._fanout.send

    @send.setter
    def send(self, send: WeightSender) -> None:
        self._fanout.send = send

    # ---- fleet state -------------------------------------------------------------------------
    def live(self) -> list[SidecarClient]:
        """The sidecars not marked down."""
        return [c for c in self.clients if c.address not in self._down]

    def down(self) -> list[str]:
        """Addresses of the sidecars marked down."""
        return [c.address for c in self.clients if c.address in self._down]

    def _mark_down(self, client: SidecarClient, why: str, events: list[str]) -> None:
        base = getattr(client, "delta_base", None)  # (test doubles of a client have none)
        if base is not None:
            base.forget()  # it may come back with other weights: its rejoin push goes in full
        if client.address not in self._down:
            self._down.add(client.address)
            self._next_probe[client.address] = time.monotonic() + self.config.probe_interval_s
            msg = f"sidecar {client.address} is down ({why})"
            log.warning(msg)
            events.append(msg)

    def _back_off(self, client: SidecarClient, why: str, events: list[str]) -> None:
        cfg = self.config
        delay = self._busy_backoff.get(client.address, cfg.busy_backoff_s / 2) * 2
        delay = min(delay, cfg.max_busy_backoff_s)
        self._busy_backoff[client.address] = delay
        self._busy_until[client.address] = time.monotonic() + delay
        msg = f"sidecar {client.address} is busy ({why}); backing off {delay:.2f}s"
        log.info(msg)
        events.append(msg)

    def served_versions(self) -> dict[str, int]:
        """Weight version each live sidecar serves (GetInfo)."""
        return {c.address: c.info().weight_version for c in self.live()}

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
            self._next_probe[old.address] = now + self.config.probe_interval_s
            c = self._connect(old.address, old.config)  # fresh channel: no reconnect backoff
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
                try:
                    failed: dict[SidecarClient, Exception] | str = self._fan_out(
                        [c], self._weights, self._names, self.version, self._selector
                    )[1]
                except SidecarCallError as e:
                    failed = str(e)
                if failed:
                    log.info(
                        "sidecar %s answers but could not take version %d yet: %s", c.address, self.version, failed
                    )
                    continue
            self._down.discard(c.address)
            msg = f"sidecar {c.address} rejoined at weight version {self.version}"
            log.warning(msg)
            events.append(msg)

    # ---- weights -----------------------------------------------------------------------------
    def push_weights(
        self,
        weights: WeightSource | Mapping[str, torch.Tensor],
        version: int | None = None,
        *,
        names: Sequence[str] | None = None,
        selector: WeightSelector = WeightSelector.ALL,
    ) -> PushReport:
        """Push `weights` to every live sidecar as `version` (default: the fleet's next one).

        `weights` is a state dict, or a callable yielding (name, tensor) pairs in the order
        `names` (without `names`, the callable's output is gathered into a dict first). Each
        tensor is exported once and streamed to all sidecars together. Unavailable sidecars are
        marked down; a caller error (the weights do not match the served model, a stale version,
        a wrong token) raises the sidecar's `SidecarCallError` and marks nothing down. An error
        raised by `weights()` itself propagates and no sidecar commits anything.
        """
        start = time.perf_counter()
        version = version if version is not None else self.version + 1
        if isinstance(weights, Mapping):
            mapping = weights
            source: WeightSource = lambda: mapping.items()  # noqa: E731
            names = list(mapping) if names is None else names
        elif names is None:
            gathered = dict(weights())
            source, names = (lambda: gathered.items()), list(gathered)
        else:
            source = weights
        events: list[str] = []
        results, failures = self._fan_out(self.live(), source, list(names), version, selector)
        caller = [e for e in failures.values() if isinstance(e, SidecarCallError) and _is_caller(e)]
        for client in list(failures):
            err = failures[client]
            if not (isinstance(err, SidecarCallError) and _is_caller(err)):
                self._mark_down(client, f"weight push failed: {err}", events)
        if caller:
            raise caller[0]
        if not self.live():
            raise NoLiveSidecarError(f"no sidecar accepted weight version {version}: {'; '.join(events)}")
        self.version, self._weights, self._names, self._selector = version, source, list(names), selector
        return PushReport(
            version=version,
            results={c.address: r for c, r in results.items()},
            seconds=time.perf_counter() - start,
            events=events,
        )

    def _fan_out(
        self,
        clients: list[SidecarClient],
        weights: WeightSource,
        names: list[str] | None,
        version: int,
        selector: WeightSelector,
    ) -> tuple[dict[SidecarClient, PushResult], dict[SidecarClient, Exception]]:
        """Stream `weights()` to `clients` at once; returns who committed and who failed (why)."""
        if not clients:
            return {}, {}
        if names is None:
            gathered = dict(weights())
            names, weights = list(gathered), lambda: gathered.items()
        failures: dict[SidecarClient, Exception] = {}
        key = (selector, tuple(names))
        specs = self._specs.get(key)
        if specs is None:  # the served model does not change: its specs are asked for once
            specs, unanswered = self._specs_in_order(clients, names, selector)
            failures.update(unanswered)
            clients = [c for c in clients if c not in failures]
            if not clients:
                return {}, failures
            self._specs = {key: specs}
        results, failed = self._fanout.push(clients, weights, specs, version, selector)
        return results, {**failures, **failed}

    def _specs_in_order(
        self, clients: list[SidecarClient], names: Sequence[str], selector: WeightSelector
    ) -> tuple[list[TensorSpec], dict[SidecarClient, Exception]]:
        """The served model's tensor specs in the order of `names` (from the first sidecar that
        answers DescribeWeights), and the sidecars that did not answer."""
        unanswered: dict[SidecarClient, Exception] = {}
        for c in clients:
            try:
                served, _ = c.describe_weights(selector)
            except SidecarCallError as e:
                if _is_caller(e):
                    raise  # e.g. a wrong token: the same everywhere; surfaces to the caller
                unanswered[c] = e
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

    # ---- generation --------------------------------------------------------------------------
    def generate(self, request: GenerationRequest, *, rejoin: bool = True) -> FleetResult:
        """Every (prompt, sample) of `request` exactly once, spread over the live sidecars.

        `rejoin`: first bring back down sidecars that answer again, pushing them the last pushed
        weights (`rejoin`). A caller generating while the trainer updates those weights (the
        asynchronous RL loop's producer thread) passes False and rejoins between updates instead.
        Raises `SidecarCallError` for a caller error (see the module docstring),
        `NoLiveSidecarError` when no sidecar is left to serve the rest.
        """
        start = time.perf_counter()
        rid = request.request_id or f"fleet-{time.time_ns():x}"
        g = request.samples_per_prompt
        got: dict[tuple[int, int], Sample] = {}
        broken: dict[str, set[int]] = {}  # sidecar address -> weight versions that served non-finite samples
        missing = {p: list(range(g)) for p in range(len(request.prompts))}
        events: list[str] = []
        result = FleetResult(samples=[], seconds=0.0, events=events)
        unavailable_rounds = busy_rounds = 0
        busy_here: set[str] = set()
        round_ = 0
        while missing:
            if rejoin:
                self.rejoin(events, force=False)
            live = self.live()
            if not live:
                raise NoLiveSidecarError(
                    f"no live sidecar for {sum(map(len, missing.values()))} samples: {'; '.join(events)}"
                )
            # sidecars that answered busy during this call get work again only if all did
            ready = self._wait_for_ready([c for c in live if c.address not in busy_here] or live)
            if round_ > 0:
                n = sum(map(len, missing.values()))
                result.rerouted += n
                msg = f"re-routing {n} samples of {len(missing)} prompts to {[c.address for c in ready]}"
                log.warning(msg)
                events.append(msg)
            jobs = self._plan(request, rid, missing, ready, round_, result)
            workers = min(len(jobs), self.config.max_streams_per_sidecar * len(ready))
            failing: set[str] = set()  # unavailable this round: its queued jobs are not started
            with ThreadPoolExecutor(max_workers=workers) as pool:
                outcomes = list(pool.map(self._run, jobs, [failing] * len(jobs)))
            caller: SidecarCallError | None = None
            saw_unavailable = saw_busy = saw_success = False
            for job, outcome in zip(jobs, outcomes, strict=True):
                seen: set[int] = set()
                for s in outcome.samples:
                    key = (job.prompt, s.sample_index)
                    if s.sample_index in seen:
                        result.duplicates += 1
                        continue
                    seen.add(s.sample_index)
                    if key in got:
                        result.regenerated += 1
                        continue
                    s.prompt_index, s.request_id = job.prompt, rid
                    got[key] = s
                    if s.nonfinite:
                        result.nonfinite += 1
                        broken.setdefault(job.client.address, set()).add(s.last_weight_version)
                if not outcome.why:
                    saw_success = True
                    self._busy_backoff.pop(job.client.address, None)
                    continue
                kind = self._classify(job.client, outcome.error)
                if kind is Disposition.CALLER:
                    assert outcome.error is not None
                    caller = caller or outcome.error
                elif kind is Disposition.BUSY:
                    saw_busy = True
                    busy_here.add(job.client.address)
                    if job.client.address not in self._down:
                        self._back_off(job.client, outcome.why, events)
                else:
                    saw_unavailable = True
                    self._mark_down(job.client, outcome.why, events)
            missing = {
                p: [i for i in range(g) if (p, i) not in got]
                for p in range(len(request.prompts))
                if any((p, i) not in got for i in range(g))
            }
            if caller is not None:
                raise caller
            if not missing:
                break
            round_ += 1
            unavailable_rounds += saw_unavailable
            busy_rounds += saw_busy and not (saw_unavailable or saw_success)
            if busy_rounds > self.config.busy_retries:
                raise SidecarCallError(
                    ",".join(c.address for c in live),
                    "Generate",
                    Code.RESOURCE_EXHAUSTED,
                    f"every sidecar stayed busy through {self.config.busy_retries} back-offs; "
                    f"{sum(map(len, missing.values()))} samples not produced: {'; '.join(events[-3:])}",
                )
            if unavailable_rounds > len(self.clients):
                raise NoLiveSidecarError(
                    f"{sum(map(len, missing.values()))} samples were never produced: {'; '.join(events)}"
                )
        result.samples = [got[k] for k in sorted(got)]
        result.seconds = time.perf_counter() - start
        if result.nonfinite:
            where = "; ".join(f"{a} (weight versions {sorted(v)})" for a, v in sorted(broken.items()))
            msg = (
                f"{result.nonfinite} of {len(result.samples)} samples have NaN or infinite log-probs, served by "
                f"{where}: the pushed weights (or their activations) are not finite; check the training run "
                "for divergence and push finite weights before training on these samples"
            )
            log.warning(msg)
            events.append(msg)
        return result

    def _wait_for_ready(self, live: list[SidecarClient]) -> list[SidecarClient]:
        """The live sidecars not backing off; if all are, wait out the shortest back-off."""
        now = time.monotonic()
        ready = [c for c in live if self._busy_until.get(c.address, 0.0) <= now]
        if ready:
            return ready
        wake = min(self._busy_until[c.address] for c in live)
        time.sleep(max(0.0, wake - now))
        return [c for c in live if self._busy_until[c.address] <= wake]

    def _plan(
        self,
        request: GenerationRequest,
        rid: str,
        missing: dict[int, list[int]],
        live: list[SidecarClient],
        round_: int,
        result: FleetResult,
    ) -> list[_Job]:
        """One Generate per missing prompt: a prompt of a session to its session's sidecar
        (`_pinned`), the others round-robin over `live`. Its seed is derived from (request seed,
        prompt index) and it asks for samples 0..max missing, so each sample's random stream is the
        same whoever serves it."""
        seed = request.sampling.seed
        min_version = max(request.min_weight_version, self.version)
        placed: collections.Counter[str] = collections.Counter(self._sessions.values() if request.session_ids else ())
        jobs = []
        for n, p in enumerate(sorted(missing)):
            session = request.session_ids[p] if request.session_ids else ""
            sub = replace(
                request,
                prompts=[request.prompts[p]],
                sampling=replace(request.sampling, seed=None if seed is None else derive_seed(seed, p)),
                samples_per_prompt=max(missing[p]) + 1,
                request_id=f"{rid}/p{p}" + (f"/r{round_}" if round_ else ""),
                min_weight_version=min_version,
                session_ids=[session] if session else [],
            )
            client = self._pinned(session, live, placed, result) if session else live[(n + round_) % len(live)]
            jobs.append(_Job(client=client, prompt=p, request=sub))
        return jobs

    def _pinned(
        self, session: str, live: list[SidecarClient], placed: collections.Counter[str], result: FleetResult
    ) -> SidecarClient:
        """The sidecar for a prompt of `session`: the one it is pinned to; a new session (or one
        whose sidecar is down) is pinned to the live sidecar with the fewest sessions; a session
        whose sidecar is up but not ready (backing off, busy) runs elsewhere this once and stays."""
        by_address = {c.address: c for c in live}
        address = self._sessions.get(session)
        if address in by_address:
            self._sessions.move_to_end(session)
            result.pinned += 1
            return by_address[address]
        least = min(live, key=lambda c: placed[c.address])
        if address is not None and address not in self._down:  # busy: its pin stays
            return least
        if address is not None:
            result.repinned += 1
            placed[address] -= 1
        self._sessions[session] = least.address
        self._sessions.move_to_end(session)
        placed[least.address] += 1
        while len(self._sessions) > self.config.max_sessions:
            _, at = self._sessions.popitem(last=False)
            placed[at] -= 1
        return least

    def end_sessions(self, session_ids: Sequence[str]) -> None:
        """Forget finished sessions (their sidecars take new ones first)."""
        for session in session_ids:
            self._sessions.pop(session, None)

    def session_sidecar(self, session_id: str) -> str | None:
        """The address a session is pinned to, or None."""
        return self._sessions.get(session_id)

    def _run(self, job: _Job, failing: set[str]) -> _Outcome:
        """Stream one prompt's request; the samples received and, if incomplete, why. A job whose sidecar
        failed as unavailable this round (`failing`) is not started: a hung sidecar costs one deadline."""
        samples: list[Sample] = []
        if job.client.address in failing:
            return _Outcome(samples=samples, why="an earlier call to it failed this round")
        deadline = self.config.deadline_s
        try:
            for s in job.client.stream_generate(job.request, timeout_s=deadline):
                samples.append(s)
        except SidecarCallError as e:
            if disposition(e.code) is Disposition.UNAVAILABLE:
                failing.add(job.client.address)
            if e.code == Code.DEADLINE_EXCEEDED:
                with contextlib.suppress(SidecarCallError):  # best effort: free a straggler's slots
                    job.client.abort(job.request.request_id)
                return _Outcome(samples=samples, error=e, why=f"no answer within the {deadline:.0f}s deadline")
            return _Outcome(samples=samples, error=e, why=f"{e.code.name}: {e.details}")
        if len(samples) < job.request.samples_per_prompt:
            failing.add(job.client.address)
            return _Outcome(
                samples=samples, why=f"stream ended after {len(samples)} of {job.request.samples_per_prompt} samples"
            )
        return _Outcome(samples=samples)

    def _classify(self, client: SidecarClient, error: SidecarCallError | None) -> Disposition:
        """`disposition`, except that a Generate refused for stale weights by a sidecar that is
        behind the fleet's version means the sidecar (not the caller) needs attention."""
        kind = disposition(None if error is None else error.code)
        if error is not None and error.code == Code.FAILED_PRECONDITION and self.version > 0:
            with contextlib.suppress(SidecarCallError):
                if client.info().weight_version < self.version:
                    return Disposition.UNAVAILABLE
        return kind

    # ---- statistics --------------------------------------------------------------------------
    def speculation_delta(self) -> SpeculationCounters:
        """Raw speculation counters accumulated on the live sidecars since the last call; each
        sidecar's stats are kept (`latest_stats`) and its draft-collapse alarm read on the way."""
        total = SpeculationCounters()
        for c in self.live():
            try:
                stats = c.stats()
            except SidecarCallError:
                continue
            alarm = self._alarms.observe(c.address, stats)  # logged once per collapse
            if alarm is not None:
                self._new_alarms.append(alarm)
            before = self._counters.get(c.address)
            if before is None or stats.uptime_seconds < before[0]:  # first reading, or restarted
                before = (0.0, SpeculationCounters())
            total.add(stats.total.minus(before[1]))
            self._counters[c.address] = (stats.uptime_seconds, stats.total)
            self.latest_stats[c.address] = stats
        return total

    def draft_collapses(self) -> dict[str, DraftCollapse]:
        """Each sidecar's draft collapse at its latest reading (`speculation_delta`); empty if none."""
        live = {c.address for c in self.live()}
        return {a: c for a, c in self._alarms.raised().items() if a in live}

    def take_draft_alarms(self) -> list[str]:
        """The warning lines of the collapses raised since the last call, one per collapse."""
        out, self._new_alarms = self._new_alarms, []
        return out

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self._fanout.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_caller(error: SidecarCallError) -> bool:
    return disposition(error.code) is Disposition.CALLER
