"""The sending side of a weight push: the PushWeights items for a stream of tensors.

`iter_push_requests` turns (name, tensor) pairs into a manifest, the bytes on one transport,
and a commit. Tensors are consumed lazily, one at a time (a trainer can gather and send one
tensor at a time). The bytes go
- on the stream (no transport): `WeightChunk`s of `chunk_bytes`, each with its CRC-32, the
  tensor's CRC-32 on its last chunk (a streaming sender cannot know it for the manifest);
- into a shared-memory region (`ShmSender`): each tensor written once at its offset, then one
  `WeightPlaced` naming offset and CRC-32;
- over a collective group (`CollectiveSender`): tensors packed into buckets, each bucket
  broadcast once, then one `WeightPlaced` per tensor of the bucket.
A tensor that does not match its spec raises ValueError, which ends the stream without a
commit, so the sidecar applies nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from sidecar.types import (
    CollectivePlacement,
    PlacedTensor,
    PushItem,
    ShmPlacement,
    TensorSpec,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightPlaced,
    WeightSelector,
)
from sidecar.weight_transport import collective, shm
from sidecar.weight_transport.checksum import crc32, crc32_combine
from sidecar.weight_transport.tensors import spec_of, tensor_bytes

DEFAULT_CHUNK_BYTES = 4 << 20
"""4 MiB: large enough that per-message overhead is negligible, far below the 64 MiB limit."""

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


SHM_BATCH_BYTES = 64 << 20
"""Tensors written to shared memory before their WeightPlaced goes out: few messages (per-message
costs dominate small models), yet the sidecar starts reading a large model early."""


class ShmSender:
    """Places a push's tensors in a sender-owned shared-memory region (reused across pushes)."""

    def __init__(self, region: shm.ShmRegion, batch_bytes: int = SHM_BATCH_BYTES) -> None:
        self.region = region
        self.batch_bytes = batch_bytes

    @property
    def placement(self) -> ShmPlacement:
        return ShmPlacement(region=self.region.name)

    def place(self, pairs: Iterator[tuple[int, torch.Tensor]], specs: Sequence[TensorSpec]) -> Iterator[WeightPlaced]:
        offsets, total = [], 0
        for s in specs:
            offsets.append(total)
            total += s.wire_length
        self.region.ensure(total)
        batch: list[PlacedTensor] = []
        size = 0
        for index, tensor in pairs:
            view = tensor_bytes(tensor)
            crc = self.region.write(offsets[index], view) if view.nbytes else 0
            batch.append(PlacedTensor(tensor_index=index, offset=offsets[index], byte_length=view.nbytes, crc32=crc))
            size += view.nbytes
            if size >= self.batch_bytes:
                yield WeightPlaced(tensors=batch)
                batch, size = [], 0
        if batch:
            yield WeightPlaced(tensors=batch)


class CollectiveSender:
    """Broadcasts a push's tensors over a group this process joined as rank 0, in buckets."""

    def __init__(self, group: collective.CollectiveGroup, bucket_bytes: int = collective.DEFAULT_BUCKET_BYTES) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.group = group
        self.bucket_bytes = bucket_bytes

    @property
    def placement(self) -> CollectivePlacement:
        return CollectivePlacement(group_id=self.group.group_id, bucket_bytes=self.bucket_bytes)

    def place(self, pairs: Iterator[tuple[int, torch.Tensor]], specs: Sequence[TensorSpec]) -> Iterator[WeightPlaced]:
        buckets = collective.plan_buckets(specs, self.bucket_bytes)
        for b, bucket in enumerate(buckets):
            tensors = []
            for want in bucket:
                index, tensor = next(pairs)
                if index != want:  # pairs are enumerated in manifest order
                    raise ValueError(f"tensor {index} arrived where tensor {want} was expected")
                tensors.append(tensor.detach().contiguous())
            self._broadcast(tensors, f"bucket {b} of {len(buckets)}")
            placed = []
            for index, tensor in zip(bucket, tensors, strict=True):
                view = tensor_bytes(tensor)  # a host copy for device tensors (the checksum needs it)
                placed.append(
                    PlacedTensor(
                        tensor_index=index, offset=0, byte_length=view.nbytes, crc32=crc32(view) if view.nbytes else 0
                    )
                )
            yield WeightPlaced(tensors=placed)
        rest = next(pairs, None)
        if rest is not None:
            raise ValueError(f"tensor {rest[0]} is beyond the {len(specs)} tensors of the manifest")

    def _broadcast(self, tensors: list[torch.Tensor], what: str) -> None:
        flat = [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
        if not flat:
            return
        device = self.group.device
        if len(flat) == 1 and device.type == flat[0].device.type:
            self.group.broadcast(flat[0], what)
            return
        self.group.broadcast(torch.cat([f.to(device) for f in flat]), what)


TransportSender = ShmSender | CollectiveSender


def iter_push_requests(
    named_tensors: NamedTensors,
    version: int,
    selector: WeightSelector = WeightSelector.ALL,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    specs: Sequence[TensorSpec] | None = None,
    data_plane: TransportSender | None = None,
    base_version: int = 0,
) -> Iterator[PushItem]:
    """The items of one push: manifest, the bytes (chunks, or placed tensors on `data_plane`),
    commit.

    `named_tensors` is a mapping (a state dict) or an iterable of (name, tensor) pairs consumed
    lazily, one tensor in memory at a time; an iterable needs `specs` (the manifest, in the
    order the tensors will come; `SidecarClient.describe_weights` gives it).
    A spec with `delta` set (`delta.plan_push`) takes its payload (a flat uint8 tensor) in place
    of the tensor, and `base_version` names the version the deltas were computed against.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    if version <= 0:
        raise ValueError(f"version must be > 0 (the sidecar starts at 0 and versions increase), got {version}")
    pairs: Iterable[tuple[str, torch.Tensor]] = (
        named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    )
    if isinstance(named_tensors, Mapping):
        if specs is None:
            specs = [spec_of(n, t) for n, t in named_tensors.items()]
    elif specs is None:
        raise ValueError(
            "streaming an iterable of tensors needs specs= (the manifest, e.g. from describe_weights); "
            "or pass a mapping of name to tensor"
        )
    manifest = push_manifest(
        specs, version, selector, data_plane.placement if data_plane is not None else None, base_version
    )
    checked = checked_pairs(pairs, manifest.tensors)  # generators: nothing runs before the manifest is sent
    body = _chunks(checked, chunk_bytes) if data_plane is None else data_plane.place(checked, manifest.tensors)
    yield from framed_push(manifest, body)


def push_manifest(
    specs: Sequence[TensorSpec],
    version: int,
    selector: WeightSelector = WeightSelector.ALL,
    placement: ShmPlacement | CollectivePlacement | None = None,
    base_version: int = 0,
) -> WeightManifest:
    """The manifest of a push of `specs` (a full tensor's CRC-32 travels with its bytes; a
    delta's, of the reconstructed tensor, in the manifest)."""
    manifest_specs = [
        TensorSpec(
            name=s.name,
            dtype=s.dtype,
            shape=tuple(s.shape),
            crc32=s.crc32 if s.delta is not None else 0,  # a delta's: of the reconstructed tensor
            delta=s.delta,
        )
        for s in specs
    ]
    if base_version == 0 and any(s.delta is not None for s in manifest_specs):
        raise ValueError("a push with delta tensors needs base_version= (the version they were computed against)")
    return WeightManifest(
        version=version, selector=selector, tensors=manifest_specs, data_plane=placement, base_version=base_version
    )


def framed_push(manifest: WeightManifest, body: Iterable[WeightChunk | WeightPlaced]) -> Iterator[PushItem]:
    """A push's items: the manifest, the body (chunks, or placements on the manifest's data
    plane, e.g. written once by one writer for several sidecars), the commit counting them."""
    yield manifest
    count = 0
    for item in body:
        yield item
        count += 1
    yield WeightCommit(chunk_count=count)


def checked_pairs(
    pairs: Iterable[tuple[str, torch.Tensor]], specs: Sequence[TensorSpec]
) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, tensor) in manifest order; ValueError for a tensor that is not its spec's, or a
    count that differs from the manifest's."""
    index = -1
    for index, (name, tensor) in enumerate(pairs):
        if index >= len(specs):
            raise ValueError(f"tensor {name!r} is beyond the {len(specs)} tensors of the manifest")
        spec = specs[index]
        dtype, shape = (torch.uint8, (spec.wire_length,)) if spec.delta is not None else (spec.dtype, spec.shape)
        if name != spec.name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"tensor {index} is {name!r} {tensor.dtype} {list(tensor.shape)} but the manifest announced "
                f"{spec.name!r} {dtype} {list(shape)}"
            )
        yield index, tensor
    if index + 1 != len(specs):
        raise ValueError(f"the tensors ended after {index + 1} of the {len(specs)} manifest entries")


def _chunks(pairs: Iterator[tuple[int, torch.Tensor]], chunk_bytes: int) -> Iterator[WeightChunk]:
    for index, tensor in pairs:
        view = tensor_bytes(tensor)
        total = view.nbytes
        crc = 0
        for offset in range(0, total, chunk_bytes):
            data = memoryview(view[offset : offset + chunk_bytes].data)  # no copy: the encoder's join copies once
            chunk_crc = crc32(data)
            crc = crc32_combine(crc, chunk_crc, len(data))
            yield WeightChunk(
                tensor_index=index,
                offset=offset,
                data=data,
                crc32=chunk_crc,
                tensor_crc32=crc if offset + len(data) >= total else None,
            )
        del view
