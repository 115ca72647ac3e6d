"""One weight push fanned out to many sidecars: each tensor exported once, streamed to all.

The weight half of a `Fleet` (`sidecar.client.fleet`). Each sidecar's push stream takes its
tensors from a queue bounded by `stream_bytes` (one tensor always fits), so the trainer never holds
a second copy of the model. Sending one sidecar its stream is `send_weight_stream`, a single
replaceable step: PushWeights is the control plane, the bytes take the transport negotiated for
that sidecar (`sidecar.client.transport`). Local sidecars whose negotiated plane is shm instead all
read one shared-memory region written once per push: one copy and one CRC-32 per tensor for all of
them, and one placement message per 64 MiB instead of a hand-off per tensor and sidecar.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import torch

from sidecar.client.client import SidecarCallError, SidecarClient
from sidecar.client.weight_sender import ShmSender, checked_pairs, framed_push, push_manifest
from sidecar.types import PushResult, TensorSpec, WeightSelector, WeightTransport
from sidecar.weight_transport.shm import ShmRegion

Code = grpc.StatusCode
NamedTensors = Iterable[tuple[str, torch.Tensor]]
WeightSource = Callable[[], NamedTensors]
"""Called once per push; yields (name, tensor) pairs, each exported once."""
WeightSender = Callable[
    [SidecarClient, Iterator[tuple[str, torch.Tensor]], int, WeightSelector, Sequence[TensorSpec]], PushResult
]
"""Sends one sidecar its stream of tensors (in `specs` order) as `version`; returns once served."""


def send_weight_stream(
    client: SidecarClient,
    tensors: Iterator[tuple[str, torch.Tensor]],
    version: int,
    selector: WeightSelector,
    specs: Sequence[TensorSpec],
) -> PushResult:
    """Send one sidecar its tensors (in `specs` order): PushWeights is the control plane, the
    bytes take the transport negotiated for that sidecar (shm, collective or the stream)."""
    return client.push_weights(tensors, version, selector, specs=specs)


class WeightFanout:
    """Pushes one weight version to several sidecars at once (one push at a time)."""

    def __init__(self, *, stream_bytes: int, deadline_s: float, share_shm: bool, send: WeightSender) -> None:
        self.stream_bytes = stream_bytes
        self.deadline_s = deadline_s
        self.share_shm = share_shm
        self.send = send
        """The per-sidecar step of a weight push (replace it to use another transport)."""
        self.region: ShmRegion | None = None  # written once per push for every local sidecar
        self._pushing = threading.Lock()  # one push at a time uses that region

    def push(
        self,
        clients: list[SidecarClient],
        weights: WeightSource,
        specs: list[TensorSpec],
        version: int,
        selector: WeightSelector,
    ) -> tuple[dict[SidecarClient, PushResult], dict[SidecarClient, Exception]]:
        """Stream `weights()` (in `specs` order) to `clients` at once; returns who committed and
        who failed (why). An error raised by `weights()` itself propagates after every stream
        ended without a commit."""
        failures: dict[SidecarClient, Exception] = {}
        sharing = self._sharing(clients)
        feeds = {c: _Feed(self.stream_bytes) for c in clients}
        results: dict[SidecarClient, PushResult] = {}
        with self._pushing, ThreadPoolExecutor(max_workers=max(1, len(clients))) as pool:
            futures: dict[SidecarClient, Future[PushResult]] = {}
            if sharing:
                assert self.region is not None
                sender = ShmSender(self.region)
                manifest = push_manifest(specs, version, selector, sender.placement)
                for c in sharing:  # a failure drops the client's own (proven) plane: it negotiates again
                    items = framed_push(manifest, iter(feeds[c]))  # type: ignore[arg-type]
                    futures[c] = pool.submit(c.push_items, items, plane=c.transport_session.sender)
            streamed = [c for c in clients if c not in sharing]
            for c in streamed:
                futures[c] = pool.submit(self.send, c, iter(feeds[c]), version, selector, specs)
            source_error: BaseException | None = None

            def exported() -> Iterator[tuple[str, torch.Tensor]]:
                for name, tensor in weights():
                    nbytes = tensor.numel() * tensor.element_size()
                    for c in streamed:
                        feeds[c].offer((name, tensor), nbytes, futures[c])
                    yield name, tensor

            try:
                if sharing:  # each tensor written (and checksummed) once, for every local sidecar
                    for placed in sender.place(checked_pairs(exported(), manifest.tensors), manifest.tensors):
                        for c in sharing:
                            feeds[c].offer(placed, 0, futures[c])
                else:
                    for _ in exported():
                        pass
            except BaseException as e:  # the caller's own failure: end every stream without a commit
                source_error = e
            for c, feed in feeds.items():
                feed.offer(_SourceFailed() if source_error is not None else _END, 0, futures[c])
            if source_error is not None:
                for f in futures.values():
                    with contextlib.suppress(Exception):
                        f.result(timeout=self.deadline_s)
                raise source_error
            for c, fut in futures.items():
                try:
                    results[c] = fut.result(timeout=self.deadline_s)
                except SidecarCallError as e:
                    failures[c] = e
                except TimeoutError:
                    failures[c] = SidecarCallError(
                        c.address, "PushWeights", Code.DEADLINE_EXCEEDED, f"no commit within {self.deadline_s}s"
                    )
                # anything else (the caller's tensors did not match their specs) propagates
        return results, failures

    def _sharing(self, clients: list[SidecarClient]) -> list[SidecarClient]:
        """The sidecars that take this push from one shared-memory region the fleet writes once
        (each tensor copied and checksummed once, not once per sidecar): those whose negotiated
        plane is shm, that take full pushes, when the fleet sends with the default step. Each of
        them proved it can read this process's memory files (its own probe), so it can read the
        fleet's region too."""
        if self.send is not send_weight_stream or not self.share_shm:
            return []
        sharing = [
            c
            for c in clients
            if not c.config.sparse_deltas and c.negotiate_transport().transport is WeightTransport.SHM
        ]
        if sharing and self.region is None:
            self.region = ShmRegion()
        return sharing

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None


class _SourceFailed(Exception):
    """Ends a push stream without a commit because the caller's weight source raised."""


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
