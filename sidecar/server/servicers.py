"""The specrl.v1 servicers: Rollout, Weights and Control, on top of the scheduler.

Each RPC converts its request with `sidecar.protocol.convert`, checks request limits, and
hands the work to the `Scheduler` (which owns the engine). Handlers are coroutines of a
`grpc.aio` server: waiting for samples or for a step boundary awaits (no thread per open
stream); CPU-heavy synchronous work — staging and checksumming a weight push — runs in a
worker thread (`asyncio.to_thread`), so the loop always answers health, info, stats and abort. Every failure leaves as
`context.abort(code, message)` with the status code proto/specrl/v1 documents for it; the
message says what was wrong and what to do. `status_for` is the one table from specrl's
exceptions to gRPC codes. A failing request never takes the server down: unexpected
exceptions become INTERNAL for that call only.

`sidecar.server.process.Sidecar` assembles them into a running server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any, NoReturn

import grpc

import sidecar.protocol.convert as convert
import sidecar.protocol.convert_stats as convert_stats
from sidecar import errors
from sidecar.protocol import services
from sidecar.protocol.specrl.v1 import control_pb2, rollout_pb2, weights_pb2
from sidecar.server import metrics
from sidecar.server.memory import release_freed_memory
from sidecar.server.scheduler import RequestCancelled, Scheduler
from sidecar.server.weight_receiver import TransportOffer, WeightReceiver
from sidecar.types import (
    GenerationRequest,
    PushItem,
    PushResult,
    RequestLimits,
    ScoreRequest,
    SidecarInfo,
    SidecarStats,
)

log = logging.getLogger(__name__)

_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.UnknownTensorError, grpc.StatusCode.NOT_FOUND),
    (errors.WeightMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.StaleVersionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.DeltaBaseError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ServedVersionTooOldError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.PushInProgressError, grpc.StatusCode.ABORTED),
    (errors.PushCancelledError, grpc.StatusCode.CANCELLED),
    (errors.ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (errors.ApplyTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.NotSupportedError, grpc.StatusCode.UNIMPLEMENTED),
    (errors.EngineFailure, grpc.StatusCode.INTERNAL),
    (errors.TransportUnavailableError, grpc.StatusCode.UNAVAILABLE),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code of a specrl exception (INTERNAL for anything unexpected)."""
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _status_and_message(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, errors.SpecrlError):
        log.error("unexpected error in an RPC", exc_info=exc)
        return code, f"internal error ({type(exc).__name__}: {exc}); the sidecar is still serving, retry or report it"
    return code, str(exc)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    await context.abort(*_status_and_message(exc))
    raise AssertionError("context.abort returned")  # grpc raises; this line documents NoReturn


def check_limits(request: GenerationRequest, limits: RequestLimits) -> None:
    """Raise InvalidRequestError if `request` exceeds `limits`, naming the limit."""
    if len(request.prompts) > limits.max_prompts:
        raise errors.InvalidRequestError(
            f"{len(request.prompts)} prompts exceed the limit of {limits.max_prompts}; split the request"
        )
    samples = len(request.prompts) * request.samples_per_prompt
    if samples > limits.max_samples:
        raise errors.InvalidRequestError(
            f"{samples} samples (prompts x samples_per_prompt) exceed the limit of {limits.max_samples}; "
            "split the request"
        )
    longest = max(len(p) for p in request.prompts)
    if longest > limits.max_prompt_tokens:
        raise errors.InvalidRequestError(
            f"a prompt of {longest} tokens exceeds the limit of {limits.max_prompt_tokens}; shorten it"
        )
    if request.sampling.max_new_tokens > limits.max_new_tokens:
        raise errors.InvalidRequestError(
            f"max_new_tokens {request.sampling.max_new_tokens} exceeds the limit of {limits.max_new_tokens}"
        )


def check_score_limits(request: ScoreRequest, limits: RequestLimits) -> None:
    """Raise InvalidRequestError if a Score request exceeds `limits` (the Generate limits: a
    scored sequence is at most a prompt plus its completion)."""
    if len(request.sequences) > limits.max_prompts:
        raise errors.InvalidRequestError(
            f"{len(request.sequences)} sequences exceed the limit of {limits.max_prompts}; split the request"
        )
    longest = max(len(s) for s in request.sequences)
    if longest > limits.max_prompt_tokens + limits.max_new_tokens:
        raise errors.InvalidRequestError(
            f"a sequence of {longest} tokens exceeds the limit of {limits.max_prompt_tokens + limits.max_new_tokens} "
            "(max_prompt_tokens + max_new_tokens); shorten it"
        )


class RolloutService(services.RolloutServicer):
    """Generate and Abort."""

    def __init__(self, scheduler: Scheduler, limits: RequestLimits) -> None:
        self._scheduler = scheduler
        self._limits = limits

    async def Generate(self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            domain = convert.generation_request_from_pb(request)
            check_limits(domain, self._limits)
            handle = self._scheduler.submit(domain, loop=asyncio.get_running_loop())
        except Exception as e:
            await _abort(context, e)
        try:
            while True:
                try:
                    sample = await handle.next()
                except RequestCancelled:  # the client left; nobody is listening
                    return
                except Exception as e:
                    await _abort(context, e)
                if sample is None:
                    return
                yield rollout_pb2.GenerateResponse(sample=convert.sample_to_pb(sample))
        finally:  # the client left (the task was cancelled) or the call ended: free the slots
            handle.cancel()  # a no-op once the request is finished

    async def Score(self, request: rollout_pb2.ScoreRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            domain = convert.score_request_from_pb(request)
            check_score_limits(domain, self._limits)
            return convert.score_result_to_pb(await self._scheduler.score_async(domain))
        except Exception as e:
            await _abort(context, e)

    async def Abort(self, request: rollout_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> Any:
        if not request.request_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty; name the Generate call to abort"
            )
        try:
            found, n = await self._scheduler.abort_async(request.request_id)
        except Exception as e:
            await _abort(context, e)
        return rollout_pb2.AbortResponse(found=found, aborted_samples=n)


class WeightService(services.WeightServicer):
    """PushWeights, DescribeWeights and PrepareTransport (logic in weight_transport.receiver)."""

    def __init__(self, scheduler: Scheduler, *, keep_staging: bool, transports: TransportOffer | None = None) -> None:
        self._scheduler = scheduler
        self._receiver = WeightReceiver(
            model_specs=scheduler.model_specs,
            served_version=lambda: scheduler.weight_version,
            keep_staging=keep_staging,
            transports=transports,
        )

    async def PushWeights(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        """Receives on a worker thread that pulls the stream's messages from the loop one at a
        time (no buffering beyond gRPC's window), so staging and CRCs never block the loop."""
        ended = threading.Event()
        context.add_done_callback(lambda _: ended.set())
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        reader = _StreamReader(request_iterator, asyncio.get_running_loop())
        try:
            outcome = await asyncio.to_thread(
                self._push_and_release,
                _push_items(iter(reader)),
                is_active=lambda: not ended.is_set(),
                time_remaining=lambda: None if deadline is None else max(deadline - time.monotonic(), 0.0),
            )
        except asyncio.CancelledError:  # the client went away: the worker sees the stream end and stops
            ended.set()
            reader.close()
            raise
        if isinstance(outcome, PushResult):
            return convert.push_result_to_pb(outcome)
        await context.abort(*outcome)

    def _push_and_release(
        self, items: Iterator[PushItem], *, is_active: Callable[[], bool], time_remaining: Callable[[], float | None]
    ) -> PushResult | tuple[grpc.StatusCode, str]:
        """The whole push, synchronously: its result, or the (status, message) of its failure."""
        failure: tuple[grpc.StatusCode, str] | None = None
        try:
            result = self._push(items, is_active=is_active, time_remaining=time_remaining)
        except Exception as e:
            failure = _status_and_message(e)
        release_freed_memory()  # the staging tensors died with _push's frame (and the exception)
        return failure if failure is not None else result

    def _push(
        self, items: Iterator[PushItem], *, is_active: Callable[[], bool], time_remaining: Callable[[], float | None]
    ) -> PushResult:
        with self._receiver.claim(items):
            staged = self._receiver.receive(items, is_active=is_active)
            if not is_active():
                raise errors.PushCancelledError("the client went away before the push was applied")
            previous, apply_s, free = self._scheduler.apply_weights(staged, timeout_s=time_remaining())
            self._receiver.keep(staged, free)
        log.info("serving weight version %d (was %d; bytes over %s)", staged.version, previous, staged.transport.value)
        return PushResult(
            version=staged.version,
            previous_version=previous,
            bytes_received=staged.bytes_received,
            tensors_updated=len(staged.tensors),
            receive_seconds=staged.receive_seconds,
            apply_seconds=apply_s,
            transport=staged.transport,
        )

    async def DescribeWeights(
        self, request: weights_pb2.DescribeWeightsRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            selector = convert.selector_from_pb(request.selector)
            specs, version = self._scheduler.model_specs(selector), self._scheduler.weight_version
            if request.include_checksums:
                version, crcs = await self._scheduler.served_checksums_async(selector)
                if crcs is not None:
                    specs = [replace(s, crc32=crcs[s.name]) for s in specs]
        except Exception as e:
            await _abort(context, e)
        return convert.describe_weights_to_pb(
            specs, version, self._receiver.transports.offered, accepts_deltas=self._receiver.transports.sparse_deltas
        )

    async def PrepareTransport(
        self, request: weights_pb2.PrepareTransportRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        """Probing shm or joining a collective group blocks (a join up to its timeout): on a
        worker thread, never on the event loop."""
        try:
            prepared = convert.prepare_transport_from_pb(request)
            answer = await asyncio.to_thread(self._receiver.prepare_transport, prepared)
        except Exception as e:
            await _abort(context, e)
        return convert.prepared_to_pb(answer)

    def close(self) -> None:
        """Leave every collective group."""
        self._receiver.close()


_END = object()


class _StreamReader:
    """A blocking iterator over an aio request stream, for a worker thread: each `next` reads
    one message on the loop. A stream that breaks (client gone, server stopping) or a reader
    closed by the handler raises `PushCancelledError`, so the worker never waits forever."""

    def __init__(self, stream: AsyncIterator[Any], loop: asyncio.AbstractEventLoop) -> None:
        self._stream = stream
        self._iterator: AsyncIterator[Any] | None = None  # made on the loop, at the first read
        self._loop = loop
        self._pending: concurrent.futures.Future[Any] | None = None
        self._closed = False

    async def _read(self) -> Any:
        if self._iterator is None:
            self._iterator = self._stream.__aiter__()
        try:
            return await self._iterator.__anext__()
        except StopAsyncIteration:
            return _END

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                if self._closed:
                    raise concurrent.futures.CancelledError()
                self._pending = asyncio.run_coroutine_threadsafe(self._read(), self._loop)
                item = self._pending.result()
            except (grpc.RpcError, concurrent.futures.CancelledError, asyncio.CancelledError, RuntimeError) as e:
                raise errors.PushCancelledError(
                    f"the push stream broke mid-way ({type(e).__name__}); nothing was applied, the old weights "
                    "still serve"
                ) from None
            if item is _END:
                return
            yield item

    def close(self) -> None:
        """Stop reading: a pending read is cancelled, later reads fail (thread-safe)."""
        self._closed = True
        pending = self._pending
        if pending is not None:
            pending.cancel()


def _push_items(requests: Iterator[Any]) -> Iterator[PushItem]:
    """The push stream (already domain items, see services.PUSH_WEIGHTS_METHOD); a message that
    could not be read raises its InvalidRequestError, a vanished client PushCancelledError."""
    try:
        for item in requests:
            if isinstance(item, Exception):
                raise item
            yield item
    except grpc.RpcError:
        raise errors.PushCancelledError(
            "the client cancelled the push mid-stream; nothing was applied, the old weights still serve"
        ) from None


class ControlService(services.ControlServicer):
    """GetInfo, GetStats, Pause, Resume, SetSpeculation."""

    def __init__(self, scheduler: Scheduler, limits: RequestLimits, specrl_version: str) -> None:
        self._scheduler = scheduler
        self._limits = limits
        self._specrl_version = specrl_version

    def info(self) -> SidecarInfo:
        snap = self._scheduler.snapshot()
        return SidecarInfo(
            engine=snap.info,
            weight_version=snap.weight_version,
            paused=snap.paused,
            limits=self._limits,
            gpus=metrics.gpu_telemetry(),
            specrl_version=self._specrl_version,
        )

    def stats(self) -> SidecarStats:
        snap = self._scheduler.snapshot()
        total = self._scheduler.total_counters()
        return SidecarStats(
            versions=snap.versions,
            total=total,
            weight_version=snap.weight_version,
            queued_sequences=snap.queued,
            running_sequences=snap.running,
            uptime_seconds=time.monotonic() - self._scheduler.started_at,
            speculation=snap.info.speculation_status,
            draft_collapsed=snap.draft_collapsed,
            draft_collapses=snap.draft_collapses,
            kv=snap.kv,
        )

    async def GetInfo(self, request: control_pb2.GetInfoRequest, context: grpc.aio.ServicerContext) -> Any:
        return convert.info_to_pb(await asyncio.to_thread(self.info))  # NVML reads may block

    async def GetStats(self, request: control_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> Any:
        return convert_stats.stats_to_pb(self.stats())

    async def Pause(self, request: control_pb2.PauseRequest, context: grpc.aio.ServicerContext) -> Any:
        return control_pb2.PauseResponse(was_paused=self._scheduler.pause())

    async def Resume(self, request: control_pb2.ResumeRequest, context: grpc.aio.ServicerContext) -> Any:
        return control_pb2.ResumeResponse(was_paused=self._scheduler.resume())

    async def SetSpeculation(
        self, request: control_pb2.SetSpeculationRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        max_speculation_k = self._scheduler.snapshot().info.max_speculation_k
        if request.speculation_k > max_speculation_k:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"speculation_k={request.speculation_k} exceeds max_speculation_k={max_speculation_k}; ask for 0..{max_speculation_k} (0 turns speculation off)",
            )
        try:
            previous, was_auto = await self._scheduler.set_speculation_k_async(
                request.speculation_k, request.speculation_auto
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"speculation_k={request.speculation_k} refused: {e}")
        except Exception as e:
            await _abort(context, e)
        return control_pb2.SetSpeculationResponse(
            previous_speculation_k=previous,
            speculation_k=request.speculation_k,
            previous_speculation_auto=was_auto,
            speculation_auto=request.speculation_auto,
        )
