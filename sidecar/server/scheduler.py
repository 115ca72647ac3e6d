"""The scheduler: one thread that owns the engine and merges many Generate streams into batches.

An `Engine` is driven step by step and is not thread-safe, while gRPC serves calls on an
asyncio event loop (`grpc.aio`, so an open stream holds no thread). The scheduler is the single
place where the two meet: handlers hand it commands (submit, abort, cancel, set k, apply
weights) through a queue; its thread runs them between two `engine.step()` calls and routes
each finished sample to the queue of the stream that asked for it — an `asyncio.Queue` filled
with `loop.call_soon_threadsafe` for a handler on the loop, a `queue.Queue` for a plain thread. So a weight swap always lands on a step boundary (continuous batching in
the style of Orca, Yu et al., OSDI 2022, with the swap as one more between-step operation),
and no token is computed from half-applied weights.

Admission is bounded: a request whose sequences would push the number of live sequences past
`max_live_sequences` is refused at once with `OverloadedError` (RESOURCE_EXHAUSTED at the
edge) instead of growing a queue without limit. A client that disconnects cancels its request,
which aborts its sequences in the engine and frees their slots.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from sidecar.engine.base import Engine
from sidecar.errors import (
    ApplyTimeoutError,
    DuplicateRequestError,
    EngineFailure,
    InvalidRequestError,
    OverloadedError,
    ServedVersionTooOldError,
    ShuttingDownError,
)
from sidecar.server.weight_receiver import StagedWeights
from sidecar.speculation.collapse import CollapseRule, CollapseWatch
from sidecar.types import (
    DraftCollapse,
    EngineInfo,
    FinishReason,
    GenerationRequest,
    KVUsage,
    Sample,
    ScoreRequest,
    ScoreResult,
    SpeculationCounters,
    TensorSpec,
    VersionStats,
)
from sidecar.types import WeightSelector as Selector

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """Bounds of the scheduler."""

    max_live_sequences: int = 4096
    """Most sequences (samples) admitted and not yet finished; more is RESOURCE_EXHAUSTED."""
    idle_wait_s: float = 0.05
    """How long the idle loop blocks waiting for a command before it re-checks its state."""
    apply_timeout_s: float = 120.0
    """Longest a verified weight update waits for an engine step boundary."""
    command_timeout_s: float = 60.0
    """Longest an RPC waits for the scheduler thread to run a command (abort, set k)."""
    throughput_window_s: float = 10.0
    """Window of the tokens/s gauge."""
    collapse: CollapseRule = field(default_factory=CollapseRule)
    """When a weight version's draft counts as collapsed (GetStats `draft_collapsed`; automatic
    k then drafts nothing until the next version)."""

    def __post_init__(self) -> None:
        if self.max_live_sequences < 1:
            raise ValueError(f"max_live_sequences must be >= 1, got {self.max_live_sequences}")
        for name in ("idle_wait_s", "apply_timeout_s", "command_timeout_s", "throughput_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be > 0, got {getattr(self, name)}")


_DONE = object()


def _unwrap(item: object) -> Sample | None:
    if item is _DONE:
        return None
    if isinstance(item, BaseException):
        raise item
    assert isinstance(item, Sample)
    return item


class RequestHandle:
    """The caller's side of one admitted request: finished samples arrive on its queue.

    Without `loop` it is read from a thread with `get`; with `loop` (a handler on that event
    loop) with `await next()`, and the scheduler thread hands items over through
    `loop.call_soon_threadsafe`, so waiting costs no thread."""

    def __init__(
        self, scheduler: Scheduler, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.request_id = request.request_id
        self.expected = len(request.prompts) * request.samples_per_prompt
        self._scheduler = scheduler
        self._loop = loop
        # Bounded by construction: at most `expected` samples plus one terminal item.
        self._queue: queue.Queue[Any] = queue.Queue()
        self._async_queue: asyncio.Queue[Any] = asyncio.Queue()

    def get(self, timeout: float) -> Sample | None:
        """The next finished sample; None when all were delivered; raises the request's error;
        `queue.Empty` when nothing arrived within `timeout` seconds (thread callers only)."""
        if self._loop is not None:
            raise RuntimeError("this handle delivers to an event loop: use `await handle.next()`")
        return _unwrap(self._queue.get(timeout=timeout))

    async def next(self) -> Sample | None:
        """Like `get`, awaited on the handle's event loop, without a timeout (the caller's
        deadline or cancellation ends the wait)."""
        if self._loop is None:
            raise RuntimeError("this handle delivers to a thread: use `handle.get(timeout)`")
        return _unwrap(await self._async_queue.get())

    def cancel(self) -> None:
        """The client went away: abort its sequences and drop their output (idempotent)."""
        self._scheduler._cancel(self.request_id)

    def _put(self, item: object) -> None:
        if self._loop is None:
            self._queue.put(item)
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone, nobody listens
            self._loop.call_soon_threadsafe(self._async_queue.put_nowait, item)


@dataclass(kw_only=True, slots=True)
class _Live:
    handle: RequestHandle
    request: GenerationRequest
    delivered: int = 0
    in_engine: bool = False


@dataclass(kw_only=True, slots=True)
class Snapshot:
    """What RPC threads may read without waiting for a step (refreshed by the scheduler)."""

    info: EngineInfo
    weight_version: int
    versions: list[VersionStats] = field(default_factory=list)
    """The recent weight versions, oldest first (`version_ledger.RECENT_VERSIONS` at most)."""
    earlier: VersionStats = field(default_factory=lambda: VersionStats(weight_version=0))
    """The sum over the versions served before those."""
    queued: int = 0
    running: int = 0
    kv: KVUsage = field(default_factory=KVUsage)
    """The engine's KV blocks (`Engine.kv_usage`)."""
    paused: bool = False
    draft_collapsed: DraftCollapse | None = None
    """The draft-collapse alarm while raised (`sidecar.speculation.collapse`)."""
    draft_collapses: int = 0
    """Collapses raised since start (monotonic)."""


class Scheduler:
    """Owns an engine on one thread; RPC threads talk to it through thread-safe methods."""

    def __init__(self, engine: Engine, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._engine = engine
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._lock = threading.Lock()  # guards _live, _live_sequences, _snapshot, _accepting
        self._live: dict[str, _Live] = {}
        self._live_sequences = 0
        self._accepting = True
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._busy: dict[int, float] = collections.defaultdict(float)  # step seconds of the recent versions
        self._busy_earlier = 0.0  # ... and of all older ones
        self._throughput: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)
        self._specs = {s: list(engine.weight_specs(s)) for s in Selector}
        self._collapse = CollapseWatch(self.config.collapse)
        self._announced: tuple[int, int] | None = None  # (collapse count, version) last logged
        self._snapshot = Snapshot(info=engine.info(), weight_version=engine.weight_version)
        self._refresh_snapshot()
        self._thread = threading.Thread(target=self._run, name="specrl-scheduler", daemon=True)
        self.started_at = time.monotonic()

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop admitting, let live requests finish for up to `grace_s`, abort the rest, join."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._thread.is_alive():
            with self._lock:
                if not self._live:
                    break
            time.sleep(0.02)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(grace_s, 1.0) + 30.0)
        with self._lock:
            leftover = list(self._live.values())
            self._live.clear()
        for live in leftover:
            live.handle._put(ShuttingDownError("the sidecar shut down before the request finished; retry elsewhere"))

    # --- RPC-side API (thread-safe) -------------------------------------------------------

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Admit a request (assigning a request_id if empty); its samples arrive on the handle
        (read with `await handle.next()` on `loop` when given, else `handle.get`). Never blocks
        on the engine: safe to call on an event loop."""
        n = len(request.prompts) * request.samples_per_prompt
        with self._lock:
            if not self._accepting:
                raise ShuttingDownError("the sidecar is shutting down and admits no new requests; use another one")
            if not request.request_id:
                request.request_id = f"req-{next(self._ids)}-{time.time_ns():x}"
            if request.request_id in self._live:
                raise DuplicateRequestError(
                    f"request_id {request.request_id!r} is already live on this sidecar; use a unique id or leave "
                    "it empty to get one assigned"
                )
            if self._live_sequences + n > self.config.max_live_sequences:
                raise OverloadedError(
                    f"admission queue full: {self._live_sequences} live sequences + {n} would exceed "
                    f"{self.config.max_live_sequences}; retry with backoff or use another sidecar"
                )
            handle = RequestHandle(self, request, loop)
            self._live[request.request_id] = _Live(handle=handle, request=request)
            self._live_sequences += n
        self._commands.put(lambda: self._admit(request.request_id))
        return handle

    def abort(self, request_id: str) -> tuple[bool, int]:
        """Abort a live request: its unfinished samples are delivered as ABORT samples.
        Returns (found, number of samples aborted)."""
        return self._call(lambda: self._do_abort(request_id, deliver=True))

    async def abort_async(self, request_id: str) -> tuple[bool, int]:
        """`abort` for a handler on an event loop: awaits the step boundary without a thread."""
        return await self._call_async(lambda: self._do_abort(request_id, deliver=True))

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._live:
                return

        def run() -> None:
            self._do_abort(request_id, deliver=False)

        self._commands.put(run)

    def set_speculation_k(self, k: int, speculation_auto: bool = False) -> tuple[int, bool]:
        """Set the engine's default k (speculation_auto: the maximum of automatic mode); returns the
        previous (k, speculation_auto). ValueError beyond max or without an automatic mode."""
        return self._call(lambda: self._do_set_k(k, speculation_auto))

    async def set_speculation_k_async(self, k: int, speculation_auto: bool = False) -> tuple[int, bool]:
        """`set_speculation_k` for a handler on an event loop."""
        return await self._call_async(lambda: self._do_set_k(k, speculation_auto))

    def _do_set_k(self, k: int, speculation_auto: bool) -> tuple[int, bool]:
        info = self._engine.info()
        previous = (info.speculation_k, info.speculation_status.speculation_auto)
        if speculation_auto:
            self._engine.set_speculation_auto(k)
        else:
            self._engine.set_speculation_k(k)
        self._refresh_snapshot(info=True)
        return previous

    def pause(self) -> bool:
        was = self._paused.is_set()
        self._paused.set()
        with self._lock:
            self._snapshot.paused = True
        return was

    def resume(self) -> bool:
        was = self._paused.is_set()
        self._paused.clear()
        with self._lock:
            self._snapshot.paused = False
        self._commands.put(lambda: None)  # wake the loop
        return was

    def apply_weights(
        self, staged: StagedWeights, timeout_s: float | None = None
    ) -> tuple[int, float, dict[str, torch.Tensor]]:
        """Swap verified weights in at the next step boundary; returns (previous version, seconds
        spent including the wait, the buffers the receiver may stage the next push into: the
        engine adopts the staged tensors where it can and hands back what they displaced).
        Raises the engine's StaleVersionError / UnknownTensorError / WeightMismatchError
        (nothing applied), or ApplyTimeoutError if no step boundary came."""
        started = time.perf_counter()

        def run() -> tuple[int, dict[str, torch.Tensor]]:
            previous = self._engine.weight_version
            free = self._engine.adopt_weights(staged.tensors, staged.selector, staged.version)
            self._refresh_snapshot(info=True)
            return previous, free

        previous, free = self._call(run, timeout_s or self.config.apply_timeout_s, what="weight update")
        return previous, time.perf_counter() - started, free

    async def score_async(self, request: ScoreRequest) -> ScoreResult:
        """Score on the scheduler thread between two engine steps (one weight version throughout);
        the handler's wait for the step boundary holds no thread."""
        return await self._call_async(lambda: self._do_score(request), what="score")

    def _do_score(self, request: ScoreRequest) -> ScoreResult:
        version = self._engine.weight_version
        if version < request.min_weight_version:
            raise ServedVersionTooOldError(
                f"the sidecar serves weight version {version} but the request needs "
                f">= {request.min_weight_version}; push weights first, then retry"
            )
        return ScoreResult(logprobs=self._engine.score(request), weight_version=version)

    def model_specs(self, selector: Selector) -> list[TensorSpec]:
        return list(self._specs[selector])

    async def served_checksums_async(self, selector: Selector) -> tuple[int, dict[str, int] | None]:
        """(served version, CRC-32 per served tensor or None if the engine cannot tell), read
        together on the scheduler thread between two steps: never torn by a weight swap."""
        return await self._call_async(
            lambda: (self._engine.weight_version, self._engine.weight_checksums(selector)), what="weight checksums"
        )

    def snapshot(self) -> Snapshot:
        with self._lock:
            s = self._snapshot
            return Snapshot(
                info=s.info,
                weight_version=s.weight_version,
                versions=list(s.versions),
                earlier=s.earlier,
                queued=s.queued,
                running=s.running,
                kv=s.kv,
                paused=s.paused,
                draft_collapsed=s.draft_collapsed,
                draft_collapses=s.draft_collapses,
            )

    @property
    def weight_version(self) -> int:
        with self._lock:
            return self._snapshot.weight_version

    def total_counters(self) -> SpeculationCounters:
        """Counters since the sidecar started, over every version served."""
        snap = self.snapshot()
        total = SpeculationCounters()
        for v in [snap.earlier, *snap.versions]:
            total.add(v.counters)
        return total

    def tokens_per_second(self) -> float:
        """Generated tokens per wall-clock second over the last `throughput_window_s`."""
        now = time.monotonic()
        with self._lock:
            points = [(t, n) for t, n in self._throughput if now - t <= self.config.throughput_window_s]
        if len(points) < 2 or points[-1][0] <= points[0][0]:
            return 0.0
        return (points[-1][1] - points[0][1]) / (now - points[0][0])

    # --- scheduler thread -------------------------------------------------------------------

    def _schedule(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn` to run on the scheduler thread between two steps; its future."""
        if not self._thread.is_alive():
            raise ShuttingDownError("the scheduler is not running (the sidecar is stopping); retry elsewhere")
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except Exception as e:  # delivered to the caller, who maps it to a status
                future.set_exception(e)

        self._commands.put(run)
        return future

    def _call(self, fn: Callable[[], T], timeout_s: float | None = None, what: str = "command") -> T:
        """Run `fn` on the scheduler thread between steps and return its result (or raise)."""
        future = self._schedule(fn)
        timeout = timeout_s or self.config.command_timeout_s
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            if future.cancel():
                raise _step_timeout(what, timeout) from None
            return future.result()  # it started just now: wait for it

    async def _call_async(self, fn: Callable[[], T], timeout_s: float | None = None, what: str = "command") -> T:
        """`_call` awaited on an event loop: the wait holds no thread."""
        future = self._schedule(fn)
        timeout = timeout_s or self.config.command_timeout_s
        waiting = asyncio.wrap_future(future)
        done, _ = await asyncio.wait({waiting}, timeout=timeout)  # does not cancel on timeout
        if not done and future.cancel():
            raise _step_timeout(what, timeout)
        return await waiting

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if self._paused.is_set() or not self._engine.has_work():
                try:
                    cmd = self._commands.get(timeout=self.config.idle_wait_s)
                except queue.Empty:
                    continue
                self._run_command(cmd)
                del cmd  # a command may hold a model-sized weight update: drop it now, not at the next one
                continue
            self._step()
        self._abort_all(ShuttingDownError("the sidecar shut down before the request finished; retry elsewhere"))

    def _drain_commands(self) -> None:
        for _ in range(self._commands.qsize()):
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            self._run_command(cmd)

    def _run_command(self, cmd: Callable[[], None]) -> None:
        try:
            cmd()
        except Exception:  # a command never takes the loop down
            log.exception("scheduler command failed")

    def _step(self) -> None:
        version = self._engine.weight_version
        started = time.perf_counter()
        try:
            finished = self._engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the live requests")
            self._abort_all(EngineFailure(f"the engine failed while generating ({type(e).__name__}: {e}); retry"))
            return
        self._busy[version] += time.perf_counter() - started
        self._refresh_snapshot()  # before delivering: a caller holding its samples finds them counted
        for sample in finished:
            self._deliver(sample)

    def _admit(self, request_id: str) -> None:
        with self._lock:
            live = self._live.get(request_id)
        if live is None:  # cancelled before admission
            return
        request = live.request
        try:
            if self._engine.weight_version < request.min_weight_version:
                raise ServedVersionTooOldError(
                    f"the sidecar serves weight version {self._engine.weight_version} but the request needs "
                    f">= {request.min_weight_version}; push weights first, then retry"
                )
            self._engine.submit(request)
        except (InvalidRequestError, ServedVersionTooOldError) as e:
            self._finish(request_id, e)
            return
        except ValueError as e:  # an engine's plain validation error is still the caller's fault
            self._finish(request_id, InvalidRequestError(str(e)))
            return
        live.in_engine = True
        self._refresh_snapshot()

    def _deliver(self, sample: Sample) -> None:
        with self._lock:
            live = self._live.get(sample.request_id)
        if live is None:  # cancelled: nobody is listening
            return
        if sample.weight_version < 0 or sample.last_weight_version < 0:
            # A sample aborted before its first token has no producing version; report the
            # served one (the protocol's versions are unsigned).
            served = self._engine.weight_version
            sample.weight_version = served if sample.weight_version < 0 else sample.weight_version
            sample.last_weight_version = served if sample.last_weight_version < 0 else sample.last_weight_version
        live.handle._put(sample)
        live.delivered += 1
        if live.delivered >= live.handle.expected:
            self._finish(sample.request_id, _DONE)

    def _finish(self, request_id: str, terminal: object) -> None:
        with self._lock:
            live = self._live.pop(request_id, None)
            if live is not None:
                self._live_sequences -= live.handle.expected
        if live is not None:
            live.handle._put(terminal)

    def _do_abort(self, request_id: str, *, deliver: bool) -> tuple[bool, int]:
        with self._lock:
            live = self._live.get(request_id)
        if live is None:
            return False, 0
        if live.in_engine:
            samples = self._engine.abort(request_id)
        else:  # the abort overtook its request's admission: every sample is unfinished, none started
            request = live.request
            samples = [
                Sample(
                    request_id=request_id,
                    prompt_index=p,
                    sample_index=i,
                    token_ids=[],
                    logprobs=[],
                    finish_reason=FinishReason.ABORT,
                    weight_version=-1,  # no producing version: `_deliver` reports the served one
                    last_weight_version=-1,
                )
                for p in range(len(request.prompts))
                for i in range(request.samples_per_prompt)
            ]
        if deliver:
            for s in samples:
                self._deliver(s)
        if request_id in self._live:  # not delivered (cancelled: deliver=False): end the stream
            self._finish(request_id, _DONE if deliver else RequestCancelled())
        self._refresh_snapshot()
        return True, len(samples)

    def _abort_all(self, error: Exception) -> None:
        with self._lock:
            ids = list(self._live)
        for rid in ids:
            try:
                self._engine.abort(rid)
            except Exception:
                log.exception("engine abort of %s failed", rid)
            self._finish(rid, error)
        self._refresh_snapshot()

    def _refresh_snapshot(self, *, info: bool = False) -> None:
        recent = self._engine.stats()
        for v in set(self._busy) - {r.weight_version for r in recent}:
            if v < recent[0].weight_version:  # folded into the engine's earlier versions
                self._busy_earlier += self._busy.pop(v)
        earlier = dataclasses.replace(self._engine.earlier_stats())
        earlier.busy_seconds = max(earlier.busy_seconds, self._busy_earlier)
        versions = [
            dataclasses.replace(v, busy_seconds=max(v.busy_seconds, self._busy.get(v.weight_version, 0.0)))
            for v in recent
        ]
        total_generated = earlier.counters.generated_tokens + sum(v.counters.generated_tokens for v in versions)
        collapsed = self._watch_draft(versions)
        new_info = self._engine.info() if info else None
        speculation = self._engine.speculation_status()
        kv = dataclasses.replace(self._engine.kv_usage())  # a copy: the engine may update its own
        with self._lock:
            s = self._snapshot
            if new_info is not None:
                s.info = new_info
            s.info = dataclasses.replace(s.info, speculation_status=speculation)
            s.weight_version = self._engine.weight_version
            s.versions = versions
            s.earlier = earlier
            s.queued = self._engine.num_queued() + sum(
                lv.handle.expected for lv in self._live.values() if not lv.in_engine
            )
            s.running = self._engine.num_running()
            s.kv = kv
            s.draft_collapsed = collapsed
            s.draft_collapses = self._collapse.collapses
            self._throughput.append((time.monotonic(), total_generated))

    def _watch_draft(self, versions: list[VersionStats]) -> DraftCollapse | None:
        """Judge the versions' drafts (`CollapseWatch`); while the served version's draft is
        collapsed, automatic k drafts nothing (the engine's controller lifts the hold on the next
        weight version, whose draft is then judged afresh). Logs each collapse once, and each
        later version it spans once. Returns a copy of the raised condition (or None)."""
        was = self._collapse.condition is not None
        condition = self._collapse.observe(versions)
        if condition is None:
            if was:
                log.info("the draft works again from weight version %d on", self._collapse.recovered_at)
            return None
        served = self._engine.weight_version
        held = self._collapse.collapsed(served) and self._engine.hold_drafting(condition.describe())
        announce = (self._collapse.collapses, condition.latest_version)
        if announce != self._announced:
            self._announced = announce
            log.warning(
                "%s; %s",
                condition.describe(),
                "automatic k drafts nothing until the next weight version"
                if held
                else "fixed or request-pinned k keeps drafting",
            )
        return dataclasses.replace(condition)


def _step_timeout(what: str, timeout: float) -> ApplyTimeoutError:
    return ApplyTimeoutError(
        f"the {what} did not reach an engine step boundary within {timeout:.0f}s; nothing was "
        "changed; retry, or check that the engine is not stuck (GetStats)"
    )


class RequestCancelled(Exception):
    """Terminal item of a cancelled request (nobody reads it: the client is gone)."""
