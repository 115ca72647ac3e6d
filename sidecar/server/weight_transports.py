"""The receiving end of each weight transport: bytes into staging buffers, checked as they land.

`WeightReceiver` (`sidecar.server.weight_receiver`) opens one plane per push:
- `StreamPlane` (grpc): `WeightChunk`s on the stream; a staging thread checksums and copies each
  chunk while the receiving thread waits for the next message.
- `ShmPlane` (shm): one `WeightPlaced` per tensor names its offset in the sender's region; the
  staging thread reads it into the staging buffer (one copy) and checksums that copy.
- `CollectivePlane` (collective): the receiving thread takes each bucket's broadcast (bounded by
  the group's timeout) before it reads the bucket's `WeightPlaced` items, then checksums the
  staged bytes.
Every failure raises a specific `sidecar.errors` exception; nothing is applied.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from sidecar.errors import (
    InvalidRequestError,
    TransportUnavailableError,
)
from sidecar.types import (
    CollectivePlacement,
    PlacedTensor,
    TensorSpec,
    WeightChunk,
    WeightPlaced,
)
from sidecar.weight_transport import collective, shm
from sidecar.weight_transport.checksum import crc32, crc32_combine
from sidecar.weight_transport.tensors import tensor_bytes


class StagedTensor:
    """One manifest entry being received into its final buffer."""

    __slots__ = ("buffer", "crc", "received", "scheduled", "spec", "view")

    def __init__(self, spec: TensorSpec, buffer: torch.Tensor | None = None) -> None:
        self.spec = spec
        self.buffer: torch.Tensor | None = buffer  # allocated on first use unless reused
        self.view: np.ndarray | None = None  # uint8 view of buffer
        self.scheduled = 0  # bytes accepted by the receiving thread
        self.received = 0  # bytes checked and copied by the staging thread
        self.crc = 0

    def bytes_view(self) -> np.ndarray:
        if self.buffer is None:
            if self.spec.delta is not None:  # the payload; the tensor is rebuilt at the commit
                self.buffer = torch.empty(self.spec.wire_length, dtype=torch.uint8)
            else:
                self.buffer = torch.empty(self.spec.shape, dtype=self.spec.dtype)
        if self.view is None:
            self.view = tensor_bytes(self.buffer)
        return self.view

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.bytes_view()[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.received += len(data)

    def finished(self) -> torch.Tensor:
        if self.buffer is None:  # a zero-byte tensor (or payload) gets no bytes
            self.bytes_view()
        assert self.buffer is not None
        return self.buffer


class ReceivingPlane:
    """Where one push's bytes come from. `accept` runs structural checks in the receiving
    thread and returns the work (copy + checksum) for the staging thread."""

    def __init__(self, staged: list[StagedTensor]) -> None:
        self.staged = staged

    def before_next_item(self) -> None:
        """Called before each stream read (the collective plane receives a bucket here)."""

    def accept(self, item: WeightChunk | WeightPlaced, number: int) -> Callable[[], None]:
        raise NotImplementedError

    def close(self, ok: bool) -> None:
        """Release what the push opened (`ok`: every byte arrived and checked)."""


class StreamPlane(ReceivingPlane):
    """grpc: the bytes are the stream's WeightChunks."""

    def accept(self, item: WeightChunk | WeightPlaced, number: int) -> Callable[[], None]:
        if not isinstance(item, WeightChunk):
            raise InvalidRequestError(
                f"message {number} is a placed tensor but the manifest names no transport; "
                "send WeightChunks, or name the shm region or collective group in the manifest"
            )
        t = accept_chunk(self.staged, item, number)
        return lambda: verify_and_copy(t, item, number)


class PlacedPlane(ReceivingPlane):
    """shm and collective: one WeightPlaced per tensor, in manifest order."""

    transport = "a transport"

    def __init__(self, staged: list[StagedTensor]) -> None:
        super().__init__(staged)
        self.next_tensor = 0

    def accept(self, item: WeightChunk | WeightPlaced, number: int) -> Callable[[], None]:
        if not isinstance(item, WeightPlaced):
            raise InvalidRequestError(
                f"message {number} is a WeightChunk but the manifest puts the bytes on {self.transport}; "
                "send WeightPlaced items (or a manifest without a transport)"
            )
        if not item.tensors:
            raise InvalidRequestError(f"placed message {number} names no tensors; place at least one")
        work: list[tuple[StagedTensor, PlacedTensor]] = []
        for p in item.tensors:
            if p.tensor_index != self.next_tensor:
                raise InvalidRequestError(
                    f"placed message {number} names tensor {p.tensor_index} but tensor {self.next_tensor} is next; "
                    "place each manifest tensor once, in manifest order"
                )
            if self.next_tensor >= len(self.staged):
                raise InvalidRequestError(
                    f"placed message {number} goes beyond the {len(self.staged)} manifest tensors"
                )
            t = self.staged[p.tensor_index]
            if p.byte_length != t.spec.wire_length:
                raise InvalidRequestError(
                    f"placed tensor {t.spec.name!r} has byte_length {p.byte_length}, the manifest {t.spec.wire_length}"
                )
            self.check_arrived(p.tensor_index, number)
            self.next_tensor += 1
            t.scheduled = p.byte_length
            work.append((t, p))

        def stage_all() -> None:
            for t, p in work:
                self.stage(t, p)

        return stage_all

    def check_arrived(self, index: int, number: int) -> None:
        """InvalidRequestError if tensor `index` cannot have arrived yet (collective)."""

    def stage(self, t: StagedTensor, item: PlacedTensor) -> None:
        raise NotImplementedError


class ShmPlane(PlacedPlane):
    transport = "shm"

    def __init__(self, staged: list[StagedTensor], regions: shm.MappedRegions, reader: shm.ShmReader) -> None:
        super().__init__(staged)
        self.regions = regions
        self.reader = reader

    def stage(self, t: StagedTensor, item: PlacedTensor) -> None:
        crc = self.reader.read_into(item.offset, t.bytes_view()) if item.byte_length else 0
        t.received = item.byte_length
        check_tensor_crc(t, crc, item.crc32)

    def close(self, ok: bool) -> None:
        self.regions.release(self.reader, keep=ok)


class CollectivePlane(PlacedPlane):
    transport = "collective"

    def __init__(
        self, staged: list[StagedTensor], groups: collective.GroupRegistry, where: CollectivePlacement
    ) -> None:
        super().__init__(staged)
        self.groups = groups
        self.group = groups.get(where.group_id)
        self.buckets = collective.plan_buckets([t.spec for t in staged], where.bucket_bytes)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self.received_buckets = 0
        self.failed = False

    def before_next_item(self) -> None:
        """Take the next tensor's bucket off the group before reading its WeightPlaced: the
        sender broadcasts a bucket, then sends the bucket's WeightPlaced items."""
        if self.next_tensor >= len(self.staged):
            return
        b = self.bucket_of[self.next_tensor]
        if b < self.received_buckets:
            return
        bucket = [self.staged[i] for i in self.buckets[b]]
        try:
            receive_bucket(self.group, bucket, f"bucket {b} of {len(self.buckets)}")
        except TransportUnavailableError:
            self.failed = True
            raise
        self.received_buckets = b + 1

    def check_arrived(self, index: int, number: int) -> None:
        if self.bucket_of[index] >= self.received_buckets:
            raise InvalidRequestError(
                f"placed message {number} names tensor {index} before its bucket {self.bucket_of[index]} was "
                "broadcast; send a bucket's WeightPlaced after broadcasting it"
            )

    def stage(self, t: StagedTensor, item: PlacedTensor) -> None:
        t.received = item.byte_length
        check_tensor_crc(t, crc32(t.bytes_view()) if item.byte_length else 0, item.crc32)

    def close(self, ok: bool) -> None:
        if self.failed:  # a broadcast that failed leaves the group unusable: rebuild it
            self.groups.drop(self.group.group_id)


def receive_bucket(group: collective.CollectiveGroup, bucket: list[StagedTensor], what: str) -> None:
    """Receive one bucket's broadcast into the staging buffers: a lone tensor straight into its
    buffer (CPU groups), several through one packed buffer."""
    total = sum(t.spec.wire_length for t in bucket)
    if total == 0:
        return
    device = group.device
    if len(bucket) == 1 and device.type == "cpu":
        group.broadcast(torch.from_numpy(bucket[0].bytes_view()), what)
        return
    packed = torch.empty(total, dtype=torch.uint8, device=device)
    group.broadcast(packed, what)
    host = packed.cpu().numpy()
    at = 0
    for t in bucket:
        n = t.spec.wire_length
        if n:
            t.bytes_view()[:] = host[at : at + n]
        at += n


def check_tensor_crc(t: StagedTensor, got: int, want: int) -> None:
    if got != want:
        raise InvalidRequestError(
            f"tensor {t.spec.name!r} has CRC-32 {got:#010x} as staged but was placed with {want:#010x}; "
            "its bytes changed after the sender checksummed them (region rewritten?), push again"
        )


def accept_chunk(staged: list[StagedTensor], chunk: WeightChunk, number: int) -> StagedTensor:
    """Structural checks of a chunk (index, order, bounds), in the receiving thread."""
    if chunk.tensor_index >= len(staged):
        raise InvalidRequestError(
            f"chunk {number} names tensor index {chunk.tensor_index} but the manifest has {len(staged)} tensors"
        )
    t = staged[chunk.tensor_index]
    if chunk.offset != t.scheduled:
        raise InvalidRequestError(
            f"chunk {number} of tensor {t.spec.name!r} starts at byte {chunk.offset} but {t.scheduled} bytes "
            "were received so far; send each tensor's chunks in order"
        )
    if t.scheduled + len(chunk.data) > t.spec.wire_length:
        raise InvalidRequestError(
            f"chunk {number} runs past the end of tensor {t.spec.name!r} "
            f"({t.scheduled} + {len(chunk.data)} > {t.spec.wire_length} bytes)"
        )
    t.scheduled += len(chunk.data)
    if chunk.tensor_crc32 is not None and t.scheduled != t.spec.wire_length:
        raise InvalidRequestError(
            f"chunk {number} carries tensor_crc32 but is not the last chunk of tensor {t.spec.name!r}"
        )
    return t


def verify_and_copy(t: StagedTensor, chunk: WeightChunk, number: int) -> None:
    """Checksum a chunk and copy it into its tensor's buffer (on the staging thread, in order)."""
    crc = crc32(chunk.data)
    if crc != chunk.crc32:
        raise InvalidRequestError(
            f"chunk {number} of tensor {t.spec.name!r} at byte {chunk.offset} has CRC-32 {crc:#010x}, "
            f"not the {chunk.crc32:#010x} it was sent with; the bytes were corrupted, push again"
        )
    t.write(chunk.offset, chunk.data)
    t.crc = crc32_combine(t.crc, crc, len(chunk.data))
    if t.received == t.spec.wire_length:
        if chunk.tensor_crc32 is not None:
            want = chunk.tensor_crc32
        else:
            want = t.spec.delta.payload_crc32 if t.spec.delta is not None else t.spec.crc32
        if t.crc != want:
            raise InvalidRequestError(
                f"tensor {t.spec.name!r} has CRC-32 {t.crc:#010x} but was announced with {want:#010x}; "
                "its bytes differ from what the sender checksummed, push again"
            )
