"""Weight transports (shm, collective) under the PushWeights control plane, against a live
sidecar: each transport delivers exactly the pushed model (greedy output equals the
full-forward oracle of the pushed weights); negotiation falls back to grpc, saying why, when a
fast path is unavailable or unproven; and every fault (bad region, rewritten bytes, wrong
offset, stale version, a second sender, a group that never forms) leaves the old weights and
version serving.

The receiving side of each transport is `sidecar/server/weight_transports.py`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import sidecar.protocol.weight_wire as weight_wire
from sidecar.client.client import ClientConfig, SidecarCallError, SidecarClient
from sidecar.client.transport import CollectiveConfig, TransportConfig
from sidecar.client.weight_sender import ShmSender, iter_push_requests
from sidecar.errors import InvalidRequestError, TransportUnavailableError
from sidecar.server.process import Sidecar
from sidecar.server.weight_receiver import TransportOffer, WeightReceiver
from sidecar.types import (
    PlacedTensor,
    PreparedTransport,
    PushItem,
    ShmPlacement,
    WeightManifest,
    WeightPlaced,
    WeightSelector,
    WeightTransport,
)
from sidecar.weight_transport import shm
from sidecar.weight_transport.collective import plan_buckets
from sidecar.weight_transport.tensors import spec_of, tensor_bytes
from tests.sidecar_fixtures import GLOO, TRANSPORTS, greedy_oracle, greedy_tokens, start_sidecar, weights

pytestmark = pytest.mark.usefixtures("single_torch_thread")

_ORACLES: dict[int, list[list[int]]] = {}


def oracle(seed: int) -> list[list[int]]:
    if seed not in _ORACLES:
        _ORACLES[seed] = greedy_oracle(seed)
    return _ORACLES[seed]


def client(address: str, transports: TransportConfig) -> SidecarClient:
    return SidecarClient(address, ClientConfig(transports=transports, timeout_s=30.0))


def assert_serves(c: SidecarClient, version: int, seed: int) -> None:
    assert c.info().weight_version == version
    assert greedy_tokens(c) == oracle(seed)


# --- delivery ---------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", list(TRANSPORTS), ids=lambda t: t.value)
def test_each_transport_delivers_the_model_exactly(checkpoint: Path, transport: WeightTransport) -> None:
    with start_sidecar(checkpoint) as sc, client(sc.address, TRANSPORTS[transport]) as c:
        assert oracle(0) != oracle(1)  # the test can fail: different weights, different greedy text
        result = c.push_weights(weights(1), version=1)
        assert result.transport is transport and c.transport_session.choice is not None
        assert c.transport_session.choice.transport is transport
        assert result.bytes_received == sum(t.numel() * 4 for t in weights(1).values())
        assert_serves(c, 1, 1)
        # A streamed push (one tensor at a time, specs from DescribeWeights) on the same plane.
        specs, _ = c.describe_weights()
        w2 = weights(2)
        result = c.push_weights(((s.name, w2[s.name]) for s in specs), version=2, specs=specs)
        assert result.transport is transport
        assert_serves(c, 2, 2)
        # A stale version is refused on every plane, and nothing moves.
        with pytest.raises(SidecarCallError) as err:
            c.push_weights(weights(3), version=2)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in err.value.details
        assert_serves(c, 2, 2)
        # A selector push on a fast plane replaces only its part.
        target = {s.name for s in c.describe_weights(WeightSelector.TARGET)[0]}
        w3 = weights(3)
        c.push_weights({n: t for n, t in w3.items() if n in target}, 3, WeightSelector.TARGET)
        assert_serves(c, 3, 3)  # greedy output depends on the target only (the draft is lossless)


@pytest.mark.parametrize("transport", list(TRANSPORTS), ids=lambda t: t.value)
def test_pushes_back_to_back_into_reused_buffers_serve_the_last(checkpoint: Path, transport: WeightTransport) -> None:
    """With kept staging buffers (`keep_staging`, specrl serve's default) the third push is received
    into the buffers the first one served from, at their addresses, written below autograd's version
    counters: with no generation between the pushes the engine's decode weights must still be
    rebuilt (they once served stale copies: greedy output of neither version)."""
    with (
        start_sidecar(checkpoint, keep_staging=True) as sc,
        client(sc.address, TRANSPORTS[transport]) as c,
    ):
        c.push_weights(weights(5), version=1)
        assert_serves(c, 1, 5)
        c.push_weights(weights(6), version=2)
        assert c.push_weights(weights(7), version=3).transport is transport
        assert_serves(c, 3, 7)


# --- negotiation and fallback ---------------------------------------------------------------


def test_a_sidecar_on_another_host_falls_back_to_grpc(checkpoint: Path, tmp_path: Path) -> None:
    """The sidecar's /proc is another directory (as on another host): the nonce probe cannot
    be opened there, so the client stays on grpc and says why."""
    other = tmp_path / "other-host-proc"
    other.mkdir()
    with (
        start_sidecar(checkpoint, transports=TransportOffer(proc_dir=other)) as sc,
        client(sc.address, TransportConfig()) as c,
    ):
        assert WeightTransport.SHM in c.offered_transports()  # it claims shm ...
        result = c.push_weights(weights(1), version=1)
        assert result.transport is WeightTransport.GRPC  # ... but cannot prove it
        choice = c.transport_session.choice
        assert choice is not None and choice.transport is WeightTransport.GRPC
        assert "shm:" in choice.reason and "does not exist here" in choice.reason
        assert_serves(c, 1, 1)


def test_a_spoofed_shm_claim_falls_back_to_grpc(sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sidecar that answers the probe with bytes it did not read from the region is not
    trusted with shm."""
    monkeypatch.setattr(
        sidecar.weights._receiver, "prepare_transport", lambda request: PreparedTransport(shm_nonce=b"\0" * 32)
    )
    with client(sidecar.address, TransportConfig()) as c:
        version = c.info().weight_version
        choice = c.negotiate_transport()
        assert choice.transport is WeightTransport.GRPC and "other bytes than the probe" in choice.reason
        assert c.push_weights(weights(7), version=version + 1).transport is WeightTransport.GRPC
        assert_serves(c, version + 1, 7)


def test_transports_not_offered_are_not_used(checkpoint: Path) -> None:
    planes = TransportOffer(shm=False, collective=False)
    with start_sidecar(checkpoint, transports=planes) as sc, client(sc.address, TransportConfig(collective=GLOO)) as c:
        assert c.offered_transports() == [WeightTransport.GRPC]
        choice = c.negotiate_transport()
        assert choice.transport is WeightTransport.GRPC
        assert "shm: not offered" in choice.reason and "collective: not offered" in choice.reason
        # A manifest naming a plane the sidecar does not offer is refused, and nothing moves.
        region = shm.ShmRegion()
        try:
            with pytest.raises(SidecarCallError) as err:
                _push_raw(c, iter_push_requests(weights(1), 1, data_plane=ShmSender(region)))
        finally:
            region.close()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "does not offer" in err.value.details
        assert_serves(c, 0, 0)


def test_a_collective_peer_that_never_joins_is_a_bounded_fallback(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar answers PrepareTransport without joining: the sender's join gives up after
    the group timeout, reports it, and the push goes over grpc."""

    def never_join(request: object) -> PreparedTransport:
        raise TransportUnavailableError("this test's sidecar never joins")

    monkeypatch.setattr(sidecar.weights._receiver, "prepare_transport", never_join)
    quick = CollectiveConfig(host="127.0.0.1", timeout_s=2.0)
    with client(sidecar.address, TransportConfig(shm=False, collective=quick)) as c:
        version = c.info().weight_version
        choice = c.negotiate_transport()
        assert choice.transport is WeightTransport.GRPC and "collective:" in choice.reason
        assert "did not form within 2s" in choice.reason or "never joins" in choice.reason
        assert c.push_weights(weights(8), version=version + 1).transport is WeightTransport.GRPC
        assert_serves(c, version + 1, 8)


# --- faults on the shm plane ------------------------------------------------------------------


def _push_raw(c: SidecarClient, items: Iterator[PushItem]) -> None:
    """Send push items as they are, through the client's raw PushWeights call."""
    try:
        c._push((weight_wire.push_item_to_wire(i) for i in items), timeout=30.0, metadata=c._metadata)
    except grpc.RpcError as e:
        raise c._error("PushWeights", e) from None


def _with_fault(items: Iterator[PushItem], fault: object, when: type) -> Iterator[PushItem]:
    """Apply `fault(item)` to the first item of type `when` before it is sent (a WeightPlaced:
    after the sender wrote the region; the manifest: before the sidecar opened it)."""
    done = False
    for item in items:
        if isinstance(item, when) and not done:
            done = True
            changed = fault(item)  # type: ignore[operator]
            if isinstance(changed, (WeightManifest, WeightPlaced)):
                item = changed
        yield item


def _shifted(item: WeightPlaced, by: int) -> WeightPlaced:
    return WeightPlaced(
        tensors=[
            PlacedTensor(tensor_index=t.tensor_index, offset=t.offset + by, byte_length=t.byte_length, crc32=t.crc32)
            for t in item.tensors
        ]
    )


SHM_FAULTS = {  # name: (fault, the item it hits, what the refusal says)
    "closed before the sidecar opened it": (
        lambda region: lambda item: _renamed(item, _closed()),
        WeightManifest,
        ("does not exist here", "not the sender's region"),
    ),
    "naming another file": (
        lambda region: lambda item: _renamed(item, f"specrl-{os.getpid()}-0-{region.token}"),
        WeightManifest,
        "not the sender's region",
    ),
    "naming another region": (lambda region: lambda item: _renamed(item, _other_open()), WeightManifest, "CRC-32"),
    "rewritten after its checksum": (
        lambda region: lambda item: region.write(0, torch.ones(16, dtype=torch.uint8).numpy()),
        WeightPlaced,
        "CRC-32",
    ),
    "wrong offset": (lambda region: lambda item: _shifted(item, 4), WeightPlaced, "CRC-32"),
    "offset past the end": (lambda region: lambda item: _shifted(item, 1 << 30), WeightPlaced, "ends at byte"),
    "readable by others": (lambda region: lambda item: os.chmod(region.path, 0o644), WeightManifest, "not a private"),
}


_KEPT: list[shm.ShmRegion] = []


def _closed() -> str:
    r = shm.ShmRegion()
    r.close()
    return r.name


def _other_open() -> str:
    r = shm.ShmRegion()
    r.ensure(1 << 20)
    _KEPT.append(r)
    return r.name


def _renamed(item: WeightManifest, name: str) -> WeightManifest:
    item.data_plane = ShmPlacement(region=name)
    return item


def test_a_region_cannot_shrink_under_the_sidecar() -> None:
    """The region is sealed against shrinking, so the sidecar may copy from its mapping
    without risking SIGBUS: truncating it fails for everyone, the sender included."""
    region = shm.ShmRegion()
    try:
        region.ensure(4096)
        with pytest.raises(PermissionError):
            os.truncate(region.path, 64)
        region.ensure(8192)  # growing is allowed
        assert os.stat(region.path).st_size == 8192
    finally:
        region.close()


@pytest.mark.parametrize("fault", list(SHM_FAULTS))
def test_a_damaged_shm_push_leaves_the_old_weights_serving(sidecar: Sidecar, fault: str) -> None:
    make_fault, when, message = SHM_FAULTS[fault]
    with client(sidecar.address, TransportConfig()) as c:
        version = c.info().weight_version
        before = greedy_tokens(c)
        region = shm.ShmRegion()
        try:
            items = iter_push_requests(weights(9), version + 1, data_plane=ShmSender(region))
            with pytest.raises(SidecarCallError) as err:
                _push_raw(c, _with_fault(items, make_fault(region), when))
        finally:
            region.close()
        # A closed region's descriptor number may already name another file (then it is refused
        # as not the region): either way nothing is read from it.
        assert any(m in err.value.details for m in ((message,) if isinstance(message, str) else message))
        assert err.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE)
        assert c.info().weight_version == version and greedy_tokens(c) == before


def test_a_refused_push_places_nothing_in_the_region_after_it_returns(sidecar: Sidecar) -> None:
    """gRPC draws a push's items on its own thread, so a tensor may be being placed in the
    region when the sidecar refuses the push. That draw finishes, and nothing more is drawn,
    before push_items returns: the next push reuses the region (CI once saw a full push that
    followed a refused delta fail its CRC-32 check, the region rewritten under it)."""
    receiver = sidecar.weights._receiver
    drawn_at: list[float] = []

    def slow(items: Iterator[PushItem]) -> Iterator[PushItem]:
        for i, item in enumerate(items):
            if i:  # the manifest goes at once, and the sidecar refuses it while the next item is placed
                time.sleep(0.3)
                drawn_at.append(time.monotonic())
            yield item

    with client(sidecar.address, TransportConfig()) as c:
        version = c.info().weight_version
        assert c.push_weights(weights(5), version=version + 1).transport is WeightTransport.SHM
        plane = c.transport_session.sender
        with receiver.claim(), pytest.raises(SidecarCallError) as err:  # another push is being received
            c.push_items(slow(iter_push_requests(weights(6), version + 2, data_plane=plane)), plane=plane)
        returned = time.monotonic()
        assert err.value.code == grpc.StatusCode.ABORTED
        time.sleep(0.6)
        # At most the item being placed when the refusal came was drawn (none, when the refusal won the race
        # to gRPC's draw thread, as on a loaded box), and it finished before push_items returned.
        assert len(drawn_at) <= 1 and all(t <= returned for t in drawn_at)
        assert c.push_weights(weights(6), version=version + 2).transport is WeightTransport.SHM
        assert_serves(c, version + 2, 6)


@pytest.mark.parametrize(
    "name", ["../etc/passwd", "specrl-1-2-../x", "other-region", "specrl-", "specrl-1-2-0123456789abcdeg"]
)
def test_region_names_outside_the_namespace_are_refused(sidecar: Sidecar, name: str) -> None:
    with client(sidecar.address, TransportConfig()) as c:
        version = c.info().weight_version
        w = weights(9)
        specs = [spec_of(n, t) for n, t in w.items()]
        items: list[PushItem] = [WeightManifest(version=version + 1, selector=WeightSelector.ALL, tensors=specs)]
        items[0].data_plane = ShmPlacement(region=name)  # type: ignore[union-attr]
        with pytest.raises(SidecarCallError) as err:
            _push_raw(c, iter(items))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "is not 'specrl-<pid>" in err.value.details
        assert c.info().weight_version == version


def test_a_push_refused_while_another_is_in_progress_ends_its_collective_group(sidecar: Sidecar) -> None:
    """The client drops its group after the ABORTED push, so the sidecar's end must go too
    (as after any failed push), not stay registered until the sidecar stops."""
    receiver = sidecar.weights._receiver
    with client(sidecar.address, TRANSPORTS[WeightTransport.COLLECTIVE]) as c:
        version = c.info().weight_version
        assert c.push_weights(weights(5), version=version + 1).transport is WeightTransport.COLLECTIVE
        plane = c.transport_session.sender
        assert plane is not None and not isinstance(plane, ShmSender)
        group_id = plane.group.group_id
        with receiver.claim(), pytest.raises(SidecarCallError) as err:  # another push is being received
            c.push_weights(weights(6), version=version + 2)
        assert err.value.code == grpc.StatusCode.ABORTED
        assert group_id not in receiver.groups._groups
        assert c.push_weights(weights(6), version=version + 2).transport is WeightTransport.COLLECTIVE
        assert_serves(c, version + 2, 6)
        assert group_id not in receiver.groups._groups and not receiver.groups._retired


@pytest.mark.parametrize("transport", [WeightTransport.SHM, WeightTransport.COLLECTIVE], ids=lambda t: t.value)
def test_two_senders_at_once_serve_one_complete_model(checkpoint: Path, transport: WeightTransport) -> None:
    """Two clients (each with its own region or group) push different models at the same
    time: the sidecar serialises them, a refused one changes nothing, what serves is exactly
    one of the pushed models, the one of the served version, and both senders can push again."""
    with start_sidecar(checkpoint) as sc:
        clients = [client(sc.address, TRANSPORTS[transport]), client(sc.address, TRANSPORTS[transport])]
        outcome: dict[int, object] = {}
        start = threading.Barrier(2)

        def push(i: int) -> None:
            start.wait()
            try:
                outcome[i] = clients[i].push_weights(weights(11 + i), version=1 + i).version
            except SidecarCallError as e:
                outcome[i] = e.code

        threads = [threading.Thread(target=push, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert set(outcome.values()) <= {1, 2, grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION}
        assert any(isinstance(v, int) for v in outcome.values())
        version = clients[0].info().weight_version
        assert version in (1, 2) and outcome[version - 1] == version
        assert greedy_tokens(clients[0]) == oracle(10 + version)
        for n, c in enumerate(clients):  # a refused sender's plane was dropped and is rebuilt
            assert c.push_weights(weights(13 + n), version=3 + n).transport is transport
            assert_serves(c, 3 + n, 13 + n)
            c.close()


# --- the receiver against an oracle (property-based) ----------------------------------------


@st.composite
def _models(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    n = draw(st.integers(1, 6))
    out = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
        out[f"t{i}"] = torch.randn(shape).to(dtype) if shape else torch.tensor(draw(st.floats(-4, 4))).to(dtype)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    model=_models(),
    batch_bytes=st.integers(1, 600),
    fault=st.sampled_from(["none", "reorder", "drop", "repeat", "shift", "flip", "length"]),
    at=st.integers(0, 10),
)
def test_shm_receiver_returns_exactly_the_pushed_tensors_or_refuses(
    model: dict[str, torch.Tensor], batch_bytes: int, fault: str, at: int
) -> None:
    """Oracle: an undamaged push stages bit-identical tensors; a damaged one raises
    InvalidRequestError or (when the damage reads the very same bytes) stages bit-identical
    tensors: never a wrong model."""
    specs = [spec_of(n, t) for n, t in model.items()]
    receiver = WeightReceiver(model_specs=lambda selector: specs, served_version=lambda: 0, keep_staging=False)
    region = shm.ShmRegion()
    try:
        items = list(iter_push_requests(model, 1, data_plane=ShmSender(region, batch_bytes=batch_bytes)))
        placed = [p for i in items if isinstance(i, WeightPlaced) for p in i.tensors]
        damaged = _damage(placed, fault, at, region)
        if damaged is not None:
            items = [items[0], WeightPlaced(tensors=damaged), items[-1]]
            items[-1].chunk_count = 1  # type: ignore[union-attr]
        undamaged = damaged is None or (damaged == placed and fault != "flip")
        try:
            staged = receiver.receive(iter(items))
        except InvalidRequestError:
            assert not undamaged, "an undamaged push was refused"
            return
        # Accepted: it must be exactly the pushed model. (Damage that reads identical bytes, e.g.
        # an offset shifted by one inside a run of zeros, is no damage and may be accepted.)
        for name, tensor in model.items():
            got = staged.tensors[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape
            assert tensor_bytes(got).tobytes() == tensor_bytes(tensor).tobytes()
    finally:
        region.close()


def _damage(placed: list[PlacedTensor], fault: str, at: int, region: shm.ShmRegion) -> list[PlacedTensor] | None:
    """A damaged copy of the placed list (None: no damage possible or asked)."""
    i = at % len(placed)
    out = [
        PlacedTensor(tensor_index=p.tensor_index, offset=p.offset, byte_length=p.byte_length, crc32=p.crc32)
        for p in placed
    ]
    if fault == "reorder" and len(out) > 1:
        j = (i + 1) % len(out)
        out[i], out[j] = out[j], out[i]
    elif fault == "drop":
        del out[i]
    elif fault == "repeat":
        out.insert(i, out[i])
    elif fault == "shift" and out[i].byte_length:
        out[i].offset += 1
    elif fault == "flip" and out[i].byte_length:
        fd = os.open(region.path, os.O_RDONLY)
        raw = bytearray(os.pread(fd, 1, out[i].offset))
        os.close(fd)
        raw[0] ^= 0x01
        region.write(out[i].offset, torch.tensor(list(raw), dtype=torch.uint8).numpy())
    elif fault == "length":
        out[i].byte_length += 1
    else:
        return None
    return out


def test_buckets_cover_every_tensor_once_in_order() -> None:
    w = weights(0)
    specs = [spec_of(n, t) for n, t in w.items()]
    for size in (1, 100, 4096, 1 << 20, 1 << 30):
        buckets = plan_buckets(specs, size)
        assert [i for b in buckets for i in b] == list(range(len(specs)))
        for b in buckets:
            assert len(b) == 1 or sum(specs[i].byte_length for i in b) <= size


# --- the receiver keeps a sender's region mapped between pushes -----------------------------


def _receive_over(receiver: WeightReceiver, region: shm.ShmRegion, model: dict[str, torch.Tensor], version: int):
    return receiver.receive(iter(iter_push_requests(model, version, data_plane=ShmSender(region))))


@contextlib.contextmanager
def _receiver_and_region(**planes: object) -> Iterator[tuple[WeightReceiver, shm.ShmRegion]]:
    """A receiver for `weights(...)`-shaped pushes (TransportOffer `planes`) and a sender's
    region, both closed afterwards."""
    specs = [spec_of(n, t) for n, t in weights(1).items()]
    receiver = WeightReceiver(
        model_specs=lambda selector: specs,
        served_version=lambda: 0,
        keep_staging=False,
        transports=TransportOffer(**planes),  # type: ignore[arg-type]
    )
    region = shm.ShmRegion()
    try:
        yield receiver, region
    finally:
        receiver.close()
        region.close()


def test_a_second_push_over_the_same_region_reuses_its_mapping() -> None:
    """Mapping a large region costs as much as copying it: a receiver keeps it for the next push
    of the same sender, and what it stages from the kept mapping is the new push's bytes."""
    with _receiver_and_region() as (receiver, region):
        _receive_over(receiver, region, weights(1), 1)
        assert receiver.regions.kept == [region.name]
        (kept,) = receiver.regions._kept.values()
        second = weights(2)
        staged = _receive_over(receiver, region, second, 2)
        assert receiver.regions._kept[region.name] is kept  # the same reader, not reopened
        for name, tensor in second.items():
            assert tensor_bytes(staged.tensors[name]).tobytes() == tensor_bytes(tensor).tobytes()
    assert receiver.regions.kept == []


@pytest.mark.parametrize("change", ["closed by the sender", "made readable by others"])
def test_a_kept_region_is_checked_again_before_it_is_reused(change: str) -> None:
    with _receiver_and_region() as (receiver, region):
        _receive_over(receiver, region, weights(1), 1)
        assert receiver.regions.kept == [region.name]
        items = list(iter_push_requests(weights(2), 2, data_plane=ShmSender(region)))
        if change == "closed by the sender":
            region.close()
        else:
            os.chmod(region.path, 0o644)
        with pytest.raises(TransportUnavailableError, match="does not exist|not a private"):
            receiver.receive(iter(items))
        assert receiver.regions.kept == []  # the stale reader was closed, not kept


def test_a_failed_push_does_not_keep_its_region_and_idle_regions_are_released() -> None:
    with _receiver_and_region(shm_keep_mapped_s=0.2) as (receiver, region):
        items = list(iter_push_requests(weights(1), 1, data_plane=ShmSender(region)))
        region.write(0, torch.full((8,), 7, dtype=torch.uint8).numpy())  # rewritten after its checksum
        with pytest.raises(InvalidRequestError, match="CRC-32"):
            receiver.receive(iter(items))
        assert receiver.regions.kept == []
        _receive_over(receiver, region, weights(1), 1)
        assert receiver.regions.kept == [region.name]
        for _ in range(100):  # released by the idle timer (0.2 s), not by the next push
            if not receiver.regions.kept:
                break
            threading.Event().wait(0.05)
        assert receiver.regions.kept == []


def test_keeping_regions_mapped_can_be_turned_off() -> None:
    with _receiver_and_region(shm_keep_mapped_s=0) as (receiver, region):
        _receive_over(receiver, region, weights(1), 1)
        assert receiver.regions.kept == []
    with pytest.raises(ValueError, match="shm_keep_mapped_s"):
        TransportOffer(shm_keep_mapped_s=-1)
