"""Sparse delta payloads: one tensor's changed served-dtype elements against a base version.

A delta names the elements (flat, row-major positions) whose served-dtype bit pattern differs
from the base and carries their new values, in one of two encodings chosen per tensor by size:
- INDEX:   `changed` little-endian uint32 positions, strictly increasing, then the `changed`
           new values (served dtype, little-endian): changed * (4 + element size) bytes;
- BITMASK: ceil(numel / 8) bytes, bit i (little-endian bit order within each byte) set where
           element i changed, padding bits 0, then the new values in position order:
           ceil(numel / 8) + changed * element size bytes.
The sender sends a tensor in full when neither is smaller than the dense bytes. The receiver
rebuilds the tensor from the base it serves (`apply_delta`), which rejects positions out of
range, unsorted or repeated, counts that do not match, and a payload of the wrong length; the
caller then checks the reconstructed tensor's CRC-32 against the manifest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from sidecar.errors import InvalidRequestError
from sidecar.types import DeltaEncoding, TensorDelta, TensorSpec
from sidecar.weight_transport.checksum import crc32
from sidecar.weight_transport.tensors import tensor_bytes

_INDEX_BYTES = 4
MAX_INDEX_NUMEL = 1 << 32
"""uint32 positions address tensors of up to 2^32 elements; larger ones use the bitmask."""

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def payload_length(encoding: DeltaEncoding, numel: int, changed: int, element_size: int) -> int:
    if encoding is DeltaEncoding.INDEX:
        return changed * (_INDEX_BYTES + element_size)
    return (numel + 7) // 8 + changed * element_size


def encoded_delta_bytes(numel: int, changed: int, element_size: int) -> int:
    """Bytes of the smaller encoding of a delta with `changed` of `numel` elements changed."""
    sizes = [payload_length(DeltaEncoding.BITMASK, numel, changed, element_size)]
    if numel <= MAX_INDEX_NUMEL:
        sizes.append(payload_length(DeltaEncoding.INDEX, numel, changed, element_size))
    return min(sizes)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-width integers (bit patterns), flat."""
    return tensor.detach().contiguous().reshape(-1).view(_INT_OF[tensor.element_size()])


def encode_delta(base: torch.Tensor, new: torch.Tensor) -> tuple[DeltaEncoding, int, np.ndarray] | None:
    """(encoding, changed, payload bytes) of `new` against `base` (same dtype and shape, CPU), or
    None when the dense bytes are no larger than the smaller encoding."""
    if base.dtype != new.dtype or base.shape != new.shape:
        raise ValueError(
            f"a delta needs the same dtype and shape: base {base.dtype} {list(base.shape)}, new {new.dtype} {list(new.shape)}"
        )
    numel, size = new.numel(), new.element_size()
    new_bits = _bits(new)
    mask = _bits(base) != new_bits
    changed = int(mask.sum())
    choice = min(
        (e for e in DeltaEncoding if e is DeltaEncoding.BITMASK or numel <= MAX_INDEX_NUMEL),
        key=lambda e: payload_length(e, numel, changed, size),
    )
    if payload_length(choice, numel, changed, size) >= numel * size:
        return None
    values = new_bits[mask].numpy().view(np.uint8)
    if choice is DeltaEncoding.INDEX:
        head = torch.nonzero(mask).reshape(-1).to(torch.int64).numpy().astype("<u4").view(np.uint8)
    else:
        head = np.packbits(mask.numpy(), bitorder="little")
    return choice, changed, np.concatenate([head, values])


def apply_delta(base: torch.Tensor, spec: TensorDelta, payload: np.ndarray, name: str) -> torch.Tensor:
    """A new tensor: `base` with the delta's positions set to its values. InvalidRequestError for
    a payload of the wrong length, positions out of range, unsorted or repeated."""
    numel, size = base.numel(), base.element_size()
    want = payload_length(spec.encoding, numel, spec.changed, size)
    if spec.encoding is DeltaEncoding.INDEX and numel > MAX_INDEX_NUMEL:
        raise InvalidRequestError(f"tensor {name!r} has {numel} elements, too many for an INDEX delta; use BITMASK")
    if spec.changed > numel:
        raise InvalidRequestError(f"delta of tensor {name!r} changes {spec.changed} of only {numel} elements")
    if payload.nbytes != want:
        raise InvalidRequestError(
            f"delta of tensor {name!r} is {payload.nbytes} bytes but {spec.encoding.name} with {spec.changed} "
            f"changed elements is {want}; send the payload the encoding describes"
        )
    n = spec.changed
    if spec.encoding is DeltaEncoding.INDEX:
        positions = payload[: n * _INDEX_BYTES].view("<u4").astype(np.int64)
        values = payload[n * _INDEX_BYTES :]
        if n and int(positions[-1]) >= numel:
            bad = int(positions.max())
            raise InvalidRequestError(
                f"delta of tensor {name!r} names position {bad} but the tensor has {numel} elements"
            )
        if n > 1 and not bool(np.all(positions[1:] > positions[:-1])):
            at = int(np.argmax(positions[1:] <= positions[:-1]))
            what = "repeated" if positions[at + 1] == positions[at] else "unsorted"
            raise InvalidRequestError(
                f"delta of tensor {name!r} has {what} positions ({int(positions[at])} then {int(positions[at + 1])} "
                f"at entry {at + 1}); send each changed position once, in increasing order"
            )
    else:
        mask_bytes = (numel + 7) // 8
        mask = np.unpackbits(payload[:mask_bytes], bitorder="little")
        if mask[numel:].any():
            raise InvalidRequestError(
                f"delta bitmask of tensor {name!r} sets bits past its {numel} elements; padding bits must be 0"
            )
        positions = np.flatnonzero(mask[:numel])
        if positions.size != n:
            raise InvalidRequestError(
                f"delta bitmask of tensor {name!r} marks {positions.size} elements but the manifest says {n} changed"
            )
        values = payload[mask_bytes:]
    out = base.detach().to("cpu").contiguous().clone()
    if n:
        flat = _bits(out)
        vals = torch.from_numpy(values.copy().view(_np_int(size)))
        flat[torch.from_numpy(positions)] = vals
    return out


def _np_int(size: int) -> np.dtype:
    return np.dtype({1: "<u1", 2: "<i2", 4: "<i4", 8: "<i8"}[size])


@dataclass(kw_only=True, slots=True)
class DeltaBase:
    """What a sender keeps to compute deltas for one sidecar: the served-dtype copy of every
    tensor it last pushed there, and the version that push made the sidecar serve."""

    version: int = 0
    """The sidecar's served version after our last successful push (0: none, send full)."""
    tensors: dict[str, torch.Tensor] | None = None

    def forget(self) -> None:
        """Send the next push in full (first contact, a refusal, a rejoin, or asked to)."""
        self.version, self.tensors = 0, None


@dataclass(kw_only=True, slots=True)
class PlannedPush:
    """A push decided tensor by tensor: specs (full or delta, with the reconstructed tensor's
    CRC-32) and the bytes each puts on the transport, in manifest order."""

    specs: list[TensorSpec]
    wire: list[tuple[str, torch.Tensor]]
    base_version: int
    full: dict[str, torch.Tensor]
    """The served-dtype tensors this push makes the sidecar serve (the next base)."""


def plan_push(named_tensors: Iterable[tuple[str, torch.Tensor]], base: DeltaBase) -> PlannedPush:
    """Per tensor: a delta against `base` when the base holds it (same dtype and shape) and the
    smaller encoding beats the dense bytes; otherwise the full tensor. With no base, all full."""
    specs: list[TensorSpec] = []
    wire: list[tuple[str, torch.Tensor]] = []
    full: dict[str, torch.Tensor] = {}
    held = base.tensors if base.version > 0 and base.tensors is not None else {}
    for name, tensor in named_tensors:
        t = tensor.detach().to("cpu").contiguous().clone()
        full[name] = t
        old = held.get(name)
        enc = encode_delta(old, t) if old is not None and old.dtype == t.dtype and old.shape == t.shape else None
        if enc is None:  # in full: its CRC-32 travels with its bytes (computed as they are sent)
            specs.append(TensorSpec(name=name, dtype=t.dtype, shape=tuple(t.shape)))
            wire.append((name, t))
            continue
        encoding, changed, payload = enc
        crc = crc32(tensor_bytes(t)) if t.numel() else 0  # of the tensor the sidecar must rebuild
        delta = TensorDelta(
            encoding=encoding,
            changed=changed,
            payload_length=payload.nbytes,
            payload_crc32=crc32(payload) if payload.nbytes else 0,
        )
        specs.append(TensorSpec(name=name, dtype=t.dtype, shape=tuple(t.shape), crc32=crc, delta=delta))
        wire.append((name, torch.from_numpy(payload)))
    deltas = any(s.delta is not None for s in specs)
    return PlannedPush(specs=specs, wire=wire, base_version=base.version if deltas else 0, full=full)


__all__ = [
    "DeltaBase",
    "PlannedPush",
    "apply_delta",
    "encode_delta",
    "encoded_delta_bytes",
    "payload_length",
    "plan_push",
]
