"""The typed Python client of specrl.v1 (one sidecar; several as one: `sidecar.client.fleet`).

Domain types in, domain types out (`sidecar.types`; conversion in `sidecar.protocol.convert`,
shared with the server). Every call has a deadline. Retries happen only where repeating a call
cannot change anything: the read-only GetInfo, GetStats, DescribeWeights and health checks,
and the idempotent Pause, Resume and SetSpeculation, with capped exponential backoff on
UNAVAILABLE. Generate, Abort and PushWeights are never retried blindly: a repeated Generate
would sample again, a repeated push would be refused as a stale version.

Failures raise `SidecarCallError`, which carries the gRPC status code, the server's message
and the sidecar's address.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import sidecar.protocol.convert as convert
import sidecar.protocol.convert_stats as convert_stats
import sidecar.protocol.weight_wire as weight_wire
from sidecar.client.transport import TransportChoice, TransportConfig, TransportSession
from sidecar.client.weight_sender import DEFAULT_CHUNK_BYTES, CollectiveSender, TransportSender, iter_push_requests
from sidecar.errors import SpecrlError, TransportUnavailableError
from sidecar.protocol import services
from sidecar.protocol.specrl.v1 import control_pb2, rollout_pb2, weights_pb2
from sidecar.security import SecurityConfig, auth_metadata, channel_credentials, check_token
from sidecar.types import (
    CollectiveRendezvous,
    GenerationRequest,
    PreparedTransport,
    PushItem,
    PushResult,
    Sample,
    ScoreRequest,
    ScoreResult,
    ShmProbe,
    SidecarInfo,
    SidecarStats,
    TensorSpec,
    WeightSelector,
    WeightTransport,
)
from sidecar.weight_transport.delta import DeltaBase, plan_push

log = logging.getLogger(__name__)
T = TypeVar("T")
MiB = 1 << 20
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class SidecarCallError(SpecrlError):
    """A specrl.v1 call that failed: `code` (grpc.StatusCode), `details` (the server's message)."""

    def __init__(self, address: str, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method} on {address} failed with {code.name}: {details}")
        self.address = address
        self.method = method
        self.code = code
        self.details = details


@dataclass(kw_only=True, slots=True)
class ClientConfig:
    """Deadlines, retries and security of a client."""

    timeout_s: float = 30.0
    """Deadline of each unary call."""
    generate_timeout_s: float = 3600.0
    """Deadline of a whole Generate stream."""
    push_timeout_s: float = 3600.0
    """Deadline of a whole weight push."""
    retries: int = 4
    """Extra attempts of a safe call after UNAVAILABLE."""
    backoff_s: float = 0.1
    """First backoff; doubles per attempt (with jitter) up to max_backoff_s."""
    max_backoff_s: float = 2.0
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """TLS (`peer_ca`, `tls`; `cert` and `key` for mutual TLS) and where the bearer token comes from."""
    token: str | None = field(default=None, repr=False)
    """The bearer token itself, given or already read (kept out of repr, so it is never logged);
    None: read when the client is created, from `security.token_file` or $SPECRL_TOKEN."""
    max_message_mib: int = 64
    transports: TransportConfig = field(default_factory=TransportConfig)
    """Weight transports to negotiate (shm with a proven same-host sidecar by default;
    collective when configured); grpc always works."""
    sparse_deltas: bool = False
    """Send each tensor as a sparse delta against the last push to that sidecar when that is
    smaller (weights.proto, "Sparse deltas"); keeps one served-dtype copy of the pushed tensors
    per sidecar. Off by default: measured (BENCHMARKS.md, "Sparse delta pushes"), it saves bytes
    only for bfloat16 serving at real-RL update sizes (and costs seconds on one host); the demo
    serves float32, where Muon and AdamW change ~every element each step."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "generate_timeout_s", "push_timeout_s", "backoff_s", "max_backoff_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ClientConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        check_token(self.token)


class SidecarClient:
    """A connection to one sidecar."""

    def __init__(self, address: str, config: ClientConfig | None = None) -> None:
        self.address = address
        self.config = config or ClientConfig()
        c = self.config
        options = [
            ("grpc.max_send_message_length", c.max_message_mib * MiB),
            ("grpc.max_receive_message_length", c.max_message_mib * MiB),
            # A client owns its connections: without this, gRPC shares subchannels between channels
            # to the same address, and a new client for a restarted sidecar inherits the dead
            # connection's reconnect back-off (calls fail at once with the stale "connection
            # refused" until it expires), which defeats the fleet's fresh-channel rejoin.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        token = c.token if c.token is not None else c.security.read_token()
        check_token(token)
        creds = channel_credentials(c.security)
        if creds is not None:
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self._metadata = auth_metadata(token)
        self._rollout = services.RolloutStub(self.channel)
        self._weights = services.WeightStub(self.channel)
        self._control = services.ControlStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        # PushWeights with pre-serialised requests (weight_wire.push_item_to_wire: one copy per chunk).
        self._push = self.channel.stream_unary(
            services.PUSH_WEIGHTS_METHOD,
            request_serializer=None,
            response_deserializer=weights_pb2.PushWeightsResponse.FromString,
        )
        self.transport_session = TransportSession(config=c.transports)
        """This sidecar's negotiated weight transport (`transport_session.choice` says which and why)."""
        self.delta_base = DeltaBase()
        """What the next delta push is computed against (`delta_base.forget()`: next push full)."""
        self._data_plane_lock = threading.Lock()

    # --- plumbing ---------------------------------------------------------------------------

    def _error(self, method: str, e: grpc.RpcError) -> SidecarCallError:
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = e.details() if hasattr(e, "details") else str(e)
        return SidecarCallError(self.address, method, code, details or "")

    def _unary(self, method: str, fn: Callable[..., T], request: Any, *, retry: bool) -> T:
        attempts = 1 + (self.config.retries if retry else 0)
        delay = self.config.backoff_s
        for attempt in range(attempts):
            try:
                return fn(request, timeout=self.config.timeout_s, metadata=self._metadata)
            except grpc.RpcError as e:
                err = self._error(method, e)
                if err.code != grpc.StatusCode.UNAVAILABLE or attempt + 1 == attempts:
                    raise err from None
                log.debug("%s; retrying in %.2fs", err, delay)
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.config.max_backoff_s)
        raise AssertionError("unreachable")

    # --- control ----------------------------------------------------------------------------

    def info(self) -> SidecarInfo:
        msg = self._unary("GetInfo", self._control.GetInfo, control_pb2.GetInfoRequest(), retry=True)
        return convert.info_from_pb(msg)

    def stats(self) -> SidecarStats:
        msg = self._unary("GetStats", self._control.GetStats, control_pb2.GetStatsRequest(), retry=True)
        return convert_stats.stats_from_pb(msg)

    def pause(self) -> bool:
        """Pause; returns whether it was already paused."""
        return self._unary("Pause", self._control.Pause, control_pb2.PauseRequest(), retry=True).was_paused

    def resume(self) -> bool:
        """Resume; returns whether it was paused."""
        return self._unary("Resume", self._control.Resume, control_pb2.ResumeRequest(), retry=True).was_paused

    def set_speculation(self, k: int, speculation_auto: bool = False) -> int:
        """Set the default draft length (speculation_auto: the sidecar chooses k in 0..k per engine
        step); returns the previous k."""
        msg = self._unary(
            "SetSpeculation",
            self._control.SetSpeculation,
            control_pb2.SetSpeculationRequest(speculation_k=k, speculation_auto=speculation_auto),
            retry=True,
        )
        return int(msg.previous_speculation_k)

    def health(self, service: str = "") -> bool:
        """True when the sidecar (or one of its services) reports SERVING; never raises."""
        try:
            reply = self._unary(
                "Health.Check", self._health.Check, health_pb2.HealthCheckRequest(service=service), retry=False
            )
        except SidecarCallError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    # --- rollout ----------------------------------------------------------------------------

    def stream_generate(self, request: GenerationRequest, timeout_s: float | None = None) -> Iterator[Sample]:
        """Samples as they finish. Closing the iterator early cancels the call (freeing its
        slots on the sidecar)."""
        call = self._rollout.Generate(
            convert.generation_request_to_pb(request),
            timeout=timeout_s or self.config.generate_timeout_s,
            metadata=self._metadata,
        )
        try:
            for msg in call:
                yield convert.sample_from_pb(msg.sample)
        except grpc.RpcError as e:
            raise self._error("Generate", e) from None
        finally:
            call.cancel()  # no-op after a normal end

    def generate(self, request: GenerationRequest, timeout_s: float | None = None) -> list[Sample]:
        """All samples of `request`, sorted by (prompt_index, sample_index)."""
        samples = list(self.stream_generate(request, timeout_s))
        return sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))

    def score(self, request: ScoreRequest) -> ScoreResult:
        """Teacher-forced log-probs of given sequences (RolloutService.Score). Read-only, so
        retried on UNAVAILABLE like GetInfo."""
        msg = self._unary("Score", self._rollout.Score, convert.score_request_to_pb(request), retry=True)
        return convert.score_result_from_pb(msg)

    def abort(self, request_id: str) -> tuple[bool, int]:
        """Abort a live Generate call; returns (found, samples aborted)."""
        msg = self._unary("Abort", self._rollout.Abort, rollout_pb2.AbortRequest(request_id=request_id), retry=False)
        return bool(msg.found), int(msg.aborted_samples)

    # --- weights ----------------------------------------------------------------------------

    def describe_weights(
        self, selector: WeightSelector = WeightSelector.ALL, *, include_checksums: bool = False
    ) -> tuple[list[TensorSpec], int]:
        """The tensors a push of `selector` must carry, and the served version. With
        `include_checksums` each spec's crc32 is that of the served tensor (0: the engine
        cannot tell)."""
        msg = self._unary(
            "DescribeWeights",
            self._weights.DescribeWeights,
            weights_pb2.DescribeWeightsRequest(
                selector=convert.selector_to_pb(selector), include_checksums=include_checksums
            ),
            retry=True,
        )
        return convert.describe_weights_from_pb(msg)

    def offered_transports(self) -> list[WeightTransport]:
        """The weight transports the sidecar offers (DescribeWeights)."""
        msg = self._unary(
            "DescribeWeights",
            self._weights.DescribeWeights,
            weights_pb2.DescribeWeightsRequest(selector=convert.selector_to_pb(WeightSelector.DRAFT)),
            retry=True,
        )
        return convert.transports_from_pb(msg)

    def prepare_transport(self, request: ShmProbe | CollectiveRendezvous, timeout_s: float) -> PreparedTransport:
        """PrepareTransport: have the sidecar read a shm probe or join a collective group."""
        try:
            msg = self._weights.PrepareTransport(
                convert.prepare_transport_to_pb(request), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise self._error("PrepareTransport", e) from None
        return convert.prepared_from_pb(msg)

    def negotiate_transport(self) -> TransportChoice:
        """The transport for pushes to this sidecar: kept once chosen, chosen again after it
        failed. Falls back to grpc (logging why) when no faster one works."""
        if self.transport_session.choice is not None:
            return self.transport_session.choice
        try:
            offered = self.offered_transports()
        except SidecarCallError as e:
            offered = [WeightTransport.GRPC]
            log.warning("sidecar %s did not list its transports (%s); assuming grpc only", self.address, e)
        return self.transport_session.negotiate(self.address, offered, self.prepare_transport)

    def push_weights(
        self,
        named_tensors: NamedTensors,
        version: int,
        selector: WeightSelector = WeightSelector.ALL,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        specs: Sequence[TensorSpec] | None = None,
        timeout_s: float | None = None,
        full: bool = False,
    ) -> PushResult:
        """Push new weights over the negotiated transport and return once the sidecar serves
        `version` (`PushResult.transport` says which plane carried the bytes).

        With `ClientConfig.sparse_deltas`, tensors go as sparse deltas against this client's last
        push where smaller; the first push, `full=True`, and the push after a failed one are
        sent in full, and a delta push the sidecar refuses is sent again in full at once.

        `named_tensors` is a state dict, or an iterable of (name, tensor) pairs streamed one at
        a time (its order must be `specs`', which default to DescribeWeights' for `selector`).
        A push that fails on a fast transport drops it; the next push negotiates again.
        """
        if specs is None and not isinstance(named_tensors, Mapping):
            specs, _ = self.describe_weights(selector)
        if self.config.sparse_deltas:
            return self._push_with_deltas(named_tensors, specs, version, selector, chunk_bytes, timeout_s, full)
        return self._push_planned(named_tensors, version, selector, chunk_bytes, specs, timeout_s)

    def _push_with_deltas(
        self,
        named_tensors: NamedTensors,
        specs: Sequence[TensorSpec] | None,
        version: int,
        selector: WeightSelector,
        chunk_bytes: int,
        timeout_s: float | None,
        full: bool,
    ) -> PushResult:
        if full:
            self.delta_base.forget()
        pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if specs is not None:  # the iterable's order is the manifest's; check it as iter_push_requests does
            pairs = _in_order(pairs, specs)
        plan = plan_push(pairs, self.delta_base)
        self.delta_base.forget()  # whatever happens now, only a success names a new base
        try:
            result = self._push_planned(
                plan.wire, version, selector, chunk_bytes, plan.specs, timeout_s, plan.base_version
            )
        except SidecarCallError as e:
            if not plan.base_version or e.code not in (
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.INVALID_ARGUMENT,
            ):
                raise
            log.warning("sidecar %s refused a delta push (%s); pushing the full tensors", self.address, e.details)
            plan = plan_push(plan.full.items(), self.delta_base)  # no base: every tensor in full
            result = self._push_planned(plan.wire, version, selector, chunk_bytes, plan.specs, timeout_s)
        # A delta it applied says the sidecar accepts them; after a full push, ask (one call).
        if plan.base_version or self._accepts_deltas():
            self.delta_base.version, self.delta_base.tensors = version, plan.full
        return result

    def _accepts_deltas(self) -> bool:
        msg = self._unary(
            "DescribeWeights",
            self._weights.DescribeWeights,
            weights_pb2.DescribeWeightsRequest(selector=convert.selector_to_pb(WeightSelector.DRAFT)),
            retry=True,
        )
        return bool(msg.accepts_deltas)

    def _push_planned(
        self,
        named_tensors: NamedTensors,
        version: int,
        selector: WeightSelector,
        chunk_bytes: int,
        specs: Sequence[TensorSpec] | None,
        timeout_s: float | None,
        base_version: int = 0,
    ) -> PushResult:
        self.negotiate_transport()
        # One push at a time may use this client's region or group; a concurrent one goes over
        # grpc (and the sidecar, which serialises pushes, refuses whichever comes second).
        exclusive = self._data_plane_lock.acquire(blocking=False)
        try:
            plane = self.transport_session.sender if exclusive else None
            return self._push_once(named_tensors, version, selector, chunk_bytes, specs, timeout_s, plane, base_version)
        finally:
            if exclusive:
                self._data_plane_lock.release()

    def _push_once(
        self,
        named_tensors: NamedTensors,
        version: int,
        selector: WeightSelector,
        chunk_bytes: int,
        specs: Sequence[TensorSpec] | None,
        timeout_s: float | None,
        plane: TransportSender | None,
        base_version: int = 0,
    ) -> PushResult:
        items = iter_push_requests(
            named_tensors, version, selector, chunk_bytes, specs=specs, data_plane=plane, base_version=base_version
        )
        return self.push_items(items, timeout_s=timeout_s, plane=plane)

    def push_items(
        self, items: Iterable[PushItem], *, timeout_s: float | None = None, plane: TransportSender | None = None
    ) -> PushResult:
        """Send one push given as its items (manifest, chunks or placed tensors, commit), consumed
        lazily as gRPC sends them: the primitive under `push_weights` and the incremental
        `sidecar.integrations.weight_session.WeightUpdateSession` (which sends chunks over grpc,
        `plane` None). `plane` is the transport `items` placed tensors on, dropped when the push
        breaks it. An exception raised by `items` ends the stream without a commit (the sidecar
        applies nothing) and is re-raised here."""
        sender_failure: list[Exception] = []

        def requests() -> Iterator[bytes]:
            try:
                for item in items:
                    yield weight_wire.push_item_to_wire(item)
            except Exception as e:  # gRPC would hide it behind UNKNOWN; re-raised below
                sender_failure.append(e)
                raise

        drawn = _StoppableRequests(requests())
        try:
            msg = self._push(drawn, timeout=timeout_s or self.config.push_timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            error = self._error("PushWeights", e)
            dropped = plane is not None and (
                isinstance(plane, CollectiveSender)  # a failed broadcast sequence leaves the group out of step
                or error.code == grpc.StatusCode.UNAVAILABLE  # the plane (or the sidecar) is gone: negotiate again
                or any(isinstance(f, TransportUnavailableError) for f in sender_failure)
            )
            # gRPC draws requests on its own thread, which may be placing a tensor as the call
            # ends: a plane kept for the next push must not be written once this one returns.
            drawn.stop(wait=plane is not None and not dropped)
            if dropped:
                self.transport_session.drop(str(sender_failure[0]) if sender_failure else error.details)
            if sender_failure:
                failure = sender_failure[0]
                if isinstance(failure, TransportUnavailableError):  # the transport broke: a sidecar failure
                    raise SidecarCallError(
                        self.address, "PushWeights", grpc.StatusCode.UNAVAILABLE, str(failure)
                    ) from None
                raise failure from None  # our own tensors were wrong; the stream ended without a commit
            raise error from None
        return convert.push_result_from_pb(msg)

    # --- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        self.transport_session.close()
        self.channel.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StoppableRequests:
    """A push's requests as gRPC draws them (on its own thread), which the caller can stop:
    after `stop` nothing more is drawn, and with `wait` the draw in progress, if any, has
    finished (a tensor being written into a transport that the next push reuses)."""

    def __init__(self, requests: Iterator[bytes]) -> None:
        self._requests = requests
        self._lock = threading.Lock()
        self._stopped = False

    def __iter__(self) -> _StoppableRequests:
        return self

    def __next__(self) -> bytes:
        with self._lock:
            if self._stopped:
                raise StopIteration
            return next(self._requests)

    def stop(self, *, wait: bool) -> None:
        if wait:
            with self._lock:
                self._stopped = True
        else:  # a draw that may block (a broadcast to a peer that left, a caller's queue) is abandoned
            self._stopped = True


def _in_order(
    pairs: Iterable[tuple[str, torch.Tensor]], specs: Sequence[TensorSpec]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The pairs, checked against the expected manifest (names and count)."""
    n = 0
    for n, (name, tensor) in enumerate(pairs, 1):
        if n > len(specs) or specs[n - 1].name != name:
            want = specs[n - 1].name if n <= len(specs) else "nothing"
            raise ValueError(f"tensor {n - 1} is {name!r} but the manifest expects {want}")
        yield name, tensor
    if n != len(specs):
        raise ValueError(f"the tensors ended after {n} of the {len(specs)} manifest entries")
