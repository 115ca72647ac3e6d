"""The PushWeights wire encoding: serialised `PushWeightsRequest` messages, fast for chunks.

Weight chunks carry nearly every byte of a grpc push, so they bypass the protobuf object model
in both directions: building a WeightChunk message and serialising it copies each payload
twice, and parsing one copies it twice more. The functions below produce and read exactly the
protobuf wire encoding (tests compare them with the protobuf runtime), with one copy on the
sender (the join) and none on the receiver (the payload is a memoryview of the message).
Anything other than a canonically encoded chunk (manifests, placed tensors, commits) goes
through the protobuf runtime via `sidecar.protocol.convert`.
"""

from __future__ import annotations

from sidecar.errors import InvalidRequestError
from sidecar.protocol.convert import push_item_from_pb, push_item_to_pb
from sidecar.protocol.specrl.v1 import weights_pb2
from sidecar.types import PushItem, WeightChunk

_CHUNK_FIELD = 0x12  # PushWeightsRequest.chunk: field 2, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int] | None:
    result = shift = 0
    for i in range(pos, min(end, pos + 10)):
        b = buf[i]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i + 1
        shift += 7
    return None


def push_item_to_wire(item: PushItem) -> bytes:
    """The serialised PushWeightsRequest of `item` (bytes equal to protobuf's encoding)."""
    if not isinstance(item, WeightChunk):
        return bytes(push_item_to_pb(item).SerializeToString())
    head = b""
    if item.tensor_index:
        head += b"\x08" + _varint(item.tensor_index)
    if item.offset:
        head += b"\x10" + _varint(item.offset)
    n = len(item.data)
    data_head = b"\x1a" + _varint(n) if n else b""
    tail = b""
    if item.crc32:
        tail += b"\x25" + item.crc32.to_bytes(4, "little")
    if item.tensor_crc32 is not None:
        tail += b"\x2d" + item.tensor_crc32.to_bytes(4, "little")
    size = len(head) + len(data_head) + (n if n else 0) + len(tail)
    parts: list[bytes | memoryview] = [bytes([_CHUNK_FIELD]) + _varint(size), head, data_head]
    if n:
        parts.append(item.data)
    parts.append(tail)
    return b"".join(parts)


def push_item_from_wire(raw: bytes) -> PushItem | InvalidRequestError:
    """Read one serialised PushWeightsRequest; an unparseable one comes back as the error (the
    servicer raises it as INVALID_ARGUMENT rather than gRPC answering INTERNAL)."""
    fast = _chunk_from_wire(raw)
    if fast is not None:
        return fast
    try:
        return push_item_from_pb(weights_pb2.PushWeightsRequest.FromString(raw))
    except InvalidRequestError as e:
        return e
    except Exception as e:  # protobuf's DecodeError and friends: the bytes are not a message
        return InvalidRequestError(f"a push message is not a valid PushWeightsRequest ({e}); check the encoder")


def _chunk_from_wire(raw: bytes) -> WeightChunk | None:
    """A canonically encoded chunk, its data a zero-copy view; None for anything else."""
    buf = memoryview(raw)
    end = len(buf)
    if end < 2 or buf[0] != _CHUNK_FIELD:
        return None
    got = _read_varint(buf, 1, end)
    if got is None or got[1] + got[0] != end:
        return None
    pos = got[1]
    fields: dict[int, object] = {}
    while pos < end:
        tag = buf[pos]
        pos += 1
        if tag in fields:
            return None  # repeated field: let protobuf apply its merge rules
        if tag in (0x08, 0x10, 0x1A):
            got = _read_varint(buf, pos, end)
            if got is None:
                return None
            value, pos = got
            if tag == 0x1A:
                if pos + value > end:
                    return None
                fields[tag] = buf[pos : pos + value]
                pos += value
            elif value >= (1 << 32 if tag == 0x08 else 1 << 64):
                return None
            else:
                fields[tag] = value
        elif tag in (0x25, 0x2D):
            if pos + 4 > end:
                return None
            fields[tag] = int.from_bytes(buf[pos : pos + 4], "little")
            pos += 4
        else:
            return None
    data = fields.get(0x1A, b"")
    return WeightChunk(
        tensor_index=int(fields.get(0x08, 0)),  # type: ignore[call-overload]
        offset=int(fields.get(0x10, 0)),  # type: ignore[call-overload]
        data=data,  # type: ignore[arg-type]
        crc32=int(fields.get(0x25, 0)),  # type: ignore[call-overload]
        tensor_crc32=int(fields[0x2D]) if 0x2D in fields else None,  # type: ignore[call-overload]
    )
