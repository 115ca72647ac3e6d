"""The weight stream on its own (no server): checksums against zlib, byte-exact round trips of
the sender into the receiver, and the receiver's refusal of every malformed stream."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sidecar.protocol.convert as convert
import sidecar.protocol.weight_wire as weight_wire
from sidecar.client.weight_sender import iter_push_requests
from sidecar.errors import (
    InvalidRequestError,
    PushCancelledError,
    PushInProgressError,
    StaleVersionError,
    UnknownTensorError,
    WeightMismatchError,
)
from sidecar.protocol.specrl.v1 import weights_pb2
from sidecar.server.weight_receiver import WeightReceiver
from sidecar.types import PushItem, TensorSpec, WeightChunk, WeightCommit, WeightManifest, WeightSelector
from sidecar.weight_transport.checksum import crc32_combine
from sidecar.weight_transport.tensors import spec_of

MODEL = {
    "model.embed_tokens.weight": torch.randn(16, 8),
    "model.norm.weight": torch.randn(8),
    "mtp.layers.0.enorm.weight": torch.randn(8),
}


def model_specs(selector: WeightSelector) -> list[TensorSpec]:
    def wanted(name: str) -> bool:
        draft = name.startswith("mtp.layers.")
        return selector == WeightSelector.ALL or (selector == WeightSelector.DRAFT) == draft

    return [spec_of(n, t) for n, t in MODEL.items() if wanted(n)]


def receiver(served: int = 0) -> WeightReceiver:
    return WeightReceiver(model_specs=model_specs, served_version=lambda: served, keep_staging=False)


def new_weights() -> dict[str, torch.Tensor]:
    return {n: torch.randn_like(t) for n, t in MODEL.items()}


@settings(max_examples=60, deadline=None)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_crc32_combine_matches_zlib_over_the_concatenation(a: bytes, b: bytes) -> None:
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_round_trip_is_byte_exact_for_every_dtype_and_chunking(dtype: torch.dtype, chunk_bytes: int) -> None:
    tensors = {n: torch.randn(t.shape).to(dtype) for n, t in MODEL.items()}
    specs = {n: spec_of(n, t) for n, t in tensors.items()}
    rx = WeightReceiver(
        model_specs=lambda s: [
            v
            for v in specs.values()
            if s == WeightSelector.ALL or v.name.startswith("mtp") == (s == WeightSelector.DRAFT)
        ],
        served_version=lambda: 0,
        keep_staging=False,
    )
    staged = rx.receive(iter_push_requests(tensors, 3, chunk_bytes=chunk_bytes))
    assert staged.version == 3 and staged.selector == WeightSelector.ALL
    assert staged.bytes_received == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in tensors.items():
        got = staged.tensors[name]
        assert got.dtype == dtype and got.shape == t.shape
        assert torch.equal(got.view(torch.uint8) if got.dim() else got, t.view(torch.uint8) if t.dim() else t)


def test_a_generator_streams_lazily_with_specs_and_carries_tensor_checksums() -> None:
    tensors = new_weights()
    consumed: list[str] = []

    def lazily() -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in tensors.items():
            consumed.append(n)
            yield n, t

    items = iter_push_requests(lazily(), 1, specs=model_specs(WeightSelector.ALL), chunk_bytes=100)
    manifest = next(items)
    assert isinstance(manifest, WeightManifest) and consumed == []  # manifest before any tensor is made
    rest = list(items)
    last_chunks = [c for c in rest if isinstance(c, WeightChunk) and c.tensor_crc32 is not None]
    assert [c.tensor_crc32 for c in last_chunks] == [zlib.crc32(t.numpy().tobytes()) for t in tensors.values()]
    with pytest.raises(ValueError, match="needs specs"):
        next(iter_push_requests(lazily(), 1))


def test_the_sender_refuses_a_tensor_that_differs_from_its_spec() -> None:
    specs = model_specs(WeightSelector.ALL)
    wrong = [(s.name, torch.zeros(3)) for s in specs]
    items = iter_push_requests(iter(wrong), 1, specs=specs)
    next(items)
    with pytest.raises(ValueError, match="manifest announced"):
        list(items)


def stream(items: list[PushItem]) -> Iterator[PushItem]:
    return iter(items)


def good_items(version: int = 1, chunk_bytes: int = 64) -> list[PushItem]:
    return list(iter_push_requests(new_weights(), version, chunk_bytes=chunk_bytes))


def manifest_of(items: list[PushItem]) -> WeightManifest:
    m = items[0]
    assert isinstance(m, WeightManifest)
    return m


def chunks_of(items: list[PushItem]) -> list[WeightChunk]:
    return [i for i in items if isinstance(i, WeightChunk)]


def corrupt_first_chunk(items: list[PushItem]) -> list[PushItem]:
    c = chunks_of(items)[0]
    c.data = bytes([c.data[0] ^ 1]) + c.data[1:]
    return items


def corrupt_tensor_checksum(items: list[PushItem]) -> list[PushItem]:
    last = next(c for c in chunks_of(items) if c.tensor_crc32 is not None)
    last.tensor_crc32 = (last.tensor_crc32 or 0) ^ 0xFFFF
    return items


def swap_two_chunks(items: list[PushItem]) -> list[PushItem]:
    items[1], items[2] = items[2], items[1]
    return items


def with_manifest(change: dict[str, object]) -> list[PushItem]:
    items = good_items()
    m = manifest_of(items)
    for key, value in change.items():
        setattr(m, key, value)
    return items


CASES = [
    ("empty stream", lambda: [], InvalidRequestError, "empty"),
    ("chunk before manifest", lambda: good_items()[1:], InvalidRequestError, "not the manifest"),
    ("two manifests", lambda: [good_items()[0], *good_items()], InvalidRequestError, "second manifest"),
    ("missing commit", lambda: good_items()[:-1], InvalidRequestError, "without a commit"),
    ("chunk after commit", lambda: [*good_items(), good_items()[1]], InvalidRequestError, "after the commit"),
    ("lost chunk", lambda: [i for n, i in enumerate(good_items()) if n != 2], InvalidRequestError, "starts at byte"),
    ("out of order", lambda: swap_two_chunks(good_items()), InvalidRequestError, "in order"),
    ("chunk checksum", lambda: corrupt_first_chunk(good_items()), InvalidRequestError, "CRC-32"),
    ("tensor checksum", lambda: corrupt_tensor_checksum(good_items()), InvalidRequestError, "CRC-32"),
    (
        "commit miscount",
        lambda: [*good_items()[:-1], WeightCommit(chunk_count=999)],
        InvalidRequestError,
        "chunks were lost",
    ),
    (
        "unknown tensor index",
        lambda: [good_items()[0], WeightChunk(tensor_index=9, offset=0, data=b"x", crc32=zlib.crc32(b"x"))],
        InvalidRequestError,
        "tensor index 9",
    ),
    ("stale version", lambda: good_items(version=5), StaleVersionError, "not newer"),
    (
        "unknown tensor",
        lambda: list(iter_push_requests({**new_weights(), "model.extra": torch.zeros(2)}, 9)),
        UnknownTensorError,
        "no tensor 'model.extra'",
    ),
    (
        "missing tensor",
        lambda: list(iter_push_requests({"model.norm.weight": torch.zeros(8)}, 9)),
        WeightMismatchError,
        "lacks 2 tensor",
    ),
    (
        "wrong dtype",
        lambda: list(iter_push_requests({n: t.half() for n, t in new_weights().items()}, 9)),
        WeightMismatchError,
        "dtype",
    ),
    (
        "wrong shape",
        lambda: list(iter_push_requests({**new_weights(), "model.norm.weight": torch.zeros(9)}, 9)),
        WeightMismatchError,
        "shape",
    ),
    (
        "draft tensor under TARGET",
        lambda: list(iter_push_requests(new_weights(), 9, WeightSelector.TARGET)),
        WeightMismatchError,
        "not part of the TARGET selector",
    ),
]


@pytest.mark.parametrize(("name", "make", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_the_receiver_refuses_malformed_streams(name: str, make, error: type, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        receiver(served=5 if name == "stale version" else 0).receive(stream(make()))


def test_a_vanished_client_is_a_cancellation_and_pushes_are_serialised() -> None:
    items = good_items()[:3]
    with pytest.raises(PushCancelledError):
        receiver().receive(stream(items), is_active=lambda: False)
    rx = receiver()
    with rx.claim(), pytest.raises(PushInProgressError, match="another weight push"):
        rx.claim()
    with rx.claim():  # released after the first claim ended
        pass


# --- the wire fast path of chunks against the protobuf runtime (the oracle) -----------------

u32 = st.integers(0, 2**32 - 1)


def _same(a: object, b: object) -> bool:
    if isinstance(a, WeightChunk) and isinstance(b, WeightChunk):
        return (a.tensor_index, a.offset, bytes(a.data), a.crc32, a.tensor_crc32) == (
            b.tensor_index,
            b.offset,
            bytes(b.data),
            b.crc32,
            b.tensor_crc32,
        )
    return a == b


@settings(max_examples=150, deadline=None)
@given(index=u32, offset=st.integers(0, 2**64 - 1), data=st.binary(max_size=300), crc=u32, tcrc=st.none() | u32)
def test_chunk_wire_encoding_is_protobufs_and_reads_back(
    index: int, offset: int, data: bytes, crc: int, tcrc: int | None
) -> None:
    item = WeightChunk(tensor_index=index, offset=offset, data=data, crc32=crc, tensor_crc32=tcrc)
    wire = weight_wire.push_item_to_wire(item)
    assert wire == convert.push_item_to_pb(item).SerializeToString()
    assert _same(weight_wire.push_item_from_wire(wire), item)


def _field(tag: int, value: int | bytes) -> bytes:
    if tag in (0x25, 0x2D):
        return bytes([tag]) + int(value).to_bytes(4, "little")  # type: ignore[arg-type]
    if tag == 0x1A:
        assert isinstance(value, bytes)
        return bytes([tag]) + weight_wire._varint(len(value)) + value
    return bytes([tag]) + weight_wire._varint(int(value))  # type: ignore[arg-type]


fields = st.one_of(
    st.tuples(st.sampled_from([0x08, 0x10]), st.integers(0, 2**70)),
    st.tuples(st.just(0x1A), st.binary(max_size=20)),
    st.tuples(st.sampled_from([0x25, 0x2D]), u32),
)


@settings(max_examples=200, deadline=None)
@given(body=st.lists(fields, max_size=7), junk=st.binary(max_size=3), whole=st.booleans())
def test_any_chunk_bytes_read_exactly_as_protobuf_reads_them(
    body: list[tuple[int, int | bytes]], junk: bytes, whole: bool
) -> None:
    inner = b"".join(_field(t, v) for t, v in body) + (b"" if whole else junk)
    raw = b"\x12" + weight_wire._varint(len(inner)) + inner
    got = weight_wire.push_item_from_wire(raw)
    try:
        want = convert.push_item_from_pb(weights_pb2.PushWeightsRequest.FromString(raw))
    except Exception:
        assert isinstance(got, InvalidRequestError)
        return
    assert _same(got, want)


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=40))
def test_random_bytes_never_escape_as_anything_but_invalid_argument(raw: bytes) -> None:
    got = weight_wire.push_item_from_wire(raw)
    assert isinstance(got, (InvalidRequestError, WeightManifest, WeightChunk, WeightCommit))
