"""An incremental weight update: open, send tensors one at a time as a framework produces them,
commit atomically.

Frameworks hand weights over one parameter at a time (TRL's `update_named_param`, ZeRO-3 and
FSDP gathering piecewise), often not in the order a manifest would list them. specrl.v1's
`PushWeights` client stream already is such a session when it is fed lazily: the manifest (the
tensor list, from `DescribeWeights` or from the framework's own metadata) opens it, each
tensor's chunks may arrive whenever that tensor is ready (chunks of different tensors may come
in any tensor order; within one tensor they are in order, and its CRC-32 rides on its last
chunk), and the commit applies everything at once. The sidecar stages and verifies as today,
so a session that is aborted, or that misses a tensor of its selector, leaves the served model
untouched.

What the trainer holds: a tensor being sent is read in place (converted first only when its
dtype or device differs from what the sidecar serves, one tensor at a time), and at most
`max_pending_chunks` chunks wait for gRPC; gRPC copies a chunk once when it serialises it. So
the trainer never materialises a second copy of the model (BENCHMARKS.md, "Weight update
session: trainer-side memory").
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sidecar.client.client import SidecarClient
from sidecar.client.weight_sender import DEFAULT_CHUNK_BYTES
from sidecar.types import PushItem, PushResult, TensorSpec, WeightChunk, WeightCommit, WeightManifest, WeightSelector
from sidecar.weight_transport.checksum import crc32, crc32_combine
from sidecar.weight_transport.tensors import tensor_bytes

_END = object()
"""Queue sentinel: the session ended (after the commit, or without one when aborted)."""


@dataclass(kw_only=True, slots=True)
class SessionConfig:
    """How a session streams."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Bytes per chunk message (4 MiB default, far below gRPC's 64 MiB limit)."""
    max_pending_chunks: int = 2
    """Chunks queued for gRPC before `send` blocks: bounds what the trainer holds beyond its model."""
    timeout_s: float | None = None
    """Deadline of the whole session (the client's push_timeout_s when None)."""

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0:
            raise ValueError(f"SessionConfig.chunk_bytes must be > 0, got {self.chunk_bytes}")
        if self.max_pending_chunks < 1:
            raise ValueError(f"SessionConfig.max_pending_chunks must be >= 1, got {self.max_pending_chunks}")


class WeightUpdateSession:
    """One incremental, atomic weight update of one sidecar.

    `specs` is the manifest (names, the sidecar's dtypes, shapes); None asks the sidecar
    (`DescribeWeights(selector)`), which is the whole selected part. Every manifest tensor must
    be sent exactly once before `commit`. Use as a context manager: a clean exit commits, an
    exception aborts (nothing is applied).
    """

    def __init__(
        self,
        client: SidecarClient,
        *,
        version: int,
        selector: WeightSelector = WeightSelector.TARGET,
        specs: Sequence[TensorSpec] | None = None,
        config: SessionConfig | None = None,
    ) -> None:
        if version <= 0:
            raise ValueError(f"version must be > 0 (versions start at 1 and increase), got {version}")
        self.config = config or SessionConfig()
        if specs is None:
            specs, _ = client.describe_weights(selector)
        self.specs = [TensorSpec(name=s.name, dtype=s.dtype, shape=tuple(s.shape)) for s in specs]
        self.version = version
        self._index = {s.name: i for i, s in enumerate(self.specs)}
        if len(self._index) != len(self.specs):
            raise ValueError("specs name a tensor twice; list each tensor once")
        self._sent: set[str] = set()
        self._chunks = 0
        self._closed = False
        self._queue: queue.Queue[object] = queue.Queue(maxsize=self.config.max_pending_chunks)
        self._stop = threading.Event()
        self._queue.put(WeightManifest(version=version, selector=selector, tensors=list(self.specs)))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specrl-weight-session")
        self._result: Future[PushResult] = self._executor.submit(
            client.push_items, self._items(), timeout_s=self.config.timeout_s
        )

    # --- the stream gRPC consumes -----------------------------------------------------------

    def _items(self) -> Iterator[PushItem]:
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if item is _END:
                return
            assert isinstance(item, WeightManifest | WeightChunk | WeightCommit)
            yield item

    def _put(self, item: object) -> None:
        """Queue an item; if the sidecar already ended the call (it refused the manifest, a
        checksum, ...), raise its error instead of waiting forever."""
        while True:
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                if self._result.done():
                    self._closed = True
                    self._result.result()  # raises the sidecar's error
                    raise RuntimeError("the sidecar ended the weight update before it was committed") from None

    # --- the session ------------------------------------------------------------------------

    def send(self, name: str, tensor: torch.Tensor) -> None:
        """Stream one tensor of the manifest (converted to the sidecar's dtype on CPU if needed;
        read in place otherwise). Returns once its last chunk is queued."""
        if self._closed:
            raise RuntimeError("the weight update session is closed; open a new one")
        index = self._index.get(name)
        if index is None:
            raise KeyError(
                f"tensor {name!r} is not in this update's manifest ({len(self.specs)} tensors); "
                "open the session with specs that include it"
            )
        if name in self._sent:
            raise ValueError(f"tensor {name!r} was already sent in this update; send each tensor once")
        spec = self.specs[index]
        if tuple(tensor.shape) != tuple(spec.shape):
            raise ValueError(f"tensor {name!r} has shape {list(tensor.shape)}, the manifest says {list(spec.shape)}")
        data = tensor.detach()
        if data.dtype != spec.dtype or data.device.type != "cpu":
            data = data.to(device="cpu", dtype=spec.dtype)
        view = tensor_bytes(data)
        total = view.nbytes
        crc = 0
        step = self.config.chunk_bytes
        for offset in range(0, total, step):
            part = memoryview(view[offset : offset + step].data)
            part_crc = crc32(part)
            crc = crc32_combine(crc, part_crc, len(part))
            last = offset + len(part) >= total
            self._put(
                WeightChunk(
                    tensor_index=index,
                    offset=offset,
                    data=part,
                    crc32=part_crc,
                    tensor_crc32=crc if last else None,
                )
            )
            self._chunks += 1
        self._sent.add(name)

    def missing(self) -> list[str]:
        """Manifest tensors not sent yet."""
        return [s.name for s in self.specs if s.name not in self._sent]

    def commit(self) -> PushResult:
        """Apply the update atomically; returns once the sidecar serves `version`. A missing
        tensor raises ValueError here, before the commit is sent (the sidecar applies nothing)."""
        if self._closed:
            raise RuntimeError("the weight update session is closed; open a new one")
        missing = self.missing()
        if missing:
            self.abort()
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(
                f"the weight update lacks {len(missing)} tensor(s) of its manifest: {shown}; "
                "nothing was applied, send every tensor, then commit"
            )
        self._put(WeightCommit(chunk_count=self._chunks))
        self._put(_END)
        self._closed = True
        try:
            return self._result.result()
        finally:
            self._executor.shutdown(wait=False)

    def abort(self) -> None:
        """End the stream without a commit: the sidecar discards what it staged."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:
            self._result.result()
        except Exception:  # the sidecar's "ended without a commit" refusal is the expected outcome
            pass
        finally:
            self._executor.shutdown(wait=False)

    def __enter__(self) -> WeightUpdateSession:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.commit()
